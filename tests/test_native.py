"""The native kernels (paged attention, small-M GEMM) against torch."""

import os

import pytest
import torch
from engine_helpers import mapped_from

from splitserve.engine import native
from splitserve.engine.attention import AttnSeq, RaggedBatch, chunk_mask
from splitserve.engine.config import ModelSpec


@pytest.fixture(scope="module")
def kernel():
    lib = native.load_paged_attention(ModelSpec().cache_dir)
    assert lib is not None, "the C kernel must build on this machine (gcc is part of the toolchain)"
    return native.PagedAttention(lib, 2)


@pytest.mark.parametrize("hq, hkv, D", [(9, 3, 64), (4, 4, 64), (8, 1, 64), (9, 3, 40), (6, 2, 20)])
def test_kernel_matches_sdpa_on_decode_and_chunks(kernel, hq, hkv, D):
    """D 64: every vector path; 40: vector scores, generic V sum; 20: the scalar paths."""
    torch.manual_seed(0)
    bs, nblocks = 16, 200
    kc = torch.randn(nblocks * bs, hkv, D)
    vc = torch.randn(nblocks * bs, hkv, D)
    perm = torch.randperm(nblocks)
    # (q_len, ctx_len): decodes, a later prefill chunk, a single-token context
    shapes = [(1, 37), (1, 300), (17, 90), (1, 1), (5, 5 + 64)]
    seqs, slots, info, q_start, off, b = [], [], [], 0, 0, 0
    for q_len, ctx in shapes:
        nb = -(-ctx // bs)
        table = perm[b : b + nb]
        b += nb
        slots.append((table.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx])
        seqs.append(AttnSeq(q_start, q_len, ctx, off, chunk_mask(q_len, ctx)))
        info.append((q_start, q_len, ctx, off))
        q_start += q_len
        off += ctx
    q = torch.randn(q_start, hq, D)
    batch = RaggedBatch(
        input_ids=torch.zeros(q_start, dtype=torch.long),
        positions=None,
        slot_mapping=None,
        logits_rows=None,
        seqs=seqs,
        ctx_slots=torch.cat(slots),
        ctx_info=torch.tensor(info),
    )
    want = batch.attention(q, None, None, kc, vc, D**-0.5, None)
    got = batch.attention(q, None, None, kc, vc, D**-0.5, kernel)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_backends_agree(tiny_engine_factory):
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + 13 * i)] for i in range(6)]
    from splitserve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    a = tiny_engine_factory(attention_backend="torch", max_num_batched_tokens=48).generate(prompts, params)
    b = tiny_engine_factory(attention_backend="native", max_num_batched_tokens=48).generate(prompts, params)
    assert a == b


def _small_gemm(threads: int = 2, avx512: bool = True):
    lib = native.load_small_gemm(ModelSpec().cache_dir, avx512)
    assert lib is not None, "the small-GEMM kernel must build on this (AVX2) machine"
    return native.SmallGemm(lib, threads)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 21, 64, 128])
@pytest.mark.parametrize("k, n", [(64, 96), (576, 963), (1536, 576)])
def test_small_gemm_matches_mm(m, k, n):
    sg = _small_gemm()
    torch.manual_seed(m)
    x, w = torch.randn(m, k), torch.randn(k, n)
    torch.testing.assert_close(sg(x, sg.pack(w), n), x @ w, rtol=1e-4, atol=1e-4)


def test_small_gemm_row_does_not_depend_on_the_batch():
    """A row's product is bit-for-bit the same alone, in any group of 8 rows and on any thread count."""
    torch.manual_seed(0)
    k, n = 576, 963
    x, w = torch.randn(37, k), torch.randn(k, n)
    sg = _small_gemm()
    packed = sg.pack(w)
    whole = sg(x, packed, n)
    for i in (0, 7, 8, 20, 36):
        assert torch.equal(sg(x[i : i + 1], packed, n)[0], whole[i])
        assert torch.equal(sg(x[max(0, i - 4) : i + 1], packed, n)[-1], whole[i])
    assert torch.equal(_small_gemm(1)(x, packed, n), whole)


GGUF_TYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "f16": "F16", "bf16": "BF16"}


def _gguf_weight(fmt: str, k: int, n: int, seed: int = 0):
    """A [K, N] weight as a GGUF file keeps it: gguf-py's blocks of it ([N, bytes a row] uint8) and
    what gguf-py de-quantizes them to ([K, N] float32: the reference)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = getattr(GGMLQuantizationType, GGUF_TYPES[fmt])
    a = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.05
    raw = quantize(a, kind)
    w = torch.from_numpy(dequantize(raw, kind).astype(np.float32)).t().contiguous()
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)), w


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("k, n", [(32, 32), (96, 160), (576, 960), (1536, 576)])
def test_block_kernels_match_dequantize_then_matmul(fmt, k, n):
    """Every format the kernel reads, every row count of a block kernel (1-8) and groups of them:
    the product of gguf-py's de-quantized weights, and bit for bit the fp32 tiles' product on
    them (the same floats, summed in the same order), alone or beside other rows."""
    sg = _small_gemm()
    raw, w = _gguf_weight(fmt, k, n)
    packed = sg.pack(w, blocks=(fmt, native.gguf_blocks(fmt, raw)))
    assert packed.fmt == fmt and packed.tiles is None and packed.blocks.dtype == torch.uint8
    tiles = sg.pack(w)
    torch.manual_seed(k + n)
    x = torch.randn(21, k)
    whole = sg(x, tiles, n)
    torch.testing.assert_close(whole, x @ w, rtol=1e-4, atol=1e-4)
    assert torch.equal(sg(x, packed, n), whole)  # groups of 8, 8 and 5 rows
    for m in range(1, 9):
        got = sg(x[:m], packed, n)
        torch.testing.assert_close(got, x[:m] @ w, rtol=1e-4, atol=1e-4)
        assert torch.equal(got, whole[:m]), m
        assert torch.equal(sg(x[21 - m :], packed, n), whole[21 - m :]), m
    assert torch.equal(_small_gemm(1)(x[:3], packed, n), whole[:3])
    # the 256-bit block kernels, which a CPU with AVX-512 does not use otherwise: the same
    assert torch.equal(_small_gemm(avx512=False)(x, packed, n), whole)
    assert torch.equal(_small_gemm(avx512=False)(x[:5], packed, n), whole[:5])


def test_blocks_take_only_whole_tiles_of_the_kernel_and_are_bytes_of_the_format():
    """A weight whose columns are not a multiple of 32 (or K of 32) keeps fp32 tiles; blocks read
    4.5 (Q4_0) to 16 bits a weight, against the tiles' 32."""
    sg = _small_gemm()
    for fmt, bits in (("q4_0", 6), ("q4_1", 6), ("q8_0", 9), ("f16", 16), ("bf16", 16)):
        raw, w = _gguf_weight(fmt, 64, 96)
        packed = sg.pack(w, blocks=(fmt, native.gguf_blocks(fmt, raw)))
        assert packed.blocks.numel() == 64 * 96 * bits // 8, fmt
        assert not sg.fits_blocks(64, 88) and sg.pack(w[:, :88], blocks=(fmt, None)).blocks is None
    assert sg.pack(torch.randn(48, 96), blocks=("q8_0", None)).tiles.shape == (12, 48, 8)


def test_packed_weights_kept_on_disk_are_mapped_back_as_packed_and_a_wrong_entry_is_packed_again(tmp_path, caplog):
    """pack_cache: the tiles and blocks a process packed, written and read back by another, are
    the same Packed, mapped from the entry's file (not copied); an entry whose weights do not fit
    a weight's shape, or that cannot be read, is not used (the weight is packed again)."""
    from splitserve.engine import pack_cache

    sg = _small_gemm()
    raw_a, w_a = _gguf_weight("q4_1", 576, 960)
    raw_b, w_b = _gguf_weight("q8_0", 64, 32, seed=1)
    weights = {
        (0, "w_qkv"): (w_a, ("q4_1", raw_a)),
        (0, "w_o"): (w_b, ("q8_0", raw_b)),
        "lm_head": (torch.randn(64, 44), None),
    }
    # (44 columns: tiles padded to 48)

    def blocks(b):
        return None if b is None else (b[0], native.gguf_blocks(*b))

    packed = {key: sg.pack(w, blocks=blocks(b)) for key, (w, b) in weights.items()}
    assert [p.fmt for p in packed.values()] == ["q4_1", "q8_0", ""]
    dest = pack_cache.for_weights(pack_cache.entry(str(tmp_path), "/cache/models/SmolLM2-abc"), "native")
    assert pack_cache.read(dest) is None  # no entry yet
    pack_cache.write(dest, packed)
    # an image bakes it as root and runs as another user
    assert os.stat(dest).st_mode & 0o777 == 0o755 and os.stat(os.path.join(dest, pack_cache.FILE)).st_mode & 0o004
    known = pack_cache.read(dest)
    assert set(known) == set(weights) and known["lm_head"].blocks is None and known["lm_head"].fmt == ""
    for key, (w, b) in weights.items():
        again = sg.pack(w, known[key], None if b is None else (b[0], known[key].blocks))
        assert again.fmt == packed[key].fmt
        kept = again.tiles if b is None else again.blocks
        assert torch.equal(kept, packed[key].tiles if b is None else packed[key].blocks)
        assert mapped_from(kept, os.path.join(dest, pack_cache.FILE))
        assert not mapped_from(
            packed[key].tiles if b is None else packed[key].blocks, os.path.join(dest, pack_cache.FILE)
        )
    # another weight's (the wrong shape, or tiles where blocks are asked for): packed again, and said so
    raw_c, w_c = _gguf_weight("q4_1", 1536, 576)
    wrong = sg.pack(w_c, known[0, "w_qkv"], ("q4_1", native.gguf_blocks("q4_1", raw_c)))
    assert torch.equal(wrong.blocks, native.gguf_blocks("q4_1", raw_c))
    assert "packed again" in caplog.text
    caplog.clear()
    assert sg.pack(w_c, known["lm_head"]).tiles.shape == (72, 1536, 8) and "packed again" in caplog.text
    with open(os.path.join(dest, pack_cache.FILE), "r+b") as f:  # a torn file
        f.truncate(100)
    assert pack_cache.read(dest) is None


def test_engine_routes_only_small_batches_to_small_gemm(tiny_engine_factory):
    from splitserve.engine.sampling import SamplingParams

    prompts = [[(5 * i + j) % 500 + 3 for j in range(9 + 4 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with_kernel = tiny_engine_factory(small_gemm=True)
    assert with_kernel.model.small_gemm is not None
    without = tiny_engine_factory(small_gemm=False)
    assert without.model.small_gemm is None
    assert with_kernel.generate(prompts, params) == without.generate(prompts, params)


def test_a_kernel_built_earlier_loads_without_a_compiler(tmp_path, monkeypatch):
    # The runtime image has no compiler: the kernels baked into its cache must still load.
    assert native._build("small_gemm", str(tmp_path)) is not None
    (so,) = (tmp_path / "kernels").iterdir()
    assert so.stat().st_mode & 0o777 == 0o755  # loadable by an image's non-root user when root baked it
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native._build("small_gemm", str(tmp_path)) is not None
    assert native._build("paged_attention", str(tmp_path)) is None  # never built here: falls back


def test_an_installed_copy_has_the_kernel_sources(tmp_path):
    # A non-editable install (the image's) compiles the kernels from the .c files it carries.
    import shutil
    import subprocess
    import sys
    import zipfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "tree"  # the files an image build copies, none of an editable install's metadata
    for folder in ("splitserve", "router", "prefill_worker", "decode_worker", "protos"):
        shutil.copytree(os.path.join(root, folder), tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(root, name), tree / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(tree),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("splitserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in ("small_gemm.c", "paged_attention.c"):
        assert f"splitserve/engine/native/{src}" in names
