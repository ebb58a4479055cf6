"""The small-GEMM kernel's integer blocks of a converted GGUF model, kept under
SPLITSERVE_CACHE_DIR: fitting them (SmallGemm.pack_blocks) took ~10-20 s in every process that
built an engine on SmolLM2, reading them back takes a fraction of a second. Only the blocks are
kept (about 6 bits a weight for q4_1); the fp32 tiles are a permute of the weights, made again.

An entry is keyed by the converted folder (itself keyed by the GGUF file's content) and
PACK_FORMAT, which changes whenever what pack_blocks makes does. A block is used only if its
shape is the weight's; an entry that cannot be read, or does not match, is ignored (the blocks
are fitted again) and said so in the log."""

from __future__ import annotations

import json
import logging
import os

from splitserve.engine.cache_dir import write_entry

log = logging.getLogger(__name__)

PACK_FORMAT = 1
FILE = "blocks.safetensors"


def entry(cache_dir: str, converted_folder: str) -> str:
    return os.path.join(cache_dir, "packed", f"{os.path.basename(converted_folder)}-{PACK_FORMAT}")


def _name(key) -> str:
    return key if isinstance(key, str) else f"{key[0]}.{key[1]}"


def _key(name: str):
    layer, _, weight = name.partition(".")
    return (int(layer), weight) if weight else name


def read(dest: str) -> dict | None:
    """(blocks or None, format) by the keys of LoadedModel.packed ((layer, name), "lm_head"), or
    None when there is no entry (or it cannot be read)."""
    path = os.path.join(dest, FILE)
    if not os.path.isfile(path):
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            formats = json.loads(f.metadata()["formats"])
            return {_key(name): (f.get_tensor(name) if fmt else None, fmt) for name, fmt in formats.items()}
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        log.warning("packed weights at %s not read (%s): fitted again", path, e)
        return None


def write(dest: str, packed: dict) -> None:
    """LoadedModel.packed's blocks (native.Packed by key), as an entry read() reads."""
    from safetensors.torch import save_file

    if os.path.isdir(dest):  # another process's, written meanwhile
        return
    formats = {_name(k): p.fmt if p.blocks is not None else "" for k, p in packed.items()}
    tensors = {_name(k): p.blocks for k, p in packed.items() if p.blocks is not None}
    try:
        write_entry(dest, ".packed-", lambda tmp: save_file(tensors, os.path.join(tmp, FILE),
                                                            metadata={"formats": json.dumps(formats)}))
    except OSError as e:  # a read-only cache: every start fits them again
        log.warning("packed weights not cached at %s (%s)", dest, e)
