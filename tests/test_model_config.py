"""A model's config read without transformers: what transformers resolves once, from the cache after.

Each config is checked against transformers' own reading of it: every number the engine uses,
and the rotary tables bit for bit (default, scaled and sliding-window configs, and files that
leave keys to the defaults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from splitserve.engine.model_config import ROPE_FILE, read_config, resolve


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    small = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    return {
        "llama-defaults": LlamaConfig(**small),  # no KV heads, head_dim or eps in the file: the defaults
        "llama-gqa": LlamaConfig(**small, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, eos_token_id=[2, 7]),
        "llama3-rope": LlamaConfig(
            **small,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        "linear-rope": LlamaConfig(
            **small, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        ),
        "mistral-window": MistralConfig(**small, num_key_value_heads=2, sliding_window=256),
        "qwen2": Qwen2Config(**small, num_key_value_heads=2, use_sliding_window=False, sliding_window=128),
    }


@pytest.mark.parametrize("name", list(_configs()))
def test_the_cached_config_is_what_transformers_reads(name, tmp_path):
    from transformers import AutoConfig

    from splitserve.engine.model_config import _rope_tables

    folder = tmp_path / name
    _configs()[name].save_pretrained(folder)
    hf = AutoConfig.from_pretrained(folder)
    first = read_config(str(folder), str(tmp_path / "cache"))
    assert first.folder and os.path.isfile(os.path.join(first.folder, ROPE_FILE))
    again = read_config(str(folder), str(tmp_path / "cache"))  # from the cache
    want = resolve(hf)
    for cfg in (first, again):
        assert {k: getattr(cfg, k) for k in want} == want
        cos, sin = cfg.rope_tables()
        ref_cos, ref_sin = _rope_tables(hf, want["context_length"])
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    if name == "mistral-window":
        assert first.context_length == 256
    if name == "llama-defaults":
        assert (first.num_key_value_heads, first.head_dim, first.rms_norm_eps) == (4, 16, 1e-6)


def test_a_changed_config_is_read_again_and_an_unwritable_cache_costs_only_time(tmp_path, tiny_model_dir):
    folder = tmp_path / "m"
    folder.mkdir()
    cfg = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())
    (folder / "config.json").write_text(json.dumps(cfg))
    assert read_config(str(folder), str(tmp_path / "cache")).rms_norm_eps == cfg.get("rms_norm_eps", 1e-6)
    (folder / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.125}))
    assert read_config(str(folder), str(tmp_path / "cache")).rms_norm_eps == 0.125
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    cfg = read_config(str(folder), str(blocked))
    assert cfg.folder == "" and cfg.rms_norm_eps == 0.125
    cos, _ = cfg.rope_tables()  # worked out from the folder
    assert cos.shape == (cfg.context_length, cfg.head_dim)


def test_a_start_from_the_cache_imports_no_transformers_config_and_the_router_no_torch(smol_loaded):
    """After a first start has cached them: the router's frontend imports neither torch nor any
    transformers model or config module, and an engine imports no transformers config either."""
    code = textwrap.dedent("""
        import sys
        from splitserve.engine.config import EngineConfig, ModelSpec
        from splitserve.engine.loader import load_frontend
        tok, cfg, name = load_frontend(ModelSpec())
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        heavy = [m for m in sys.modules
                 if m == "torch" or m.startswith(("transformers.models", "transformers.configuration_utils"))]
        print("router", cfg.context_length, heavy)
        from splitserve.engine.engine import LLMEngine
        eng = LLMEngine(EngineConfig(kv_cache_bytes=16 << 20))
        print("engine", eng.max_model_len,
              [m for m in sys.modules if m.startswith(("transformers.models", "transformers.configuration_utils"))])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["router 8192 []", "engine 8192 []"], out.stdout
