"""Model loading: one clear error line for every way it can go wrong."""

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
from engine_helpers import mapped_from

from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.loader import load_model


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelSpec(path=str(tmp_path / "nope")))


def _hub_cache_with(tmp_path, repo_id: str, folder: str) -> str:
    """A Hugging Face hub cache holding folder's files as repo_id's snapshot, laid out as
    huggingface_hub lays one out (models--org--name/refs/main names the snapshot's commit)."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(tmp_path / "hub")


def test_a_hub_id_is_found_in_the_local_hugging_face_cache_offline(tmp_path, monkeypatch, tiny_model_dir, tiny_loaded):
    """Guards against --model org/name read as a missing path: it is the cached snapshot, named
    org/name in the API; one it does not hold is one clear error naming the id and the cache."""
    import torch

    from splitserve.engine.loader import resolve_folder, served_model_name

    monkeypatch.setenv("HF_HUB_CACHE", _hub_cache_with(tmp_path, "acme/tiny-llama", tiny_model_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = ModelSpec(path="acme/tiny-llama", cache_dir=str(tmp_path / "cache"))
    assert resolve_folder(spec).endswith("models--acme--tiny-llama/snapshots/0123456789abcdef0123456789abcdef01234567")
    loaded = load_model(spec)
    assert loaded.name == "acme/tiny-llama" and served_model_name("", loaded.name) == "acme/tiny-llama"
    for key, tensor in tiny_loaded.state_dict.items():
        assert torch.equal(loaded.state_dict[key], tensor), key
    with pytest.raises(ModelLoadError) as e:
        load_model(ModelSpec(path="acme/other-model"))
    message = str(e.value)
    assert "acme/other-model" in message and str(tmp_path / "hub") in message and "\n" not in message, message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_checkpoint_loads_and_runs_in_float32_on_the_cpu(tmp_path, tiny_model_dir, dtype):
    """Guards against a bf16 or fp16 Hugging Face folder (how checkpoints are published) refused
    or run at a precision other than the one the CPU computes well: its weights are read as saved
    and the engine's greedy output equals transformers' on the same weights in float32."""
    import torch
    from transformers import LlamaForCausalLM

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.sampling import SamplingParams

    folder = str(tmp_path / dtype)
    LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype)).save_pretrained(folder)
    loaded = load_model(ModelSpec(path=folder, cache_dir=str(tmp_path / "cache")))
    assert {t.dtype for t in loaded.state_dict.values()} == {getattr(torch, dtype)}
    prompt = [5, 17, 99, 3, 250]
    eng = LLMEngine(EngineConfig(kv_cache_bytes=16 << 20), loaded=loaded)
    (got,) = eng.generate([prompt], [SamplingParams(max_tokens=12, ignore_eos=True)])
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert got == want[0, len(prompt) :].tolist()


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable GGUF"):
        load_model(ModelSpec(path=str(bad), cache_dir=str(tmp_path / "cache")))


def test_unsupported_architecture(tmp_path, tiny_model_dir):
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2"):
        load_model(ModelSpec(path=str(folder)))


def test_corrupt_safetensors(tmp_path, tiny_model_dir):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(tiny_model_dir, "config.json")).read())
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt weights file"):
        load_model(ModelSpec(path=str(folder)))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="expected a .gguf file"):
        load_model(ModelSpec(path=str(f)))


def test_cli_prints_one_line_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "check-model", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"splitserve: error: model path does not exist: {tmp_path / 'missing.gguf'}"]


def test_gguf_cache_is_keyed_by_content_not_path(tmp_path):
    """Two installs of the same GGUF share one converted copy; a changed file gets its own."""
    import shutil
    import time

    from splitserve.engine.loader import _cache_folder

    a = tmp_path / "venv-a" / "m.gguf"
    b = tmp_path / "venv-b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(os.urandom(1 << 20))
    time.sleep(0.01)
    shutil.copyfile(a, b)  # another path, another mtime
    assert os.stat(a).st_mtime_ns != os.stat(b).st_mtime_ns
    cache = str(tmp_path / "cache")
    assert _cache_folder(str(a), cache) == _cache_folder(str(b), cache)
    data = bytearray(b.read_bytes())
    data[len(data) // 2] ^= 1
    b.write_bytes(bytes(data))
    assert _cache_folder(str(a), cache) != _cache_folder(str(b), cache)


def test_a_gguf_files_digest_is_kept_by_its_identity_once_it_has_settled(tmp_path):
    """Hashing the default GGUF file took each process 0.2 s at its start: its digest is kept, by
    the file's device, inode, size and mtime, once the file has not been written for a while."""
    from splitserve.engine import loader

    path = tmp_path / "m.gguf"
    path.write_bytes(os.urandom(1 << 20))
    cache = str(tmp_path / "cache")
    fresh = loader._cache_folder(str(path), cache)
    assert not (tmp_path / "cache" / "digests").exists()  # just written: not kept
    old = time.time() - 2 * loader.DIGEST_SETTLED_S
    os.utime(path, (old, old))
    assert loader._cache_folder(str(path), cache) == fresh
    (memo,) = (tmp_path / "cache" / "digests").iterdir()
    assert memo.read_text() == hashlib.blake2b(path.read_bytes()).hexdigest()
    memo.write_text("0" * 128)  # the kept digest is the one used ...
    assert loader._cache_folder(str(path), cache) != fresh
    data = bytearray(path.read_bytes())  # ... until the file is written again
    data[7] ^= 1
    path.write_bytes(bytes(data))
    changed = os.path.basename(loader._cache_folder(str(path), cache))
    assert changed != os.path.basename(fresh)
    # hashed afresh: as a cache that never kept a digest of it names it
    assert changed == os.path.basename(loader._cache_folder(str(path), str(tmp_path / "other")))


def test_check_model_fills_the_cache_dir_the_workers_read(tmp_path, tiny_model_dir):
    """`splitserve check-model` bakes an image's cache: under SPLITSERVE_CACHE_DIR, as the workers
    read it (Settings), not under HOME."""
    from splitserve.service.settings import Settings

    env = dict(os.environ, SPLITSERVE_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "check-model", "--model", tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert Settings.from_env(env).cache_dir == str(tmp_path / "cache")
    kernels = sorted(os.listdir(tmp_path / "cache" / "kernels"))
    assert [k.split("-")[0] for k in kernels] == ["paged_attention", "small_gemm"], kernels
    assert not (tmp_path / "home").exists()


def test_converted_model_folder_is_readable_by_other_users(smol_folder):
    """An image bakes the converted model as root and runs as another user: mkdtemp's 0700 was
    not readable there, so every start tried to convert again (into a read-only filesystem).
    The folder checked is the one this session's model was converted into (by this run, on a
    fresh machine such as CI's): converting again here took half a minute."""
    folder = smol_folder
    assert os.path.exists(os.path.join(folder, "model.safetensors"))
    assert os.stat(folder).st_mode & 0o777 == 0o755
    assert all(os.stat(os.path.join(folder, f)).st_mode & 0o004 for f in os.listdir(folder))


def test_corrupt_tokenizer(tmp_path, smol_folder):
    import shutil

    from splitserve.engine.tokenizer import load_tokenizer

    folder = tmp_path / "badtok"
    shutil.copytree(smol_folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "tokenizer.json").write_text('{"model": "truncated')
    with pytest.raises(ModelLoadError, match=f"cannot load tokenizer in {folder}"):
        load_tokenizer(str(folder))
    (folder / "tokenizer.json").write_text(open(f"{smol_folder}/tokenizer.json").read())
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"cannot load tokenizer in {folder}"):
        load_tokenizer(str(folder))


def test_the_weights_laid_out_are_kept_mapped_from_disk_and_made_again_when_they_do_not_fit(tmp_path, smol_loaded):
    """Making the engine's layout (q, k, v and gate, up fused, each [in, out]) from the converted
    folder cost each worker ~1 s of CPU at its start: the first process keeps it (layout_cache)
    and the later ones map it from the file, with the same weights. One that does not fit the
    model (another layout, a torn entry) is made again."""
    import dataclasses

    import torch

    from splitserve.engine import layout_cache
    from splitserve.engine.model import LlamaModel

    loaded = dataclasses.replace(smol_loaded, laid_out={}, packed={})
    made = LlamaModel(loaded)
    assert made.made_layout
    dest = layout_cache.entry(str(tmp_path), "/cache/models/SmolLM2-abc")
    assert layout_cache.read(dest) is None  # no entry yet
    layout_cache.write(dest, made.laid_out())
    path = os.path.join(dest, layout_cache.FILE)
    assert os.stat(dest).st_mode & 0o777 == 0o755 and os.stat(path).st_mode & 0o004
    laid = layout_cache.read(dest)
    assert set(laid) == set(made.laid_out()) and len(laid) == 1 + 4 * made.shape.num_layers
    taken = LlamaModel(loaded, laid)
    assert not taken.made_layout
    for name, want in made.laid_out().items():
        assert torch.equal(taken.laid_out()[name], want), name
    # mapped from the file, not read into memory
    assert all(mapped_from(t, path) for t in taken.laid_out().values())
    assert taken.fingerprint == made.fingerprint
    laid["3.w_down"] = laid["3.w_down"].t().contiguous()  # [out, in]: not this model's layout
    again = LlamaModel(loaded, laid)
    assert again.made_layout and torch.equal(again.layers[3].w_down, made.layers[3].w_down)
    with open(path, "r+b") as f:  # a torn file
        f.truncate(1000)
    assert layout_cache.read(dest) is None


def _bytes_tokens():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
    return byte_chars + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>"], merges


def _write_gguf(path, arch: str, name: str, tied: bool, kinds: dict | None = None):
    """A small GGUF file of arch's layout, its weights random and stored as F32, F16, Q8_0 and Q4_1
    (the default file's kinds and one more; kinds: another, by tensor name), with a byte-level BPE
    vocabulary."""
    import gguf
    import numpy as np

    hidden, heads, kv_heads, ffn, layers = 64, 4, 2, 96, 2
    tokens, merges = _bytes_tokens()
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    if arch != "qwen2":
        w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")

    def put(name, shape, kind):
        a = rng.standard_normal(shape, dtype=np.float32)
        kind = (kinds or {}).get(name, kind)
        if kind == "F64":
            w.add_tensor(name, a.astype(np.float64))
        elif kind in ("Q8_0", "Q4_1", "Q4_0", "BF16"):
            q = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, a.astype(np.float16 if kind == "F16" else np.float32))

    put("token_embd.weight", (len(tokens), hidden), "Q8_0")
    if not tied:
        put("output.weight", (len(tokens), hidden), "F16")
    put("output_norm.weight", (hidden,), "F32")
    head = hidden // heads
    for i in range(layers):
        put(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        put(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        for part, rows in (("attn_q", hidden), ("attn_k", kv_heads * head), ("attn_v", kv_heads * head)):
            put(f"blk.{i}.{part}.weight", (rows, hidden), "Q4_1")
            if arch == "qwen2":
                put(f"blk.{i}.{part}.bias", (rows,), "F32")
        put(f"blk.{i}.attn_output.weight", (hidden, hidden), "Q4_1")
        put(f"blk.{i}.ffn_gate.weight", (ffn, hidden), "Q4_1")
        put(f"blk.{i}.ffn_up.weight", (ffn, hidden), "Q4_1")
        put(f"blk.{i}.ffn_down.weight", (hidden, ffn), "Q8_0")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_a_gguf_file_is_converted_to_what_transformers_makes_of_it(tmp_path, arch, tied):
    """gguf_convert reads GGUF files itself (transformers took 22 of a conversion's 30 s): its
    weights, config and tokenizer are transformers' own, tensor for tensor, on a file of each
    GGUF architecture the engine serves (a Mistral model's file is llama's): llama's q and k
    permuted back, qwen2's biases, a tied or an untied output."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitserve.engine.loader import resolve_folder

    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    _write_gguf(path, arch, "tiny", tied)
    folder = resolve_folder(ModelSpec(path=str(path), cache_dir=str(tmp_path / "cache")))

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    want = {k: v for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}
    got = load_file(os.path.join(folder, "model.safetensors"))
    assert sorted(got) == sorted(want)
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert unequal == []
    assert any("q_proj.bias" in k for k in got) == (arch == "qwen2")

    ref_config = json.loads(json.dumps(ref.config.to_dict()))  # as config.json has it
    ref_config.pop("quantization_config")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config == ref_config
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tied

    ref_tok = tmp_path / "ref_tok"
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(ref_tok))
    for f in sorted(os.listdir(ref_tok)):
        assert (ref_tok / f).read_bytes() == open(os.path.join(folder, f), "rb").read(), f


def test_a_gguf_file_cut_short_or_of_another_architecture_is_refused_naming_it(tmp_path):
    from splitserve.engine.loader import resolve_folder

    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", "tiny", tied=True)
    data = path.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        ModelLoadError,
        match=f"corrupt or unreadable GGUF file {short}: tensor blk.1.ffn_down.weight runs past the end of the file",
    ):
        resolve_folder(ModelSpec(path=str(short), cache_dir=str(tmp_path / "cache")))
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:300])
    with pytest.raises(ModelLoadError, match=f"corrupt or unreadable GGUF file {header}: "):
        resolve_folder(ModelSpec(path=str(header), cache_dir=str(tmp_path / "cache")))

    f64 = tmp_path / "f64.gguf"
    _write_gguf(f64, "llama", "tiny", tied=True, kinds={"blk.1.attn_norm.weight": "F64"})
    with pytest.raises(
        ModelLoadError, match=f"GGUF file {f64}: tensor blk.1.attn_norm.weight \\(F64\\) cannot be de-quantized"
    ):
        resolve_folder(ModelSpec(path=str(f64), cache_dir=str(tmp_path / "cache")))

    other = tmp_path / "gpt2.gguf"
    _write_gguf(other, "gpt2", "tiny", tied=True)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2' in .*gpt2.gguf"):
        resolve_folder(ModelSpec(path=str(other), cache_dir=str(tmp_path / "cache")))
    assert not os.path.exists(tmp_path / "cache" / "models") or os.listdir(tmp_path / "cache" / "models") == []


@pytest.mark.parametrize(
    "kinds",
    [
        {},  # Q4_1 projections, Q8_0 down and embedding, an F16 lm_head (263 columns: fp32 tiles)
        {
            **{f"blk.0.attn_{x}.weight": "Q4_0" for x in "qkv"},
            "blk.1.ffn_gate.weight": "BF16",
            "blk.1.ffn_up.weight": "BF16",
        },
        {"blk.0.attn_v.weight": "Q8_0"},  # q, k, v of two formats: that layer's w_qkv stays fp32
    ],
)
def test_weights_native_read_the_gguf_files_blocks_and_give_what_fp32_gives(
    tmp_path, kinds, tiny_gguf_engines, monkeypatch
):
    """weights native: each weight whose parts the file keeps in one format the kernel reads is
    read from the file's blocks (q and k in transformers' order), the others from fp32 tiles; the
    tokens and log probabilities are those of weights fp32 bit for bit, from prompts of 1-8 rows
    a step (blocks) to chunks of more (groups of 8)."""
    from splitserve.engine.sampling import SamplingParams

    native, fp32 = tiny_gguf_engines(kinds)
    fmts = [{k: p.fmt for k, p in layer.packed.items()} for layer in native.model.layers]
    want = {
        "w_qkv": kinds.get("blk.0.attn_q.weight", "Q4_1").lower(),
        "w_o": "q4_1",
        "w_gate_up": "q4_1",
        "w_down": "q8_0",
    }
    if kinds.get("blk.0.attn_v.weight") == "Q8_0":
        want["w_qkv"] = ""
    assert fmts[0] == want
    assert fmts[1]["w_gate_up"] == ("bf16" if "blk.1.ffn_gate.weight" in kinds else "q4_1")
    assert native.model.lm_head_packed.fmt == "" and native.model.lm_head_packed.tiles is not None
    assert {p.fmt for layer in fp32.model.layers for p in layer.packed.values()} == {""}
    prompts = [[5 + i, 9, 40 + 3 * i, 7] * (1 + 5 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0, temperature=0.0)

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        got = {}
        while eng.has_unfinished():
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(
                    (t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs)
                )
        return got

    assert run(native) == run(fp32)
    # a later process maps the blocks from the pack cache, without reading the file's again
    from splitserve.engine import engine as engine_module
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    monkeypatch.setattr(engine_module, "native_blocks", lambda loaded: pytest.fail("the file's blocks read again"))
    spec = native.config.model
    later = LLMEngine(EngineConfig(model=spec, weights="native", kv_cache_bytes=8 << 20), loaded=load_model(spec))
    assert [{k: p.fmt for k, p in layer.packed.items()} for layer in later.model.layers] == fmts
    assert later.model.lm_head_packed.fmt == "" and later.model.lm_head_packed.tiles is not None


@pytest.fixture
def tiny_gguf_engines(tmp_path):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    def make(kinds):
        path = tmp_path / "m.gguf"
        _write_gguf(path, "llama", "tiny", tied=False, kinds=kinds)
        spec = ModelSpec(path=str(path), cache_dir=str(tmp_path / "cache"))
        loaded = load_model(spec)
        return [
            LLMEngine(EngineConfig(model=spec, weights=w, kv_cache_bytes=8 << 20, prefix_caching=False), loaded=loaded)
            for w in ("native", "fp32")
        ]

    return make


def test_a_gguf_block_with_a_scale_that_is_not_a_number_is_refused_naming_it(tmp_path):
    """A damaged block (its fp16 scale NaN or inf) is one load error naming the tensor and the block,
    whether the weights are converted or read as blocks."""
    from splitserve.engine import gguf_convert
    from splitserve.engine.loader import resolve_folder

    path = tmp_path / "m.gguf"
    _write_gguf(path, "llama", "tiny", tied=True)
    t = gguf_convert.GGUFFile(str(path)).tensors["blk.1.attn_k.weight"]  # Q4_1: 20 bytes a block, d then m
    data = bytearray(path.read_bytes())
    data[t.offset + 20 * 5 + 2 : t.offset + 20 * 5 + 4] = b"\x00\x7c"  # block 5's m: +inf
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    blocks = t.nbytes // 20
    with pytest.raises(
        ModelLoadError,
        match=f"corrupt GGUF file {bad}: tensor blk.1.attn_k.weight \\(Q4_1\\) block 5 of {blocks} has a scale of inf",
    ):
        resolve_folder(ModelSpec(path=str(bad), cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ModelLoadError, match="tensor blk.1.attn_k.weight \\(Q4_1\\) block 5 of"):
        gguf_convert.native_blocks(gguf_convert.GGUFFile(str(bad)), 4, 2)


@pytest.mark.parametrize("kind", ["packed", "layout"])
def test_entries_an_earlier_format_left_are_removed_once_the_current_one_is_written_or_read(tmp_path, kind):
    """A release that changes PACK_FORMAT or LAYOUT_FORMAT left its predecessor's entries (107 MB
    for SmolLM2's packed weights at format 1) in the cache for good: they go once the current
    format's entry is written or read. Other models' entries, and those of a later format (a newer
    release sharing the cache), stay."""
    import torch

    from splitserve.engine import layout_cache, pack_cache
    from splitserve.engine.native import Packed

    if kind == "packed":
        cache, fmt, content = pack_cache, pack_cache.PACK_FORMAT, {"lm_head": Packed(torch.randn(4, 8), None, "")}
    else:
        cache, fmt, content = layout_cache, layout_cache.LAYOUT_FORMAT, {"embed": torch.randn(4, 8)}
    dest = cache.entry(str(tmp_path), "/cache/models/SmolLM2-abc")
    stem = "SmolLM2-abc"
    older, kept = [f"{stem}-{fmt - 1}"], [f"{stem}-{fmt + 1}", f"SmolLM2-abd-{fmt - 1}", f"{stem}-x"]
    if kind == "packed":  # an entry for each weights setting; the formats before it had none
        dest = pack_cache.for_weights(dest, "native")
        older.append(f"{stem}-native-{fmt - 1}")
        kept += [f"{stem}-fp32-{fmt}", f"{stem}-fp32-{fmt + 1}"]
        stem = f"{stem}-native"
    parent = os.path.dirname(dest)
    assert os.path.basename(dest) == f"{stem}-{fmt}"

    def leave(names):
        for name in names:
            os.makedirs(os.path.join(parent, name), exist_ok=True)
            with open(os.path.join(parent, name, "weights"), "wb") as f:
                f.write(b"x" * 64)

    leave(older + kept)
    cache.write(dest, content)
    assert sorted(os.listdir(parent)) == sorted([os.path.basename(dest)] + kept)
    leave(older)  # an older release, sharing the cache, wrote its entry again
    assert cache.read(dest) is not None
    assert sorted(os.listdir(parent)) == sorted([os.path.basename(dest)] + kept)


def test_processes_about_to_make_the_same_cache_entry_take_turns(tmp_path):
    """cache_dir.turn: the second holder waits (told first, so its engine leaves the cores to the
    first) until the first lets go; where no lock can be made (a read-only cache), no one waits."""
    import threading

    from splitserve.engine import cache_dir

    events = []
    first_in, release = threading.Event(), threading.Event()

    def first():
        with cache_dir.turn(str(tmp_path / "packed")):
            events.append("first in")
            first_in.set()
            release.wait(10)
            events.append("first out")

    t = threading.Thread(target=first)
    t.start()
    first_in.wait(10)
    threading.Timer(0.3, release.set).start()
    with cache_dir.turn(str(tmp_path / "packed"), waiting=lambda: events.append("second waits")):
        events.append("second in")
    t.join()
    assert events == ["first in", "second waits", "first out", "second in"]
    with cache_dir.turn(str(tmp_path / "packed"), waiting=lambda: events.append("waited")):  # free: no wait
        events.append("third in")
    assert events[-1] == "third in"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with cache_dir.turn(str(blocker / "packed"), waiting=lambda: events.append("waited")):  # cannot be made
        events.append("unlocked in")
    assert events[-1] == "unlocked in"


TWO_AT_ONCE = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from splitserve.engine.config import EngineConfig, ModelSpec
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling import SamplingParams
gguf, cache, me, other = sys.argv[1:5]
open(me, "w").close()
while not os.path.exists(other):  # both imported: they start at once
    time.sleep(0.001)
eng = LLMEngine(EngineConfig(model=ModelSpec(path=gguf, cache_dir=cache), kv_cache_bytes=4 << 20, num_threads=1))
print("TOKENS", eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0])
"""


def test_two_processes_starting_at_once_on_a_new_gguf_file_make_each_cache_entry_once(tmp_path):
    """A stack's workers start together. On a first start each converted the file, laid out the
    weights, compiled both kernels and packed the weights, and all but one process's entries were
    dropped: now one makes each entry while the other waits and reads it, and both serve the same."""
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    _write_gguf(path, "llama", "tiny", tied=False)
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                TWO_AT_ONCE,
                str(path),
                str(cache),
                str(tmp_path / f"go{i}"),
                str(tmp_path / f"go{1 - i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    both = "".join(outs)
    for made in (
        "converting ",
        "compiled the paged_attention kernel",
        "compiled the small_gemm kernel",
        "weights laid out for the model, kept at",
        "small-GEMM weights (native) packed in",
    ):
        assert both.count(made) == 1, (made, outs)
    tokens = [next(line for line in out.splitlines() if line.startswith("TOKENS")) for out in outs]
    assert tokens[0] == tokens[1], outs
