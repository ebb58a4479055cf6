"""A converted GGUF model's weights in the engine's layout (LlamaModel: q, k and v fused, gate and
up fused, each weight [in, out]), kept under SPLITSERVE_CACHE_DIR. Making them from the converted
folder's [out, in] tensors cost every worker about 1 s of CPU at each start (copies that
transpose ~540 MB for SmolLM2); read back, they are mapped from the file, not copied, so the
workers on a host also share their pages instead of holding a copy each.

An entry is keyed by the converted folder (itself keyed by the GGUF file's content) and
LAYOUT_FORMAT, which changes whenever LlamaModel's layout does. A tensor is used only if its
shape is the one the model would make (LlamaModel); an entry that cannot be read is ignored
(the weights are made again) and said so in the log."""

from __future__ import annotations

import logging
import os

from splitserve.engine.cache_dir import remove_older_formats, write_tensors

log = logging.getLogger(__name__)

LAYOUT_FORMAT = 1
FILE = "weights.safetensors"


def entry(cache_dir: str, converted_folder: str) -> str:
    return os.path.join(cache_dir, "layout", f"{os.path.basename(converted_folder)}-{LAYOUT_FORMAT}")


def read(dest: str) -> dict | None:
    """The weights by LlamaModel.laid_out's names, mapped from the entry's file; None when there is
    no entry (or it cannot be read)."""
    path = os.path.join(dest, FILE)
    if not os.path.isfile(path):
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        log.warning("the weights laid out at %s were not read (%s): made again", path, e)
        return None
    remove_older_formats(dest, LAYOUT_FORMAT)
    return tensors


def write(dest: str, tensors: dict) -> None:
    """LlamaModel.laid_out's weights, as an entry read() reads."""
    write_tensors(dest, FILE, LAYOUT_FORMAT, tensors)
