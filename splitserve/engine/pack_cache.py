"""The small-GEMM kernel's packed weights of a converted GGUF model, kept under
SPLITSERVE_CACHE_DIR, one entry for each EngineConfig.weights: the fp32 tiles (a permuted copy of
the weights, ~540 MB for SmolLM2, about 1 s of CPU at each worker's start) or the GGUF's own blocks
laid out for the kernel (~100 MB). Read back, they are mapped from the file, not copied, so the
workers on a host also share their pages (as layout_cache's weights).

An entry is keyed by the converted folder (itself keyed by the GGUF file's content), PACK_FORMAT,
which changes whenever what SmallGemm.pack makes does, and the weights setting. Tiles and blocks
are used only if their shapes are the weight's; an entry that cannot be read, or does not match,
is ignored (the weights are packed again) and said so in the log."""

from __future__ import annotations

import json
import logging
import os

from splitserve.engine.cache_dir import remove_older_formats, write_tensors

log = logging.getLogger(__name__)

PACK_FORMAT = 3
FILE = "packed.safetensors"


def entry(cache_dir: str, converted_folder: str) -> str:
    """Where a converted model's entries go, less the weights setting (for_weights)."""
    return os.path.join(cache_dir, "packed", os.path.basename(converted_folder))


def for_weights(prefix: str, weights: str) -> str:
    """The entry of one EngineConfig.weights: "<converted>-<weights>-<PACK_FORMAT>"."""
    return f"{prefix}-{weights}-{PACK_FORMAT}"


def _remove_older(dest: str) -> None:
    """remove_older_formats, for dest's own stem and for the entries of the formats before the
    weights setting ("<converted>-<n>": tiles and fitted blocks, 1.1 GB for SmolLM2)."""
    remove_older_formats(dest, PACK_FORMAT)
    stem = os.path.basename(dest).rpartition("-")[0]
    remove_older_formats(os.path.join(os.path.dirname(dest), f"{stem.rpartition('-')[0]}-{PACK_FORMAT}"), PACK_FORMAT)


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
                _key(name): Packed(None, f.get_tensor(f"{name}.blocks"), fmt)
                if fmt
                else Packed(f.get_tensor(f"{name}.tiles"))
                for name, fmt in formats.items()
            }
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        log.warning("packed weights at %s not read (%s): packed again", path, e)
        return None
    _remove_older(dest)
    return known


def write(dest: str, packed: dict) -> None:
    """LoadedModel.packed (native.Packed by key), as an entry read() reads."""
    formats = {_name(k): p.fmt if p.blocks is not None else "" for k, p in packed.items()}
    tensors = {f"{_name(k)}.tiles": p.tiles for k, p in packed.items() if p.blocks is None}
    tensors.update((f"{_name(k)}.blocks", p.blocks) for k, p in packed.items() if p.blocks is not None)
    write_tensors(dest, FILE, PACK_FORMAT, tensors, {"formats": json.dumps(formats)})
    _remove_older(dest)
