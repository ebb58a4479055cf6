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
import time
from typing import Any, NamedTuple

from splitserve.engine.cache_dir import making

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
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            info.data_ptr(),
            slots.data_ptr(),
            info.shape[0],
            q.shape[1],
            k_cache.shape[1],
            q.shape[2],
            scale,
            out.data_ptr(),
            self.num_threads,
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


class Packed(NamedTuple):
    """A weight for SmallGemm: fp32 tiles, and integer blocks giving back the same floats (or None)."""

    tiles: Any  # torch.Tensor [N/8, K, 8] float32
    blocks: Any = None  # torch.Tensor [N/8, K/32, bytes per block] uint8, or None
    fmt: str = ""  # the blocks' format: "q4_1" or "q8_0"


class SmallGemm:
    """out = x @ W for up to MAX_M rows, W pre-packed (``pack``); streams the weights once.

    Up to Q_MAX_M rows read W's integer blocks when it has them, more rows its fp32 tiles;
    both give the same floats.

    MAX_M: up to here the kernel beat MKL's sgemm on this model's weights (2 threads: 3.8x
    at 8 rows, 1.8x at 32, 1.5x at 64, 1.3x at 128; at 256 and 512 they were even), so
    every decode step and short prefill chunk goes through it; longer forwards use MKL.
    """

    MAX_M = 128

    QK = 32  # k steps per block (small_gemm.c)
    Q_TILES = 4  # tiles of 8 columns per quantized kernel call (QNT)
    Q_MAX_M = 4  # rows the quantized kernels take (QMAX_M); beyond that the FMAs bind and fp32 tiles are faster

    def __init__(self, lib: ctypes.CDLL, num_threads: int):
        self.fn = lib.small_gemm
        self.fn_q = {"q4_1": lib.small_gemm_q4, "q8_0": lib.small_gemm_q8}
        self.num_threads = num_threads

    @classmethod
    def pack(cls, w_kn, known: Packed | None = None) -> Packed:
        """[K, N] -> its fp32 tiles [N/8, K, 8] (N padded to a multiple of 8 with zero
        columns), and its integer blocks when W is exactly made of them (``pack_blocks``).
        known: W packed before (pack_cache), taken as it is when its shapes are W's."""
        import torch

        K, N = w_kn.shape
        if known is not None:
            tiles, blocks, fmt = known
            if (
                tuple(tiles.shape) == (-(-N // 8), K, 8)
                and tiles.dtype == torch.float32
                and (
                    blocks is None
                    or (
                        tuple(blocks.shape[:2]) == (N // 8, K // cls.QK)
                        and fmt in ("q4_1", "q8_0")
                        and blocks.dtype == torch.uint8
                    )
                )
            ):
                return Packed(tiles, blocks, fmt)
            log.warning(
                "packed weights of shape %s (%s) do not fit a [%d, %d] weight: packed again",
                tuple(tiles.shape),
                fmt or "no blocks",
                K,
                N,
            )
        pad = (-N) % 8
        w = torch.cat([w_kn, w_kn.new_zeros(K, pad)], dim=1) if pad else w_kn
        tiles = w.view(K, -1, 8).permute(1, 0, 2).contiguous()
        for fmt in ("q4_1", "q8_0"):
            blocks = cls.pack_blocks(w_kn, fmt)
            if blocks is not None:
                return Packed(tiles, blocks, fmt)
        return Packed(tiles)

    @classmethod
    def pack_blocks(cls, w_kn, fmt: str):
        """[K, N] -> [N/8, K/32, bytes] of GGUF-style blocks, or None when W is not exactly that.

        Weights de-quantized from GGUF blocks of 32 consecutive k of one output column are
        stored that way again, with a float scale (and offset):
          q4_1: w = d * q + m, q in 0..15 (6 bits a weight); m is the block's least value;
          q8_0: w = d * q, q in -128..127 (9 bits a weight).
        d is one of the fp16 values nearest the block's range over the code range; a block
        is kept only if the formula gives back every one of its 32 floats bit for bit, and
        the tensor only if every block does, so the kernel computes exactly what it would
        from the fp32 weights.
        """
        import torch

        K, N = w_kn.shape
        if K % cls.QK or N % (8 * cls.Q_TILES) or w_kn.dtype != torch.float32:
            return None
        wb = w_kn.reshape(K // cls.QK, cls.QK, N)
        KB, step = K // cls.QK, max(1, (1 << 18) // (cls.QK * N))  # temporaries of 1 MB: in cache
        starts = [0, *range(1, KB, step)]  # the first block row alone: most weights fail there at once
        parts = []
        for i, j in zip(starts, starts[1:] + [KB]):
            scales, ok, q = _fit_blocks(wb[i:j], fmt)
            if not ok.all():
                return None
            kb = q.shape[0]
            if fmt == "q4_1":
                q = q[:, 0::2] | (q[:, 1::2] << 4)  # even k low nibble, odd k high
            codes = q.view(torch.uint8).reshape(kb, -1, N // 8, 8).permute(2, 0, 1, 3).reshape(N // 8, kb, -1)
            head = [t.reshape(kb, N // 8, 8).permute(1, 0, 2).contiguous().view(torch.uint8) for t in scales]
            parts.append(torch.cat([*head, codes], dim=2))
        return torch.cat(parts, dim=1).contiguous()

    def __call__(self, x, packed: Packed, n: int):
        import torch

        M, K = x.shape
        if not x.is_contiguous():
            x = x.contiguous()
        n_pad = packed.tiles.shape[0] * 8
        out = torch.empty(M, n_pad, dtype=torch.float32)
        if packed.blocks is not None and M <= self.Q_MAX_M:
            fn, w = self.fn_q[packed.fmt], packed.blocks
        else:
            fn, w = self.fn, packed.tiles
        rc = fn(x.data_ptr(), w.data_ptr(), M, K, n_pad, out.data_ptr(), self.num_threads)
        if rc != 0:
            raise RuntimeError(f"small_gemm failed ({rc})")
        return out if n_pad == n else out[:, :n]


def load_small_gemm(cache_dir: str) -> ctypes.CDLL | None:
    if "-mavx2" not in _flags():
        return None  # the kernel is written with AVX2/FMA intrinsics
    lib = _build("small_gemm", cache_dir)
    if lib is None:
        return None
    p = ctypes.c_void_p
    for fn in (lib.small_gemm, lib.small_gemm_q4, lib.small_gemm_q8):
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, p, ctypes.c_int]
    return lib


def _fit_blocks(wb, fmt: str):
    """wb: [blocks, 32, N] fp32 -> the scales ((d, m) for q4_1, (d,) for q8_0), each [blocks, N];
    ok [blocks, N] (the formula gives back w bit for bit); the codes [blocks, 32, N] (uint8 / int8)."""
    import torch

    if fmt == "q4_1":
        m, lo, hi, dtype = wb.amin(1), 0, 15, torch.uint8
        est = ((wb.amax(1).double() - m.double()) / 15).half()
    else:
        m, lo, hi, dtype = None, -128, 127, torch.int8
        est = (wb.abs().amax(1).double() / 127).half()
    base = wb - m.unsqueeze(1) if m is not None else wb
    bits = est.view(torch.int16)
    best_d, best_q, ok = None, None, None
    for step in (0, 1, -1):  # the nearest fp16 value first, then its neighbours
        d = (bits + step).clamp(min=0).view(torch.float16).float() if step else est.float()
        pos = (d > 0).unsqueeze(1)
        q = torch.where(pos, torch.round(base / torch.where(pos, d.unsqueeze(1), 1.0)), 0).clamp(lo, hi)
        w = d.unsqueeze(1) * q + m.unsqueeze(1) if m is not None else d.unsqueeze(1) * q
        hit = (w.view(torch.int32) == wb.view(torch.int32)).all(1)
        if best_d is None:
            best_d, best_q, ok = d, q, hit
        else:
            take = hit & ~ok
            best_d = torch.where(take, d, best_d)
            best_q = torch.where(take.unsqueeze(1), q, best_q)
            ok = ok | hit
        if ok.all():
            break
    return ((best_d, m) if m is not None else (best_d,)), ok, best_q.to(dtype)


def _compile(name: str, src: str, flags: list[str], so: str) -> bool:
    """Build ``so``, a kernel no process built earlier (one baked into an image needs no compiler);
    False (said in the log) when it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found and no %s built for these flags: falling back to pure torch", name)
        return False
    out_dir = os.path.dirname(so)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    except OSError as e:  # e.g. a read-only image whose baked kernels were built for other flags
        log.warning("cannot build %s in %s (%s): falling back to pure torch", name, out_dir, e)
        return False
    os.close(fd)
    t = time.perf_counter()
    proc = subprocess.run([cc, *flags, src, "-o", tmp, "-lm"], capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        log.warning("compiling %s failed, using pure torch: %s", name, proc.stderr.strip()[:500])
        return False
    os.chmod(tmp, 0o755)  # mkstemp made it 0600: others (an image's user) must load it too
    os.replace(tmp, so)
    log.info("compiled the %s kernel in %.1f s: %s", name, time.perf_counter() - t, so)
    return True


def _build(name: str, cache_dir: str) -> ctypes.CDLL | None:
    src = os.path.join(_HERE, f"{name}.c")
    flags = _flags()
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir, "kernels")
    so = os.path.join(out_dir, f"{name}-{key}.so")
    with making(so):  # processes starting together: one compiles, the others load what it built
        if not os.path.isfile(so) and not _compile(name, src, flags, so):
            return None
    try:
        return ctypes.CDLL(so)
    except OSError as e:  # e.g. baked by another user and not readable by this one
        log.warning("cannot load %s (%s): falling back to pure torch", so, e)
        return None
