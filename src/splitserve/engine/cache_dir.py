"""Entries of SPLITSERVE_CACHE_DIR (converted models, resolved configs), each written whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


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
