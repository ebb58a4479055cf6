"""The small-GEMM kernel's packed weights of a converted GGUF model, kept under
SPLITSERVE_CACHE_DIR: fitting their integer blocks (SmallGemm.pack_blocks) took ~10-20 s in every
process that built an engine on SmolLM2, and making the fp32 tiles (a permuted copy of the
weights, ~540 MB) about 1 s of CPU at each worker's start. Read back, both are mapped from the
file, not copied, so the workers on a host also share their pages (as layout_cache's weights).

An entry is keyed by the converted folder (itself keyed by the GGUF file's content) and
PACK_FORMAT, which changes whenever what SmallGemm.pack makes does. Tiles and blocks are used only
if their shapes are the weight's; an entry that cannot be read, or does not match, is ignored
(the weights are packed again) and said so in the log."""

from __future__ import annotations

import json
import logging
import os

from splitserve.engine.cache_dir import remove_older_formats, write_tensors

log = logging.getLogger(__name__)

PACK_FORMAT = 2  # 1 kept the blocks only
FILE = "packed.safetensors"


def entry(cache_dir: str, converted_folder: str) -> str:
    return os.path.join(cache_dir, "packed", f"{os.path.basename(converted_folder)}-{PACK_FORMAT}")


def _name(key) -> str:
    return key if isinstance(key, str) else f"{key[0]}.{key[1]}"


def _key(name: str):
    layer, _, weight = name.partition(".")
    return (int(layer), weight) if weight else name


def read(dest: str) -> dict | None:
    """Packed(tiles, blocks or None, format) by the keys of LoadedModel.packed ((layer, name),
    "lm_head"), mapped from the entry's file; None when there is no entry (or it cannot be read)."""
    path = os.path.join(dest, FILE)
    if not os.path.isfile(path):
        return None
    from safetensors import SafetensorError, safe_open

    from splitserve.engine.native import Packed

    try:
        with safe_open(path, "pt") as f:
            formats = json.loads(f.metadata()["formats"])
            known = {
                _key(name): Packed(f.get_tensor(f"{name}.tiles"), f.get_tensor(f"{name}.blocks") if fmt else None, fmt)
                for name, fmt in formats.items()
            }
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        log.warning("packed weights at %s not read (%s): packed again", path, e)
        return None
    remove_older_formats(dest, PACK_FORMAT)
    return known


def write(dest: str, packed: dict) -> None:
    """LoadedModel.packed (native.Packed by key), as an entry read() reads."""
    formats = {_name(k): p.fmt if p.blocks is not None else "" for k, p in packed.items()}
    tensors = {f"{_name(k)}.tiles": p.tiles for k, p in packed.items()}
    tensors.update((f"{_name(k)}.blocks", p.blocks) for k, p in packed.items() if p.blocks is not None)
    write_tensors(dest, FILE, PACK_FORMAT, tensors, {"formats": json.dumps(formats)})
