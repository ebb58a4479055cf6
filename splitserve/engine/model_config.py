"""What a model's config.json means, worked out by ``transformers`` once and cached.

Importing ``transformers``' configuration classes takes ~2.7 s of CPU (they pull in much of
``torch.distributed``), in every process that starts: the router, each prefill and decode
worker. So the first process to read a config.json resolves it with ``AutoConfig`` (its
defaults for the keys the file leaves out, every rope type) and writes what the engine needs:
the numbers below as JSON, and the rotary cos/sin tables as safetensors; and whether the
tokenizer read from its files alone (tokenizer.load_tokenizer) agrees with transformers'. Later
starts read those, keyed by these files' bytes and the ``transformers`` version, and import neither
``transformers`` nor (the router) ``torch``. A cache that cannot be written is worked out
again in memory at each start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass

from splitserve.engine.cache_dir import write_entry
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.tokenizer import differs_from_transformers

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_FORMAT = 2
ROPE_FILE = "rope.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class ModelConfig:
    """The numbers that shape a model's forward and its KV cache, with ``transformers``' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    context_length: int  # positions served: max_position_embeddings, capped at a sliding window
    eos_token_ids: tuple[int, ...]
    rope: str  # the rope settings as transformers gives them (part of the KV fingerprint)
    tokenizer_from_files: bool = True  # False: the files alone tokenize otherwise than transformers
    folder: str = ""  # the cache entry holding the rope tables ("" when it could not be written)
    source: str = dataclasses.field(default="", compare=False)  # the model folder, to work them out again

    def rope_tables(self):
        """cos and sin, [context_length, head_dim] float32, as transformers' rotary module gives them."""
        if self.folder and os.path.isfile(os.path.join(self.folder, ROPE_FILE)):
            from safetensors.torch import load_file

            t = load_file(os.path.join(self.folder, ROPE_FILE))
            return t["cos"], t["sin"]
        return _rope_tables(_hf_config(self.source), self.context_length)

    def eos_with(self, tokenizer) -> frozenset[int]:
        """The tokens that end a sequence: the config's, and the tokenizer's (None: no tokenizer)."""
        return frozenset(self.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer is not None else frozenset())


def read_config(folder: str, cache_dir: str) -> ModelConfig:
    """The model's config, from the cache when it holds this config.json, else resolved (and cached)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        model_type = json.loads(raw).get("model_type", "<missing>")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"corrupt config.json in {folder}: {e}") from None
    check_architecture(model_type, path)
    key = _key(folder, raw)
    entry = os.path.join(cache_dir, "configs", key)
    cfg = _read_entry(entry, folder)
    if cfg is not None:
        return cfg
    hf = _hf_config(folder)
    fields = resolve(hf)
    differs = differs_from_transformers(folder)
    if differs is not None:
        log.warning(
            "the tokenizer files of %s alone differ from transformers' reading of them (%s): "
            "it is loaded through transformers",
            folder,
            differs,
        )
    fields["tokenizer_from_files"] = differs is None
    try:
        _write_entry(entry, fields, hf)
    except OSError as e:  # a read-only cache: worked out again at each start
        log.warning("cannot cache the resolved config of %s in %s: %s", folder, entry, e)
        return ModelConfig(**fields, source=folder)
    return ModelConfig(**fields, folder=entry, source=folder)


def _key(folder: str, config: bytes) -> str:
    """The cache key: config.json's bytes and the tokenizer files' (the entry holds a verdict on
    those), this format and the transformers version."""
    h = hashlib.sha256(config + f"\0{_FORMAT}\0{_transformers_version()}".encode())
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                h.update(f"\0{name}\0".encode() + f.read())
    return h.hexdigest()[:20]


def check_architecture(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {where} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def resolve(hf) -> dict:
    """ModelConfig's fields from a transformers config."""
    heads = hf.num_attention_heads
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    return {
        "model_type": hf.model_type,
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "context_length": _context_length(hf),
        "eos_token_ids": eos_ids,
        "rope": str(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)),
    }


def _context_length(hf) -> int:
    """Positions the model supports (capped at a sliding window: we never need one below it)."""
    max_pos = hf.max_position_embeddings
    sliding = getattr(hf, "sliding_window", None)
    if sliding and getattr(hf, "use_sliding_window", True):
        max_pos = min(max_pos, sliding)
    return max_pos


def _hf_config(folder: str):
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"cannot read model config in {folder}: {e}") from None


def _rope_tables(hf, max_pos: int):
    """cos/sin [max_pos, D] computed by transformers' own rotary module (all rope types)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(hf)
    pos = torch.arange(max_pos).unsqueeze(0)
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _read_entry(entry: str, folder: str) -> ModelConfig | None:
    try:
        with open(os.path.join(entry, "config.json")) as f:
            fields = json.load(f)
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        return ModelConfig(**fields, folder=entry, source=folder)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write_entry(entry: str, fields: dict, hf) -> None:
    """config.json and the rope tables, renamed into place whole (processes starting together race)."""
    from safetensors.torch import save_file

    cos, sin = _rope_tables(hf, fields["context_length"])

    def fill(folder: str) -> None:
        save_file({"cos": cos, "sin": sin}, os.path.join(folder, ROPE_FILE))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(fields, f, indent=2)

    write_entry(entry, ".resolve-", fill)
