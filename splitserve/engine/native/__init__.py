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


def _flags(avx512: bool = False) -> list[str]:
    """The compiler's flags for this CPU; avx512: with -mavx512f where it has AVX-512 (the small
    GEMM's block kernels only: the paged-attention kernel built with it rounded differently)."""
    flags = ["-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11"]
    try:
        with open("/proc/cpuinfo") as f:
            cpu = f.read()
        if " avx2" in cpu and " fma" in cpu and " f16c" in cpu:
            flags += ["-mavx2", "-mfma", "-mf16c"]
            if avx512 and " avx512f" in cpu:
                flags += ["-mavx512f"]
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
    """A weight for SmallGemm: its fp32 tiles or its checkpoint's blocks (the other None)."""

    tiles: Any  # torch.Tensor [N/8, K, 8] float32, or None
    blocks: Any = None  # torch.Tensor [N/8, K/32, layout bytes] uint8 (gguf_blocks), or None
    fmt: str = ""  # the blocks' format (BLOCK_FORMATS), "" for none


class SmallGemm:
    """out = x @ W for up to MAX_M rows, W pre-packed (``pack``); streams the weights once.

    A weight is read from its checkpoint's blocks (``gguf_blocks``: GGUF Q4_0, Q4_1, Q8_0, F16,
    BF16, de-quantized in registers) when it has them, else from its fp32 tiles; both give the
    same floats, so the same result bit for bit.

    MAX_M: up to here the kernel beat MKL's sgemm on this model's weights (2 threads: 3.8x
    at 8 rows, 1.8x at 32, 1.5x at 64, 1.3x at 128; at 256 and 512 they were even), so
    every decode step and short prefill chunk goes through it; longer forwards use MKL.
    """

    MAX_M = 128
    QK = 32  # k steps per block (small_gemm.c)
    Q_TILES = 4  # tiles of 8 columns per block kernel call (QNT): a weight's columns are a multiple of 32

    def __init__(self, lib: ctypes.CDLL, num_threads: int):
        self.fn = lib.small_gemm
        self.fn_blocks = lib.small_gemm_blocks
        self.num_threads = num_threads

    @classmethod
    def fits_blocks(cls, k: int, n: int) -> bool:
        """Whether a [K, N] weight can be read as blocks (else it keeps fp32 tiles)."""
        return k % cls.QK == 0 and n % (8 * cls.Q_TILES) == 0

    @classmethod
    def pack(cls, w_kn, known: Packed | None = None, blocks: tuple[str, Any] | None = None) -> Packed:
        """A [K, N] fp32 weight packed: its checkpoint's blocks (``blocks``: (format, gguf_blocks'
        tensor)) when given and the weight's shape allows them, else its fp32 tiles [N/8, K, 8]
        (N padded to a multiple of 8 with zero columns). known: W packed before (pack_cache),
        taken as it is when it is the same kind and its shapes are W's."""
        import torch

        K, N = w_kn.shape
        want_blocks = blocks is not None and cls.fits_blocks(K, N)
        if known is not None:
            tiles, got, fmt = known
            if want_blocks and got is not None and fmt == blocks[0] and tuple(got.shape[:2]) == (N // 8, K // cls.QK):
                return Packed(None, got, fmt)
            if not want_blocks and tiles is not None and tuple(tiles.shape) == (-(-N // 8), K, 8):
                if tiles.dtype == torch.float32:
                    return Packed(tiles)
            log.warning(
                "packed weights (%s) do not fit a [%d, %d] weight (%s): packed again",
                fmt or f"tiles {tuple(tiles.shape) if tiles is not None else None}",
                K,
                N,
                blocks[0] if want_blocks else "fp32 tiles",
            )
        if want_blocks:
            fmt, b = blocks
            if b.dtype != torch.uint8 or tuple(b.shape[:2]) != (N // 8, K // cls.QK):
                raise ValueError(f"{fmt} blocks of shape {tuple(b.shape)} are not a [{K}, {N}] weight's")
            return Packed(None, b, fmt)
        pad = (-N) % 8
        w = torch.cat([w_kn, w_kn.new_zeros(K, pad)], dim=1) if pad else w_kn
        return Packed(w.view(K, -1, 8).permute(1, 0, 2).contiguous())

    def __call__(self, x, packed: Packed, n: int):
        import torch

        M, K = x.shape
        if not x.is_contiguous():
            x = x.contiguous()
        if packed.blocks is not None:
            out = torch.empty(M, n, dtype=torch.float32)
            layout = BLOCK_FORMATS[packed.fmt][0]
            rc = self.fn_blocks(
                x.data_ptr(), packed.blocks.data_ptr(), M, K, n, out.data_ptr(), self.num_threads, layout
            )
            if rc != 0:
                raise RuntimeError(f"small_gemm_blocks failed ({rc})")
            return out
        n_pad = packed.tiles.shape[0] * 8
        out = torch.empty(M, n_pad, dtype=torch.float32)
        rc = self.fn(x.data_ptr(), packed.tiles.data_ptr(), M, K, n_pad, out.data_ptr(), self.num_threads)
        if rc != 0:
            raise RuntimeError(f"small_gemm failed ({rc})")
        return out if n_pad == n else out[:, :n]


def load_small_gemm(cache_dir: str, avx512: bool = True) -> ctypes.CDLL | None:
    """The kernel built for this CPU; avx512 False: without its AVX-512 block kernels even where the
    CPU has them (the tests check the 256-bit ones there too)."""
    flags = _flags(avx512)
    if "-mavx2" not in flags:
        return None  # the kernel is written with AVX2/FMA/F16C intrinsics
    lib = _build("small_gemm", cache_dir, flags)
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.small_gemm.restype = lib.small_gemm_blocks.restype = i
    lib.small_gemm.argtypes = [p, p, i, ctypes.c_int64, ctypes.c_int64, p, i]
    lib.small_gemm_blocks.argtypes = [p, p, i, ctypes.c_int64, ctypes.c_int64, p, i, i]
    return lib


# GGUF formats the block kernels read (small_gemm.c): the layout each is packed in, and a GGUF
# block's bytes (QK weights of one output column)
BLOCK_FORMATS = {"q4_0": (0, 18), "q4_1": (0, 20), "q8_0": (1, 34), "f16": (2, 64), "bf16": (3, 64)}


def gguf_blocks(fmt: str, raw):
    """A GGUF tensor's blocks, [N, K/32 * block bytes] uint8 (N output columns, each a row of
    blocks of 32 k), as the kernel reads them: [N/8, K/32, layout bytes] (small_gemm.c's block
    tiles). Scales are widened to float here, so the kernel makes the float gguf-py makes."""
    import torch

    N = raw.shape[0]
    _, size = BLOCK_FORMATS[fmt]
    nb = raw.shape[1] // size
    b = raw.reshape(N, nb, size)

    def lanes(t):  # [N, nb, ...] -> [N/8, nb, ..., 8]: column c of a tile at lane c
        t = t.reshape(N // 8, 8, nb, -1).permute(0, 2, 3, 1)
        return t.reshape(N // 8, nb, -1, 8)

    def scale(lo: int):  # the fp16 at bytes lo..lo+1 of each block, as float, in lanes
        f = b[:, :, lo : lo + 2].contiguous().view(torch.float16).float()
        return lanes(f).reshape(N // 8, nb, 8).contiguous().view(torch.uint8)

    if fmt in ("q4_0", "q4_1"):
        qs = b[:, :, -16:]
        codes = torch.cat([qs & 15, qs >> 4], dim=2)  # k 0..15 in the low nibbles, 16..31 in the high
        pairs = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)  # even k low, odd k high
        d = scale(0)
        if fmt == "q4_1":
            m = scale(2)
        else:  # w = d * (q - 8) = d * q + m with m = -8 d (exact)
            m = (-8 * d.view(torch.float32)).view(torch.uint8)
        parts = [d, m, lanes(pairs).reshape(N // 8, nb, -1)]
    elif fmt == "q8_0":
        parts = [scale(0), lanes(b[:, :, 2:]).reshape(N // 8, nb, -1)]
    else:  # f16, bf16: 32 halves a block, k-major in lanes
        halves = lanes(b.contiguous().view(torch.int16)).reshape(N // 8, nb, -1)
        parts = [halves.contiguous().view(torch.uint8)]
    return torch.cat(parts, dim=2).contiguous()


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


def _build(name: str, cache_dir: str, flags: list[str] | None = None) -> ctypes.CDLL | None:
    src = os.path.join(_HERE, f"{name}.c")
    flags = _flags() if flags is None else flags
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
