"""Prometheus metrics: one registry per process, served on ``/metrics``.

Names follow vLLM's where one exists (``vllm:num_requests_running`` ->
``splitserve_num_requests_running``, ``vllm:time_to_first_token_seconds`` ->
``splitserve_time_to_first_token_seconds``, ...), with the ``splitserve_`` prefix and
Prometheus' unit suffixes. The process's role is a target label of the scrape
(Kubernetes pod/container), not a metric label, as in vLLM.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

log = logging.getLogger(__name__)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - a scrape a second is not worth a log line
        pass


class _HTTPServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
PART_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
BYTES_BUCKETS = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)

P = "splitserve_"


class _ModelRegistry(CollectorRegistry):
    """A registry whose every sample carries the served model's name, vLLM's ``model_name`` label,
    once it is known (a process knows it once its model or tokenizer is loaded)."""

    def __init__(self):
        super().__init__(auto_describe=True)
        self.model_name = ""

    def collect(self):
        for family in super().collect():  # built anew at each collect: labelled in place
            if self.model_name:
                label = {"model_name": self.model_name}
                family.samples = [s._replace(labels={**label, **s.labels}) for s in family.samples]
            yield family


class Metrics:
    """Base: a registry of its own (so tests may build several) and the HTTP endpoint."""

    def __init__(self):
        self.registry = _ModelRegistry()
        self._server = None

    def label_model(self, name: str) -> None:
        """Label every sample model_name=name from now on."""
        self.registry.model_name = name

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics; port 0 picks a free one, a negative port turns the endpoint off (returns 0)."""
        if port < 0:
            return 0
        # prometheus_client's start_http_server, but polled every 50 ms, not 500: close(), at every
        # process's stop, waits for the serving thread to see it
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsHTTPServer", (_HTTPServer,), {"address_family": family})
        self._server = make_server(host, port, make_wsgi_app(self.registry), server_class, handler_class=_QuietHandler)
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics", daemon=True
        ).start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def c(self, name, doc, labels=()):
        return Counter(P + name, doc, labels, registry=self.registry)

    def g(self, name, doc, labels=()):
        return Gauge(P + name, doc, labels, registry=self.registry)

    def h(self, name, doc, buckets, labels=()):
        return Histogram(P + name, doc, labels, buckets=buckets, registry=self.registry)


class RouterMetrics(Metrics):
    def __init__(self):
        super().__init__()
        self.queue_requests = self.g(
            "queue_requests",
            "Admitted requests not yet picked up by a prefill worker, or "
            "not yet at their first token when their decode worker "
            "prefills them (all routers; from Redis)",
        )
        self.queue_tokens = self.g("queue_tokens", "Prompt tokens of the queued requests (all routers; from Redis)")
        self.queue_limit_requests = self.g("queue_limit_requests", "Queued requests from which admission refuses")
        self.queue_limit_tokens = self.g("queue_limit_tokens", "Queued prompt tokens from which admission refuses")
        self.decode_workers = self.g("decode_workers", "Decode workers in the Redis registry")
        self.lease_lapses = self.c(
            "decode_lease_lapses",
            "Decode workers whose registry entry lapsed while this router's channel to them was up "
            "and carried streams (kept placeable for a grace while no other worker is registered)",
        )
        self.in_flight = self.g("requests_in_flight", "Requests this router is serving now")
        self.admitting = self.g(
            "requests_admitting", "Requests this router has validated whose admission script has not answered"
        )
        self.refused = self.c("requests_refused", "Admissions refused with RESOURCE_EXHAUSTED", ["reason"])
        self.local_refusals = self.c(
            "local_refusals", "Of those, the ones the router's local view refused before validating or placing them"
        )
        self.cancelled = self.c("requests_cancelled", "Requests cancelled before they finished", ["reason"])
        self.failed = self.c("request_failures", "Requests that ended with an error, by gRPC status", ["code"])
        # (a tenant's name, never its token; only with SPLITSERVE_AUTH_TOKENS_FILE)
        self.tenant_calls = self.c(
            "tenant_calls", "Authenticated calls of the public API, by tenant and RPC", ["tenant", "rpc"]
        )
        self.tenant_refused = self.c(
            "tenant_quota_refusals", "Requests refused for their tenant's queue quota, by tenant", ["tenant"]
        )
        self.success = self.c("request_success", "Requests that finished, by finish reason", ["finished_reason"])
        self.replayed = self.c(
            "requests_replayed",
            "Requests sent again with the request_id of one that had finished, answered with its recorded result",
        )
        self.reaped = self.c(
            "requests_reaped",
            "Unended requests of routers that went away (lease run out), marked failed by this router",
        )
        self.prompt_tokens = self.c("prompt_tokens", "Prompt tokens of admitted requests")
        self.prompt_tokens_cached = self.c(
            "prompt_tokens_cached",
            "Prompt tokens of ended requests that a worker found in its prefix cache (usage.cached_tokens)",
        )
        self.local_prefills = self.c(
            "local_prefills",
            "Admitted requests prefilled by their decode worker, not a "
            "prefill worker (colocated, or conditional disaggregation)",
        )
        self.prefix_placements = self.c(
            "requests_placed_by_prefix",
            "Requests placed on a decode worker other "
            "than the least loaded, for the prefix it "
            "is expected to hold (prefix affinity)",
        )
        self.prefill_directed = self.c(
            "requests_sent_to_prefill_worker",
            "Admitted requests queued for the "
            "prefill worker expected to hold the start "
            "of their prompt (prefill affinity)",
        )
        self.prefix_records_applied = self.c(
            "prefix_records_applied",
            "Prefix records of other routers (a decode "
            "worker's chain of cached blocks) applied to "
            "this router's record",
        )
        self.taken_back = self.c(
            "requests_taken_back",
            "Requests taken back from the prefill queue while no "
            "prefill worker was registered, for their decode worker "
            "to prefill",
        )
        self.resumed = self.c(
            "requests_resumed",
            "Requests that resumed on another decode worker after theirs was "
            "lost mid-stream (killed, unreachable, or stopped past its drain "
            "time): their prompt and the tokens sent so far prefilled again",
        )
        self.generation_tokens = self.c("generation_tokens", "Tokens generated and sent to clients")
        self.structured = self.c(
            "requests_structured", "Admitted requests held to a structured output format, by its kind", ["kind"]
        )
        self.ttft = self.h("time_to_first_token_seconds", "Request received -> first token sent", TTFT_BUCKETS)
        self.tpot = self.h(
            "time_per_output_token_seconds", "Mean time between output tokens, per request", TPOT_BUCKETS
        )
        # vLLM's inter-token latency: each gap between a sample's tokens as they reach the router
        self.inter_token = self.h(
            "inter_token_latency_seconds", "Time between two output tokens of a sample, at the router", TPOT_BUCKETS
        )
        self.e2e = self.h("e2e_request_latency_seconds", "Request received -> last token sent", E2E_BUCKETS)
        # TTFT split into contiguous parts.
        self.admission_time = self.h(
            "request_admission_time_seconds",
            "TTFT part: received -> admitted (validate, tokenize, route, admit)",
            PART_BUCKETS,
        )
        self.queue_time = self.h(
            "request_queue_time_seconds", "TTFT part: admitted -> picked up by prefill", PART_BUCKETS
        )
        self.prefill_time = self.h("request_prefill_time_seconds", "TTFT part: picked up -> prefill done", PART_BUCKETS)
        self.kv_transfer_time = self.h(
            "request_kv_transfer_time_seconds",
            "Prefill done -> KV adopted by the decode worker (alongside the first token's trip, not part of TTFT)",
            PART_BUCKETS,
        )
        self.first_token_time = self.h(
            "request_first_token_time_seconds", "TTFT part: prefill done -> first token at the router", PART_BUCKETS
        )

    def observe_finished(
        self, timings, finish_reason: str, completion_tokens: int, tpot_tokens: int | None = None
    ) -> None:
        """tpot_tokens: the tokens the decode took its steps for (sampling.n > 1: its longest sample's,
        0: unknown); by default completion_tokens."""
        self.success.labels(finish_reason or "unknown").inc()
        self.generation_tokens.inc(completion_tokens)
        if timings.ttft_ms:
            self.ttft.observe(timings.ttft_ms / 1000)
            for hist, ms in (
                (self.admission_time, timings.admission_ms),
                (self.queue_time, timings.queue_ms),
                (self.prefill_time, timings.prefill_ms),
                (self.kv_transfer_time, timings.kv_transfer_ms),
                (self.first_token_time, timings.first_token_ms),
            ):
                hist.observe(max(ms, 0.0) / 1000)
        self.e2e.observe(timings.e2e_ms / 1000)
        steps = completion_tokens if tpot_tokens is None else tpot_tokens
        if steps > 1:
            self.tpot.observe(timings.decode_ms / 1000 / (steps - 1))


class EngineMetrics(Metrics):
    """Per engine step, from the engine's StepStats; shared by prefill and decode workers."""

    def __init__(self):
        super().__init__()
        self.running = self.g("num_requests_running", "Sequences in the engine's running batch")
        self.waiting = self.g("num_requests_waiting", "Sequences waiting for the engine")
        self.blocks_used = self.g("kv_cache_blocks_used", "KV cache blocks in use")
        self.blocks_free = self.g("kv_cache_blocks_free", "KV cache blocks free")
        self.kv_usage = self.g("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.blocks_cached = self.g(
            "kv_cache_blocks_cached",
            "KV cache blocks holding a cached prompt prefix (in use or free; free ones are handed out last)",
        )
        self.prefix_hits = self.c(
            "prefix_cache_hit_tokens",
            "Tokens whose KV a sequence found in the prefix cache instead of computing it (recomputes included)",
        )
        # vLLM's pair (tokens queried, tokens hit), whose ratio is the cache's hit rate
        self.prefix_queries = self.c(
            "prefix_cache_queries", "Tokens of the sequences admitted that were looked up in the prefix cache"
        )
        self.prefix_cache_hits = self.c(
            "prefix_cache_hits", "Tokens of those found in the prefix cache (prefix_cache_hit_tokens, by vLLM's name)"
        )
        self.threads = self.g(
            "engine_threads",
            "Compute threads of the engine's last step (fewer while other engines on its core-share board are busy)",
        )
        self.steps = self.c("engine_steps", "Engine steps (forwards) run")
        self.stalled = self.g(
            "engine_stalled",
            "1 while the engine's step in progress has run longer than "
            "ENGINE_STALL_S (the worker then reports NOT_SERVING)",
        )
        self.graphed = self.c(
            "engine_graphed_steps",
            "Engine steps that replayed captured CUDA graphs (whole, or pieces around attention)",
        )
        self.step_seqs = self.h("iteration_sequences", "Sequences per engine step", SEQ_BUCKETS)
        self.step_tokens = self.h(
            "iteration_tokens", "Tokens computed per engine step (padding included)", TOKEN_BUCKETS
        )
        self.budget_use = self.h(
            "iteration_token_budget_usage", "Tokens per step / max_num_batched_tokens", RATIO_BUCKETS
        )
        self.step_time = self.h("iteration_duration_seconds", "Engine step wall time", STEP_BUCKETS)
        self.device_time = self.h(
            "iteration_device_seconds",
            "CUDA: an engine step's forward on the device, "
            "between events on its stream (other processes' work meanwhile included)",
            STEP_BUCKETS,
        )
        self.prefill_tokens = self.c("engine_prefill_tokens", "Prompt tokens computed by engine steps")
        self.decode_tokens = self.c("engine_decode_tokens", "Decode tokens computed by engine steps")
        self.preemptions = self.c("num_preemptions", "Sequences preempted (KV freed, to be recomputed)")
        self.padding = self.c("padding_tokens", "Padding positions computed for nothing (static/dynamic batching)")
        self.computed = self.c("computed_tokens", "Token positions computed, padding included")
        self.padding_ratio = self.h("iteration_padding_ratio", "Padding / computed positions per step", RATIO_BUCKETS)

    def follow(self, engine) -> None:
        """Read the engine's batch and KV pool at each scrape. Set per step, these gauges kept the
        last step's figures while a worker sat idle: a prefill worker whose last batch had been
        exported, or a decode worker whose last sequence was aborted, showed KV still in use."""
        pool = engine.cache.pool
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.blocks_used.set_function(lambda: pool.num_used)
        self.blocks_free.set_function(lambda: pool.num_free)
        self.kv_usage.set_function(lambda: pool.num_used / max(1, pool.num_blocks))
        self.blocks_cached.set_function(lambda: pool.num_cached)

    def observe_step(self, engine) -> None:
        s = engine.last_stats
        self.threads.set(engine.num_threads)
        if s.num_preempted:
            self.preemptions.inc(s.num_preempted)
        if s.num_cached_tokens:
            self.prefix_hits.inc(s.num_cached_tokens)
            self.prefix_cache_hits.inc(s.num_cached_tokens)
        if s.num_queried_tokens:
            self.prefix_queries.inc(s.num_queried_tokens)
        if not s.num_tokens:
            return
        self.steps.inc()
        if s.graphed:
            self.graphed.inc()
        self.step_seqs.observe(s.num_seqs)
        self.step_tokens.observe(s.num_tokens)
        self.budget_use.observe(min(1.0, s.num_tokens / max(1, engine.config.max_num_batched_tokens)))
        self.step_time.observe(s.step_time_s)
        if s.device_time_s:
            self.device_time.observe(s.device_time_s)
        self.prefill_tokens.inc(s.num_prefill_tokens)
        self.decode_tokens.inc(s.num_decode_tokens)
        self.computed.inc(s.num_tokens)
        if s.policy != "continuous":
            self.padding.inc(s.padding_tokens)
            self.padding_ratio.observe(s.padding_tokens / s.num_tokens)


class PrefillMetrics(EngineMetrics):
    def __init__(self):
        super().__init__()
        self.jobs = self.c("prefill_jobs", "Jobs pulled from the queue, by outcome", ["outcome"])
        self.deferred = self.c(
            "prefill_jobs_deferred",
            "Jobs of a resumed request that waited for its earlier leg "
            "(superseded: its decode worker was lost) to leave this worker first",
        )
        self.jobs_from = self.c(
            "prefill_jobs_started",
            "Jobs whose prefill started here, by the stream they came "
            "from: shared (a priority class's), own (sent to this worker: prefill affinity), "
            "departed (sent to a worker gone from the registry)",
            ["stream"],
        )
        self.kv_bytes = self.c("kv_transfer_bytes", "KV bytes handed to decode workers", ["transport"])
        self.kv_seconds = self.h(
            "kv_transfer_seconds", "KV handoff: prefill done -> PutKV answered", PART_BUCKETS, ["transport"]
        )
        self.kv_size = self.h("kv_transfer_size_bytes", "KV bytes per handoff", BYTES_BUCKETS, ["transport"])
        self.kv_unsent = self.c(
            "kv_unsent_tokens",
            "Prompt tokens whose KV was not sent as bytes (gRPC): the decode worker held them in its prefix cache",
        )
        self.kv_resent = self.c(
            "kv_resent_whole",
            "Handoffs sent again whole: the decode worker held less of the prompt's prefix than expected",
        )
        self.arena_used = self.g("arena_used_bytes", "Shared-memory arena bytes held by handoffs in flight")
        self.arena_size = self.g("arena_size_bytes", "Shared-memory arena size")


class DecodeMetrics(EngineMetrics):
    def __init__(self):
        super().__init__()
        self.streams = self.g("decode_streams_open", "Decode streams open (waiting for KV or decoding)")
        self.handoffs_waiting = self.g("kv_handoffs_waiting", "PutKV calls holding a KV that waits for free blocks")
        self.adopt_seconds = self.h(
            "kv_adopt_seconds",
            "PutKV received -> KV in the paged pool (blocks waited for included)",
            PART_BUCKETS,
            ["transport"],
        )
        self.kv_bytes = self.c("kv_received_bytes", "KV bytes adopted from prefill workers", ["transport"])
        self.handoffs_refused = self.c("kv_handoffs_refused", "PutKV calls refused, by gRPC status", ["code"])
        self.kv_shared_tokens = self.c(
            "kv_shared_tokens",
            "Tokens of adopted KV already in this worker's prefix cache: their blocks are shared, not filled again",
        )
        self.aborted = self.c("decode_aborted", "Sequences stopped because their stream went away")
        self.paused = self.g(
            "decode_streams_paused",
            "Sequences paused because their stream's reader (the router, the client behind it) is behind",
        )
        self.pauses = self.c("decode_stream_pauses", "Times a sequence was paused for a reader that was behind")
        self.lease_lapses = self.c(
            "registry_lease_lapses",
            "Heartbeats written after this worker's registry lease had lapsed (Redis away, or the process held)",
        )
        self.first_tokens = self.c(
            "first_tokens",
            "First tokens sent on Decode streams, by where they came from: "
            "stream (FirstTokens), call (FirstToken), kv (with the KV: no token came "
            "ahead of it), local (prefilled here)",
            ["via"],
        )
        self.first_tokens_dropped = self.c(
            "first_tokens_dropped",
            "FirstTokens stream messages dropped (invalid, no "
            "Decode stream open for the request, or of another leg of it): the KV "
            "handoff carries the token instead",
            ["reason"],
        )
