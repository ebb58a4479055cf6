"""A GGUF file's config and weights, in the names and values transformers' GGUF loading gives them.

transformers (5.23) took about 22 s of a SmolLM2 conversion's 30 on this machine to make the
model: it parses the whole file twice with gguf-py's reader (every token and merge a numpy view),
and builds gguf-py's tensor-name map once for each of the model's modules. The weights themselves
(de-quantized with gguf-py, as transformers does) are 3 s of that. Here the file is read once with
struct over a memory map and the names are mapped by a table, for the architectures the engine
serves (model_config.SUPPORTED_ARCHITECTURES). The tokenizer is still made by transformers.

The result is what transformers made, tensor for tensor and key for key (test_loader checks it
against transformers on small files of each architecture), so caches converted either way are
the same. Every failure is a ModelLoadError naming the file.
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
from dataclasses import dataclass

import numpy as np

from splitserve.engine.errors import ModelLoadError

log = logging.getLogger(__name__)

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# transformers' GGUF_CONFIG_MAPPING for llama, mistral and qwen2: "{arch}.{key}" -> config field
_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",  # not for qwen2 (below)
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_NOT_IN_MODEL = ("rope_freqs.weight",)  # llama 3's rope factors: the HF model has no parameter for them


# Block formats with fp16 scales at the head of each block: (bytes a block, the scales' offsets)
_SCALES = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q8_0": (34, (0,)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2))}
# The formats the small-GEMM kernel reads as they are (native.BLOCK_FORMATS), by GGUF type name
NATIVE_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "F16": "f16", "BF16": "bf16"}


@dataclass(frozen=True)
class Tensor:
    ggml_type: int
    shape: tuple[int, ...]  # numpy's order: GGUF's dims reversed
    offset: int  # in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata (fields by key) and its tensors (by GGUF name), read once."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, KeyError, IndexError, OverflowError, RecursionError) as e:
            raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None

    def _parse(self) -> None:
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        self._pos = 24
        self.fields: dict = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._u32()}Q", buf, self._pos)
            self._pos += 8 * len(dims)
            ggml_type, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, dims, ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0:
            raise ValueError(f"general.alignment is {align}")
        start = -(-self._pos // align) * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: dict[str, Tensor] = {}
        for name, dims, ggml_type, offset in infos:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            elements = int(np.prod(dims, dtype=np.int64))
            if dims[0] % block:
                raise ValueError(f"tensor {name}'s rows of {dims[0]} are not whole blocks of {block}")
            nbytes = elements // block * size
            if start + offset + nbytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            self.tensors[name] = Tensor(ggml_type, tuple(reversed(dims)), start + offset, nbytes)

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._pos)
        self._pos += 4
        return v

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
        s = self._buf[self._pos + 8 : self._pos + 8 + n]
        if len(s) != n:
            raise ValueError("a string runs past the end of the file")
        self._pos += 8 + n
        return s.decode("utf-8")

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item = self._u32()
            (n,) = struct.unpack_from("<Q", self._buf, self._pos)
            self._pos += 8
            if item == _STRING:
                return [self._string() for _ in range(n)]
            if item == _ARRAY:
                return [self._value(self._u32()) for _ in range(n)]
            arr = np.frombuffer(self._buf, np.dtype(_SCALAR[item]), n, self._pos)
            self._pos += arr.nbytes
            return arr.tolist()
        (v,) = struct.unpack_from(_SCALAR[kind], self._buf, self._pos)
        self._pos += struct.calcsize(_SCALAR[kind])
        return v

    @property
    def architecture(self) -> str:
        arch = self.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"corrupt GGUF file {self.path}: no general.architecture")
        return arch

    def array(self, name: str) -> np.ndarray:
        """The tensor as float32, de-quantized by gguf-py (as transformers does): an array of its own,
        not of the file's map."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        kind = GGMLQuantizationType(t.ggml_type)
        raw = self.raw(name)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return (
                raw.view(np.float32 if kind == GGMLQuantizationType.F32 else np.float16)
                .reshape(t.shape)
                .astype(np.float32)
            )
        try:
            return dequantize(raw.reshape(*t.shape[:-1], -1), kind).reshape(t.shape)
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"GGUF file {self.path}: tensor {name} ({kind.name}) cannot be de-quantized: {e}"
            ) from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as the file keeps them, [rows, bytes a row] (a view of the file's map),
        its blocks' scales checked (check_scales)."""
        t = self.tensors[name]
        raw = np.frombuffer(self._buf, np.uint8, t.nbytes, t.offset).reshape(int(np.prod(t.shape[:-1])), -1)
        self.check_scales(name, raw)
        return raw

    def check_scales(self, name: str, raw: np.ndarray) -> None:
        """A ModelLoadError naming the tensor and its first bad block when a block's fp16 scale
        (d, and m for Q4_1) is not a finite number: a damaged file, whose weights would be NaN or inf."""
        from gguf import GGMLQuantizationType

        kind = GGMLQuantizationType(self.tensors[name].ggml_type)
        heads = _SCALES.get(kind.name)
        if heads is None:
            return
        size, offsets = heads
        blocks = raw.reshape(-1, size)
        for off in offsets:
            scale = blocks[:, off : off + 2].copy().view(np.float16).ravel()
            bad = np.flatnonzero(~np.isfinite(scale))
            if bad.size:
                raise ModelLoadError(
                    f"corrupt GGUF file {self.path}: tensor {name} ({kind.name}) block {int(bad[0])} of "
                    f"{blocks.shape[0]} has a scale of {scale[bad[0]]} ({bad.size} such blocks)"
                )

    def close(self) -> None:
        try:
            self._buf.close()
        except BufferError:  # an array of it still held (by an error's traceback): the map goes with it
            pass


def config_fields(gguf: GGUFFile) -> dict:
    """The keyword arguments transformers makes the model's config from."""
    arch, fields = gguf.architecture, gguf.fields
    out: dict = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for key, field in _CONFIG.items():
        if field == "head_dim" and arch == "qwen2":
            continue
        if f"{arch}.{key}" in fields:
            out[field] = fields[f"{arch}.{key}"]
    for key, field in _TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in fields:
            out[field] = fields[f"tokenizer.ggml.{key}"]
    if "general.name" in fields:
        out["_model_name_or_path"] = fields["general.name"]
    if "vocab_size" not in out and "tokenizer.ggml.tokens" in fields:
        out["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    return out


def hf_name(name: str) -> str | None:
    """The HF Llama/Qwen2 parameter a GGUF tensor is, or None for one the model has no place for."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q and k (its converter interleaves each head's rotary halves)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def state_dict(gguf: GGUFFile, config) -> dict:
    """The weights as float32 torch tensors by HF name (lm_head left out when tied)."""
    import torch

    permute = gguf.architecture == "llama"  # transformers' LlamaTensorProcessor, by the file's architecture
    out = {}
    for name in gguf.tensors:
        target = hf_name(name)
        if target is None:  # left out, as transformers leaves it
            if name not in _NOT_IN_MODEL:
                log.warning(
                    "GGUF file %s: tensor %s has no place in a %s model, left out", gguf.path, name, config.model_type
                )
            continue
        w = gguf.array(name)
        if permute and ".attn_q." in name:
            w = _reverse_permute(w, config.num_attention_heads)
        elif permute and ".attn_k." in name:
            w = _reverse_permute(w, config.num_key_value_heads)
        out[target] = torch.from_numpy(np.ascontiguousarray(w))  # (already a copy: array()'s, or the permute's)
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    missing = sorted(set(_expected(config)) - set(out))
    if missing:
        raise ModelLoadError(
            f"GGUF file {gguf.path} lacks {len(missing)} weights the model needs, "
            f"{', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}"
        )
    return out


def native_blocks(gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> dict:
    """The model's matrices the file keeps in a format the small-GEMM kernel reads as it is, by HF
    name: (format, [rows, bytes a row] uint8, a row of blocks for each output feature), q's and k's
    rows in the order state_dict gives them. Other tensors (F32 norms, other formats) are left out:
    their weights stay the de-quantized fp32 ones."""
    from gguf import GGMLQuantizationType

    permute = gguf.architecture == "llama"
    out = {}
    for name, t in gguf.tensors.items():
        fmt = NATIVE_FORMATS.get(GGMLQuantizationType(t.ggml_type).name)
        target = hf_name(name)
        if fmt is None or target is None or len(t.shape) != 2:
            continue
        rows = gguf.raw(name)
        if permute and ".attn_q." in name:
            rows = _reverse_permute(rows, num_heads)
        elif permute and ".attn_k." in name:
            rows = _reverse_permute(rows, num_kv_heads)
        out[target] = (fmt, np.array(rows))  # (a copy: a view of the map is read-only, which torch warns of)
    return out


def _expected(config) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{part}.weight" for part in _LAYER_NAMES.values()]
    return names
