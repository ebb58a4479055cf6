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
    src = os.path.join(_HERE, "paged_attention.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: using the slower pure-torch attention")
        return None
    flags = _flags()
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir, "kernels")
    so = os.path.join(out_dir, f"paged_attention-{key}.so")
    if not os.path.isfile(so):
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        proc = subprocess.run([cc, *flags, src, "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            log.warning("compiling the attention kernel failed, using pure torch: %s", proc.stderr.strip()[:500])
            return None
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    fn = lib.paged_attention
    fn.restype = ctypes.c_int
    p = ctypes.c_void_p
    i = ctypes.c_int
    fn.argtypes = [p, p, p, p, p, i, i, i, i, ctypes.c_float, p, i]
    return lib
