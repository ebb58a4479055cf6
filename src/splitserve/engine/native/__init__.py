"""Small C kernels, compiled on first use with the system C compiler and loaded with ctypes.

No torch headers are involved, so a build takes about a second; the shared object is
cached under ``<cache_dir>/kernels`` keyed by the source and the flags. When no
compiler is available the engine falls back to its pure-torch path (and says so).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

log = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11"]
    try:
        with open("/proc/cpuinfo") as f:
            cpu = f.read()
        if " avx2" in cpu and " fma" in cpu:
            flags += ["-mavx2", "-mfma"]
    except OSError:
        pass
    return flags


class PagedAttention:
    """Callable wrapper: one C call per layer for all cache-reading sequences."""

    def __init__(self, lib: ctypes.CDLL, num_threads: int):
        self.fn = lib.paged_attention
        self.num_threads = num_threads

    def __call__(self, q, k_cache, v_cache, info, slots, scale: float, out) -> None:
        # q: [T, Hq, D] contiguous view rows; k/v_cache: [slots, Hkv, D]; out: [T, Hq*D]
        if not q.is_contiguous():
            q = q.contiguous()
        rc = self.fn(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), info.data_ptr(), slots.data_ptr(),
            info.shape[0], q.shape[1], k_cache.shape[1], q.shape[2], scale, out.data_ptr(), self.num_threads,
        )
        if rc != 0:
            raise RuntimeError(f"paged_attention kernel failed ({rc})")


def load_paged_attention(cache_dir: str) -> ctypes.CDLL | None:
    lib = _build("paged_attention", cache_dir)
    if lib is None:
        return None
    fn = lib.paged_attention
    fn.restype = ctypes.c_int
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, p, p, p, p, i, i, i, i, ctypes.c_float, p, i]
    return lib


class SmallGemm:
    """out = x @ W for up to MAX_M rows, W pre-packed as [N/8, K, 8]; streams the weights once.

    MAX_M: up to here the kernel beat MKL's sgemm on this model's weights (2 threads: 3.8x
    at 8 rows, 1.8x at 32, 1.5x at 64, 1.3x at 128; at 256 and 512 they were even), so
    every decode step and short prefill chunk goes through it; longer forwards use MKL.
    """

    MAX_M = 128

    def __init__(self, lib: ctypes.CDLL, num_threads: int):
        self.fn = lib.small_gemm
        self.num_threads = num_threads

    @staticmethod
    def pack(w_kn):
        """[K, N] -> [N/8, K, 8] (N padded to a multiple of 8 with zero columns)."""
        import torch

        K, N = w_kn.shape
        pad = (-N) % 8
        if pad:
            w_kn = torch.cat([w_kn, w_kn.new_zeros(K, pad)], dim=1)
        return w_kn.view(K, -1, 8).permute(1, 0, 2).contiguous()

    def __call__(self, x, packed, n: int):
        import torch

        M, K = x.shape
        if not x.is_contiguous():
            x = x.contiguous()
        n_pad = packed.shape[0] * 8
        out = torch.empty(M, n_pad, dtype=torch.float32)
        rc = self.fn(x.data_ptr(), packed.data_ptr(), M, K, n_pad, out.data_ptr(), self.num_threads)
        if rc != 0:
            raise RuntimeError(f"small_gemm failed ({rc})")
        return out if n_pad == n else out[:, :n]


def load_small_gemm(cache_dir: str) -> ctypes.CDLL | None:
    if "-mavx2" not in _flags():
        return None  # the kernel is written with AVX2/FMA intrinsics
    lib = _build("small_gemm", cache_dir)
    if lib is None:
        return None
    fn = lib.small_gemm
    fn.restype = ctypes.c_int
    p = ctypes.c_void_p
    fn.argtypes = [p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, p, ctypes.c_int]
    return lib


def _build(name: str, cache_dir: str) -> ctypes.CDLL | None:
    src = os.path.join(_HERE, f"{name}.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s falls back to pure torch", name)
        return None
    flags = _flags()
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir, "kernels")
    so = os.path.join(out_dir, f"{name}-{key}.so")
    if not os.path.isfile(so):
        try:
            os.makedirs(out_dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        except OSError as e:  # e.g. a read-only image whose baked kernels were built for other flags
            log.warning("cannot build %s in %s (%s): falling back to pure torch", name, out_dir, e)
            return None
        os.close(fd)
        proc = subprocess.run([cc, *flags, src, "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            log.warning("compiling %s failed, using pure torch: %s", name, proc.stderr.strip()[:500])
            return None
        os.replace(tmp, so)
    return ctypes.CDLL(so)
