"""Entries of SPLITSERVE_CACHE_DIR (converted models, resolved configs), each written whole."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def turn(folder: str, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock of one kind of entry (``folder``: ``packed``, ``layout``, ``kernels``), so that
    processes about to make the same entry at once (a stack's workers at their first start) take
    turns: each looks again, once it holds the lock, whether the entry is there, and the one that
    made it first is mapped by the others instead of made again. ``waiting`` is called before
    blocking (an engine then leaves its cores to the one making the entry). The lock is an empty
    file, ``.locks/<kind>`` beside the kind's folder, locked with ``flock`` (which the kernel
    releases when its process dies); it is taken only where it can be: a read-only cache takes no
    turns."""
    fd = None
    try:
        locks = os.path.join(os.path.dirname(folder), ".locks")
        os.makedirs(locks, exist_ok=True)
        fd = os.open(os.path.join(locks, os.path.basename(folder)), os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        if fd is not None:
            os.close(fd)
            fd = None
        log.info("%s: no lock (%s); processes starting together may each make its entries", folder, e)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def making(entry: str, waiting: Callable[[], None] | None = None):
    """`turn` for entry's kind while the entry is not there (the body then reads it again, and makes and
    writes it if it is still missing); nothing to wait for once it is."""
    return contextlib.nullcontext() if os.path.exists(entry) else turn(os.path.dirname(entry), waiting)


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
        write_entry(
            dest,
            f".{os.path.basename(os.path.dirname(dest))}-",
            lambda tmp: save_file(tensors, os.path.join(tmp, file), metadata=metadata),
        )
    except OSError as e:  # a read-only cache
        log.warning("%s not cached (%s): made again at each start", dest, e)
        return
    remove_older_formats(dest, fmt)
