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


def _small_gemm(threads: int = 2):
    lib = native.load_small_gemm(ModelSpec().cache_dir)
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


def _block_weight(fmt: str, k: int, n: int, seed: int = 0) -> torch.Tensor:
    """[K, N] fp32 made the way a GGUF tensor of that format is de-quantized, per 32 k of a
    column: q4_1 w = d * q + m (fp16 d and m, q in 0..15, 0 and 15 in every block); q8_0
    w = d * q (fp16 d, q in -127..127, +-127 in every block)."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    d = (torch.rand(blocks, 1, n, generator=g) * 0.01 + 1e-4).half().float()
    if fmt == "q4_1":
        m = (torch.randn(blocks, 1, n, generator=g) * 0.05).half().float()
        q = torch.randint(0, 16, (blocks, 32, n), generator=g).float()
        q[:, 0], q[:, 1] = 0, 15
        return (d * q + m).reshape(k, n)
    q = torch.randint(-127, 128, (blocks, 32, n), generator=g).float()
    q[:, 0] = torch.where(torch.rand(blocks, n, generator=g) < 0.5, -127.0, 127.0)
    return (d * q).reshape(k, n)


@pytest.mark.parametrize("fmt, bits", [("q4_1", 6), ("q8_0", 9)])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 32)])
def test_block_weights_give_the_fp32_products_bit_for_bit(fmt, bits, k, n):
    """Weights that are exactly GGUF blocks are kept as such; every row count the block
    kernels take gives the fp32 tiles' products bit for bit, alone or beside other rows."""
    sg = _small_gemm()
    w = _block_weight(fmt, k, n)
    packed = sg.pack(w)
    assert packed.fmt == fmt and packed.blocks.dtype == torch.uint8
    assert packed.blocks.numel() == k * n * bits // 8  # not 32 bits a weight
    fp32_only = packed._replace(blocks=None)
    torch.manual_seed(k)
    x = torch.randn(9, k)
    whole = sg(x, fp32_only, n)
    torch.testing.assert_close(whole, x @ w, rtol=1e-4, atol=1e-4)
    for m in range(1, sg.Q_MAX_M + 1):
        for rows in (slice(0, m), slice(9 - m, 9)):
            assert torch.equal(sg(x[rows], packed, n), whole[rows]), (m, rows)
    assert torch.equal(_small_gemm(1)(x[:3], packed, n), whole[:3])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_weights_that_are_not_exactly_blocks_stay_fp32(fmt):
    sg = _small_gemm()
    assert sg.pack(torch.randn(576, 960)).blocks is None
    w = _block_weight(fmt, 576, 960)
    w[300, 17] = torch.nextafter(w[300, 17], torch.tensor(1.0))  # one weight one ulp off
    assert sg.pack(w).blocks is None
    assert sg.pack(_block_weight(fmt, 576, 968)).blocks is None  # columns not a multiple of the kernel's 32
    assert sg.pack(_block_weight(fmt, 576, 960)[:560]).blocks is None  # K not a multiple of 32


def test_packed_weights_kept_on_disk_are_mapped_back_as_packed_and_a_wrong_entry_is_packed_again(tmp_path, caplog):
    """pack_cache: the tiles and blocks a process packed, written and read back by another, are
    the same Packed, mapped from the entry's file (not copied); an entry whose weights do not fit
    a weight's shape, or that cannot be read, is not used (the weight is packed again)."""
    from splitserve.engine import pack_cache

    sg = _small_gemm()
    weights = {
        (0, "w_qkv"): _block_weight("q4_1", 576, 960),
        (0, "w_o"): _block_weight("q8_0", 64, 32, seed=1),
        "lm_head": torch.randn(64, 44),
    }  # (44 columns: tiles padded to 48)
    fitted = {key: sg.pack(w) for key, w in weights.items()}
    assert [p.fmt for p in fitted.values()] == ["q4_1", "q8_0", ""]
    dest = pack_cache.entry(str(tmp_path), "/cache/models/SmolLM2-abc")
    assert pack_cache.read(dest) is None  # no entry yet
    pack_cache.write(dest, fitted)
    # an image bakes it as root and runs as another user
    assert os.stat(dest).st_mode & 0o777 == 0o755 and os.stat(os.path.join(dest, pack_cache.FILE)).st_mode & 0o004
    known = pack_cache.read(dest)
    assert set(known) == set(weights) and known["lm_head"].blocks is None and known["lm_head"].fmt == ""
    for key, w in weights.items():
        again = sg.pack(w, known[key])
        assert again.fmt == fitted[key].fmt and torch.equal(again.tiles, fitted[key].tiles)
        assert mapped_from(again.tiles, os.path.join(dest, pack_cache.FILE))
        assert not mapped_from(fitted[key].tiles, os.path.join(dest, pack_cache.FILE))  # (the check can fail)
        assert (again.blocks is None) == (fitted[key].blocks is None)
        if again.blocks is not None:
            assert torch.equal(again.blocks, fitted[key].blocks)
    # another weight's (the wrong shape): packed again, and said so
    wrong = sg.pack(_block_weight("q4_1", 1536, 576), known[0, "w_qkv"])
    want = sg.pack(_block_weight("q4_1", 1536, 576))
    assert torch.equal(wrong.blocks, want.blocks) and torch.equal(wrong.tiles, want.tiles)
    assert "packed again" in caplog.text
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
