"""The engine in a checkpoint's half-precision dtype: bf16 and fp16 weights, activations and KV
cache, greedy output equal to transformers' in the same dtype, and a handoff that keeps the dtype
(and is refused, naming it, by an engine of another)."""

import pytest
import torch
from engine_helpers import drain, engine_factory_of, exported, hf_greedy, random_prompts

from splitserve.engine.config import EngineConfig, ModelSpec, resolve_dtype
from splitserve.engine.errors import KVImportError
from splitserve.engine.loader import load_model
from splitserve.engine.sampling import SamplingParams
from splitserve.handoff.layout import _HEADER, DTYPE_CODES

HALF = ["bfloat16", "float16"]


@pytest.fixture(scope="module", params=HALF)
def half(request, tmp_path_factory, tiny_model_dir):
    """(dtype, folder, loaded): the tiny model saved in a half-precision dtype."""
    from transformers import LlamaForCausalLM

    dtype = request.param
    folder = str(tmp_path_factory.mktemp(dtype))
    LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype)).save_pretrained(folder)
    loaded = load_model(ModelSpec(path=folder, cache_dir=str(tmp_path_factory.mktemp("cache"))))
    assert loaded.checkpoint_dtype == dtype
    return dtype, folder, loaded


@pytest.fixture
def make(half):
    yield from engine_factory_of(half[2])


def test_dtype_auto_is_the_checkpoints_on_cuda_and_float32_on_this_cpu():
    assert resolve_dtype("auto", "bfloat16", "cpu") == "float32"
    assert resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "float16", "cuda:1") == "float16"
    assert resolve_dtype("auto", "float32", "cuda") == "bfloat16"
    assert resolve_dtype("float16", "bfloat16", "cpu") == "float16"
    with pytest.raises(ValueError, match="^dtype must be one of auto, float32, bfloat16, float16, got 'int8'$"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="batch_invariant needs float32"):
        EngineConfig(dtype="bfloat16", batch_invariant=True)


def test_an_engine_in_the_checkpoints_dtype_equals_transformers_in_that_dtype(half, make):
    """Weights, KV and activations in the dtype (the CPU's fp32 kernels set aside), greedy tokens
    equal to transformers' generate in the same dtype, one request at a time as it runs them (in
    half precision a batch's other rows change a matmul's blocking, so its rounding)."""
    dtype, folder, _ = half
    eng = make(dtype=dtype)
    assert eng.cache.kv.dtype == getattr(torch, dtype) and eng.model.layers[0].w_qkv.dtype == getattr(torch, dtype)
    assert eng.model.small_gemm is None and eng.model.attn_kernel is None
    for prompt in random_prompts(4, lo=4, hi=60, seed=2):
        (got,) = eng.generate([prompt], [SamplingParams(max_tokens=16, ignore_eos=True)])
        assert got == hf_greedy(folder, dtype, prompt, 16), prompt
    auto = make()  # on the CPU: float32
    assert auto.cache.kv.dtype == torch.float32 and auto.model.small_gemm is not None


def test_a_handoff_keeps_the_dtype_and_an_engine_of_another_refuses_it_by_name(half, make):
    """The payload carries the dtype in its header and the handle, at its element size; a decode
    engine of the same dtype goes on exactly as one engine would; one of another is refused
    naming handle.dtype, holding nothing."""
    dtype, folder, _ = half
    prefill, decode, fp32 = make(dtype=dtype), make(dtype=dtype), make(dtype="float32")
    prompt = random_prompts(1, lo=30, hi=31, seed=3)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    export, buf = exported(prefill, "h", prompt, params)
    assert export.dtype == dtype and _HEADER.unpack_from(bytes(buf[: _HEADER.size]))[2] == DTYPE_CODES[dtype]
    shape = prefill.model.shape
    assert len(buf) == 64 + shape.num_layers * 2 * len(prompt) * shape.num_kv_heads * shape.head_dim * 2
    with pytest.raises(KVImportError, match=f"^handle.dtype: KV dtype '{dtype}' is not this model's 'float32'$"):
        fp32.import_kv(export, buf)
    assert fp32.cache.pool.num_used == 0 and not fp32.seqs
    decode.import_kv(export, buf)
    got = [export.token_ids[-1]] + drain(decode).tokens["h"]
    assert got == hf_greedy(folder, dtype, prompt, 12)
