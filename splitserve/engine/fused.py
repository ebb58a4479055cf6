"""Fused CUDA kernels (Triton) for the steps the CUDA graphs replay: fewer, larger launches.

A decode step of a small model is launch-bound even when replayed from a graph: each of
the ~25 kernels of a layer costs a few microseconds, however little it computes. These
kernels take over what torch does in many:

- ``rope_qkv``: rotary embedding of q and k from the fused q/k/v projection, with the new
  K/V written into the paged cache: one kernel instead of eight (two products, a roll and
  a sum, the head slices made contiguous, two ``index_copy_``).
- ``paged_decode``: one new token per sequence against its context, read straight from the
  paged cache through its block table: one or two kernels instead of seven (K and V gathered
  up to the context bucket, a boolean mask made a bias, q made contiguous, SDPA, the output
  copied), and no reads of the padding up to the bucket. Long contexts are split over
  several programs (flash-decoding), whose partial results a second kernel combines.
- ``silu_mul``: the MLP's ``SiLU(gate) * up`` in one kernel.

The model adds the residuals with ``addmm`` when these are on (LlamaModel.attn_out). Each
kernel computes in fp32 whatever its tensors' dtype (bf16 and fp16 values are widened as they
are loaded) and rounds once, as it stores.

Triton ships with torch's CUDA wheels; without it the engine runs torch's ops as before
(``load()`` returns None). The kernels are plain Triton, so Triton's interpreter runs them on
CPU tensors (``TRITON_INTERPRET=1``, set before Triton is imported): that is how the CPU
tests check them against torch's ops.
"""

from __future__ import annotations

import logging

import torch

from splitserve.engine.attention import sdpa_decode
from splitserve.engine.cuda_graphs import pow2_at_least

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


BLOCK_N = 32  # context tokens per loop iteration of the decode kernel
NEG = -1.0e30  # a score below any real one (the decode kernel's -inf)
MIN_SPLIT_SLOTS = 16  # the combine kernel takes up to this many splits (2048 tokens) in one variant
SPLIT_TILES = 4  # iterations per program: a program reads at most BLOCK_N * SPLIT_TILES tokens
SPLIT_TOKENS = BLOCK_N * SPLIT_TILES  # a split's span of context


def num_splits(blocks: int, block_size: int) -> int:
    """The splits (programs per sequence and KV head) of decode attention over a table of blocks."""
    return -(-blocks * block_size // SPLIT_TOKENS)


if triton is not None:
    # Strides and counts that vary from step to step are not specialised on (no compile per value):
    # every variant a model uses is compiled by self_check() when the engine starts.
    @triton.jit(do_not_specialize=["qkv_stride", "cs_stride", "cache_stride"])
    def _rope_qkv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_ptr,
        kc_ptr,
        vc_ptr,
        qkv_stride,
        cs_stride,
        cache_stride,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        HP: tl.constexpr,
        WRITE: tl.constexpr,
    ):
        """One token a program: its q and k heads rotated (x * cos + roll(x, D/2) * sin, the
        model's own formula), q and k stored, and with WRITE its k and v stored at its cache slot."""
        t = tl.program_id(0)
        h = tl.arange(0, HP)[:, None]
        d = tl.arange(0, D)[None, :]
        valid = h < HQ + 2 * HKV
        row = qkv_ptr + t * qkv_stride + h * D
        x = tl.load(row + d, mask=valid, other=0.0).to(tl.float32)
        rolled = tl.load(row + (d + D // 2) % D, mask=valid, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * cs_stride + d).to(tl.float32)
        s = tl.load(sin_ptr + t * cs_stride + d).to(tl.float32)
        rotated = h < HQ + HKV
        y = tl.where(rotated, x * c + rolled * s, x)
        tl.store(q_ptr + (t * HQ + h) * D + d, y, mask=h < HQ)
        is_k = (h >= HQ) & rotated
        tl.store(k_ptr + (t * HKV + h - HQ) * D + d, y, mask=is_k)
        if WRITE:
            slot = tl.load(slot_ptr + t)
            tl.store(kc_ptr + slot * cache_stride + (h - HQ) * D + d, y, mask=is_k)
            tl.store(vc_ptr + slot * cache_stride + (h - HQ - HKV) * D + d, y, mask=valid & (h >= HQ + HKV))

    @triton.jit(do_not_specialize=["q_stride", "cache_stride", "table_stride", "out_stride", "nsplit"])
    def _paged_decode_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        table_ptr,
        len_ptr,
        out_ptr,
        pacc_ptr,
        pml_ptr,
        scale,
        q_stride,
        cache_stride,
        table_stride,
        out_stride,
        nsplit,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
        DIRECT: tl.constexpr,
        NEG: tl.constexpr,
    ):
        """Program (sequence, KV head, split): the split's stretch of the context for the KV head's
        G query heads, with an online softmax. DIRECT (one split): the output; else the partial
        (unnormalised sum, running max, sum of weights) for _combine_kernel."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kvh * G + g
        gmask = g < G
        q = tl.load(q_ptr + s * q_stride + heads[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
        q = q.to(tl.float32)
        n_ctx = tl.load(len_ptr + s)
        # A fixed TILES iterations, masked past the context (a dynamic bound does not run under
        # the interpreter). NEG stands for -inf: a split past the context keeps max NEG, sum 0.
        m_i = tl.full([GP], NEG, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        offs = tl.arange(0, BLOCK)
        for i in range(TILES):
            n = (sp * TILES + i) * BLOCK + offs
            nmask = n < n_ctx
            blk = tl.load(table_ptr + s * table_stride + n // BS, mask=nmask, other=0)
            kv_off = (blk * BS + n % BS)[:, None] * cache_stride + kvh * D + d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=nmask[:, None], other=0.0).to(tl.float32)  # [BLOCK, D]
            v = tl.load(vc_ptr + kv_off, mask=nmask[:, None], other=0.0).to(tl.float32)
            sc = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK]
            sc = tl.where(nmask[None, :], sc, NEG)
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(nmask[None, :], tl.exp(sc - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        if DIRECT:
            o = acc / l_i[:, None]
            tl.store(out_ptr + s * out_stride + heads[:, None] * D + d[None, :], o, mask=gmask[:, None])
        else:
            part = (s * tl.num_programs(1) + kvh) * nsplit + sp  # [S, HKV, nsplit] partials
            tl.store(pacc_ptr + (part * GP + g)[:, None] * D + d[None, :], acc)
            tl.store(pml_ptr + (part * GP + g) * 2, m_i)
            tl.store(pml_ptr + (part * GP + g) * 2 + 1, l_i)

    @triton.jit(do_not_specialize=["out_stride", "nsplit"])
    def _combine_kernel(
        pacc_ptr,
        pml_ptr,
        out_ptr,
        out_stride,
        nsplit,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        SP: tl.constexpr,
        NEG: tl.constexpr,
    ):
        """Program (sequence, KV head): its splits' partials weighed by exp(max - overall max).
        A split past the context has max NEG: weight 0."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.arange(0, SP)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        part = (s * tl.num_programs(1) + kvh) * nsplit + sp  # [SP]
        present = sp < nsplit
        idx = (part[:, None] * GP + g[None, :]) * 2  # [SP, GP]
        m = tl.load(pml_ptr + idx, mask=present[:, None], other=NEG)
        l = tl.load(pml_ptr + idx + 1, mask=present[:, None], other=0.0)  # noqa: E741 - flash attention's m and l
        top = tl.max(m, axis=0)  # [GP]
        w = tl.where(present[:, None], tl.exp(m - top[None, :]), 0.0)
        total = tl.sum(l * w, axis=0)
        acc = tl.load(
            pacc_ptr + ((part[:, None] * GP + g[None, :]) * D)[:, :, None] + d[None, None, :],
            mask=present[:, None, None],
            other=0.0,
        )  # [SP, GP, D]
        o = tl.sum(acc * w[:, :, None], axis=0) / total[:, None]
        heads = kvh * G + g
        tl.store(out_ptr + s * out_stride + heads[:, None] * D + d[None, :], o, mask=(g < G)[:, None])

    @triton.jit(do_not_specialize=["inter", "gu_stride"])
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, gu_stride, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        gate = tl.load(gu_ptr + t * gu_stride + c, mask=m, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + t * gu_stride + inter + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * inter + c, gate / (1.0 + tl.exp(-gate)) * up, mask=m)


class FusedOps:
    """The kernels above for one model shape (heads, KV heads, head size)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        assert triton is not None, "Triton is not installed"
        assert head_dim == pow2_at_least(head_dim, 1) and head_dim % 2 == 0, "head_dim must be a power of two"
        self.hq, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor | None = None,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
    ):
        """qkv [T, (Hq + 2 Hkv) * D] (rows contiguous); cos, sin [T, 1, D] -> q [T, Hq, D] and k
        [T, Hkv, D] rotated, v [T, Hkv, D] (a view of qkv). With slots [T], k and v are also
        written to k_cache, v_cache [slots, Hkv, D] at those slots."""
        T = qkv.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        assert qkv.stride(1) == 1 and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
        q = torch.empty(T, hq, d, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(T, hkv, d, dtype=qkv.dtype, device=qkv.device)
        v = qkv.view(T, hq + 2 * hkv, d)[:, hq + hkv :]
        write = slots is not None
        if T:
            _rope_qkv_kernel[(T,)](
                qkv,
                cos,
                sin,
                slots if write else qkv,
                q,
                k,
                k_cache if write else q,
                v_cache if write else q,
                qkv.stride(0),
                cos.stride(0),
                k_cache.stride(0) if write else 0,
                HQ=hq,
                HKV=hkv,
                D=d,
                HP=pow2_at_least(hq + 2 * hkv, 1),
                WRITE=write,
            )
        return q, k, v

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [S, Hq, D] (one new token each, rows contiguous); caches [slots, Hkv, D]; tables [S, nb]
        the block ids (only those under lens are read); lens [S] >= 1, each one's context with the
        new token -> [S, Hq * D] (into out if given)."""
        S = q.shape[0]
        hq, hkv, d = self.hq, self.hkv, self.d
        if out is None:
            out = torch.empty(S, hq * d, dtype=q.dtype, device=q.device)
        if S == 0:
            return out
        assert q.stride(2) == 1 and q.stride(1) == d and k_cache.stride(1) == d and out.stride(1) == 1
        nsplit = num_splits(tables.shape[1], block_size)
        gp = pow2_at_least(self.group, 2)
        direct = nsplit == 1
        if direct:
            pacc = pml = out
        else:
            pacc = torch.empty(S * hkv * nsplit * gp * d, dtype=torch.float32, device=q.device)
            pml = torch.empty(S * hkv * nsplit * gp * 2, dtype=torch.float32, device=q.device)
        _paged_decode_kernel[(S, hkv, nsplit)](
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            out,
            pacc,
            pml,
            scale,
            q.stride(0),
            k_cache.stride(0),
            tables.stride(0),
            out.stride(0),
            nsplit,
            G=self.group,
            GP=gp,
            D=d,
            BS=block_size,
            BLOCK=BLOCK_N,
            TILES=SPLIT_TILES,
            DIRECT=direct,
            NEG=NEG,
        )
        if not direct:
            _combine_kernel[(S, hkv)](
                pacc,
                pml,
                out,
                out.stride(0),
                nsplit,
                G=self.group,
                GP=gp,
                D=d,
                SP=pow2_at_least(nsplit, MIN_SPLIT_SLOTS),
                NEG=NEG,
            )
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate then up) -> SiLU(gate) * up, [T, I]."""
        T, two = gu.shape
        inter = two // 2
        assert gu.stride(1) == 1
        out = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
        if T:
            block = 1024
            _silu_mul_kernel[(T, -(-inter // block))](gu, out, inter, gu.stride(0), BLOCK=block)
        return out


def load(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    block_size: int = 16,
    max_context: int = 0,
    dtype: torch.dtype = torch.float32,
) -> FusedOps | None:
    """FusedOps for a model's shape on device, checked there against torch's ops; None (with a
    warning naming why) where Triton is missing, the shape does not suit, or the check fails.
    The engine then runs torch's ops, as it does on the CPU. block_size: the paged cache's;
    max_context: the longest context the engine decodes at; dtype: its activations' and KV's.
    The check runs the kernel variants for all three, so none compiles inside a step."""
    if triton is None:
        log.warning("Triton is not installed: CUDA steps run torch's ops, unfused")
        return None
    if head_dim != pow2_at_least(head_dim, 1):
        log.warning("fused kernels need a power-of-two head size (got %d): CUDA steps run torch's ops", head_dim)
        return None
    if num_heads % num_kv_heads:
        log.warning(
            "fused kernels need the query heads (%d) to be a multiple of the KV heads (%d): CUDA steps run torch's ops",
            num_heads,
            num_kv_heads,
        )
        return None
    ops = FusedOps(num_heads, num_kv_heads, head_dim)
    try:
        problem = self_check(ops, device, block_size, max_context, dtype=dtype)
    except Exception as e:  # a compile or launch failure on this device or Triton build
        problem = f"{type(e).__name__}: {e}"
    if problem:
        log.warning("fused kernels failed their check on %s (%s): CUDA steps run torch's ops", device, problem)
        return None
    log.info("fused kernels (Triton %s) checked on %s: in use", triton.__version__, device)
    return ops


def reference_decode(q, k_cache, v_cache, tables, lens, block_size: int, scale: float) -> torch.Tensor:
    """paged_decode's result by torch's ops, one sequence at a time: its context gathered through
    its table, then SDPA."""
    rows = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        slots = (tables[i].unsqueeze(1) * block_size + torch.arange(block_size, device=q.device)).view(-1)[:n]
        rows.append(
            sdpa_decode(
                q[i : i + 1],
                k_cache[slots].transpose(0, 1).unsqueeze(0),
                v_cache[slots].transpose(0, 1).unsqueeze(0),
                None,
                scale,
            )
        )
    return torch.cat(rows)


def combine_spans(max_context: int) -> list[int]:
    """A block table's span in tokens for each variant of the combine kernel that contexts up to
    max_context need past the first (2048 tokens): the variants go by the count of splits,
    rounded up to a power of two."""
    spans, splits = [], 2 * MIN_SPLIT_SLOTS
    while (splits // 2) * SPLIT_TOKENS < max_context:
        spans.append(splits * SPLIT_TOKENS)
        splits *= 2
    return spans


def self_check(
    ops: FusedOps,
    device: torch.device,
    block_size: int = 16,
    max_context: int = 0,
    atol: float = 1e-4,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Run each kernel once on small random inputs against torch's ops: "" or what differed.
    It runs each variant that the engine's steps use: those for block_size, for contexts up to
    max_context, and for dtype (in half precision, within a few of its units in the last place:
    the kernels round once where torch's ops round after each)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = ops.hq, ops.hkv, ops.d, block_size
    rtol = 0.0 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    atol = atol if dtype == torch.float32 else 4 * torch.finfo(dtype).eps

    def close(a, b):
        return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)

    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    T = 5
    qkv = rnd(T, (hq + 2 * hkv) * d)
    cos, sin = rnd(T, 1, d), rnd(T, 1, d)
    k_cache, v_cache = rnd(8 * bs, hkv, d), rnd(8 * bs, hkv, d)
    slots = torch.tensor([3, 17, 40, 41, 100], device=device)
    q, k, v = ops.rope_qkv(qkv, cos, sin, slots, k_cache, v_cache)
    x = qkv.view(T, -1, d)[:, : hq + hkv]
    want = x * cos + torch.roll(x, d // 2, dims=-1) * sin
    if not close(torch.cat([q, k], 1), want):
        return "rotary embedding"
    if not (torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)):
        return "KV cache write"
    q1, k1, _ = ops.rope_qkv(qkv, cos, sin)  # without the write (static and dynamic batches)
    if not (torch.equal(q1, q) and torch.equal(k1, k)):
        return "rotary embedding without the KV write"
    order = [5, 1, 7, 2, 6, 3, 4, 0]  # the 8 blocks of the cache above, shuffled
    q2 = rnd(2, hq, d)
    # Tables of 128 tokens (one split) and of 256 (two, the first row's context in both), then
    # as wide as the combine's variants need, with the contexts short.
    for span in [128, 256] + combine_spans(max_context):
        width = -(-span // bs)
        t = torch.tensor([(order * width)[:width], [2] + [0] * (width - 1)], device=device)
        n = torch.tensor([200 if span > 128 else 40, 9], device=device)
        if not close(
            ops.paged_decode(q2, k_cache, v_cache, t, n, bs, d**-0.5),
            reference_decode(q2, k_cache, v_cache, t, n, bs, d**-0.5),
        ):
            splits = num_splits(width, bs)
            return f"paged decode attention ({splits} split{'s' if splits > 1 else ''})"
    gu = rnd(3, 2 * 40)
    if not close(ops.silu_mul(gu), torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]):
        return "SiLU and product"
    return ""
