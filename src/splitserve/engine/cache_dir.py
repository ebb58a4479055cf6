"""Entries of SPLITSERVE_CACHE_DIR (converted models, resolved configs), each written whole."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Callable

log = logging.getLogger(__name__)


def write_entry(dest: str, prefix: str, fill: Callable[[str], None]) -> None:
    """fill(folder) writes the entry's files into a fresh folder beside dest, which is then made
    readable by all and renamed to dest. Processes that start together race to write the same
    entry: the first rename wins and the others' folders are dropped. OSError when the cache
    cannot be written."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(dest))
    try:
        fill(tmp)
        # mkdtemp and save_file made it 0700 and 0600: a cache baked into an image by root must
        # serve the image's user.
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process wrote it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_older_formats(dest: str, fmt: int) -> None:
    """Remove the entries an earlier format of dest's kind left beside it ("{stem}-{n}", n < fmt),
    once dest is read or written: a release that changes a format would otherwise leave its
    predecessor's entry (SmolLM2's packed weights at format 1: 107 MB) on disk for good. A process
    still reading a removed entry keeps its mapping; an older release sharing the cache writes its
    entry again (and packs or lays out once more at its starts while the newer one removes it)."""
    parent, name = os.path.split(dest)
    stem, _, n = name.rpartition("-")
    if n != str(fmt):
        return
    try:
        siblings = os.listdir(parent)
    except OSError:
        return
    for other in siblings:
        s, _, k = other.rpartition("-")
        if s == stem and k.isdigit() and int(k) < fmt:
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)


def write_tensors(dest: str, file: str, fmt: int, tensors: dict, metadata: dict | None = None) -> None:
    """An entry of one safetensors file (layout_cache's, pack_cache's), unless another process wrote
    dest meanwhile; then the entries earlier formats left beside it are removed. A cache that
    cannot be written is said so in the log (every start makes the tensors again)."""
    from safetensors.torch import save_file

    if os.path.isdir(dest):
        return
    try:
        write_entry(dest, f".{os.path.basename(os.path.dirname(dest))}-",
                    lambda tmp: save_file(tensors, os.path.join(tmp, file), metadata=metadata))
    except OSError as e:  # a read-only cache
        log.warning("%s not cached (%s): made again at each start", dest, e)
        return
    remove_older_formats(dest, fmt)
