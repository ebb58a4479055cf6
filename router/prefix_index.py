"""What each decode worker holds in its prefix cache, as one router has seen it: the full KV
blocks of the prompts (and generated tokens) of the requests this router placed there.

A decode worker files each full block of computed KV under its tokens and the block before it
(engine/kv_cache.py), and a later sequence reuses the blocks of its longest cached prefix. The
router keeps the same chain, as hashes, per worker, so that it can place a request where most
of its prompt is cached already (a shared system prompt, the turns of one chat), and, with
conditional disaggregation, let that worker compute the rest itself instead of a prefill worker
computing the whole prompt and handing over all of its KV.

It is a record, not the cache: the worker evicts on its own (least recently used first, as
here), and a hash may collide. Other routers place there too, and tell this one what they
recorded (prefix_share.py), so the hashes are the same in every process: the chain's root is
a blake2b of the salt, and each link hashes a tuple of ints, which Python hashes alike in every
process of one version (only str and bytes hashes are salted per process). A wrong guess costs time, never
a wrong token: the engine looks the prompt up itself, by its exact tokens. The record is kept
honest where it can be:

- it holds at most as many blocks per worker as the worker's KV cache has, dropping the least
  recently used first;
- a prompt is recorded once its first token has come back (its KV is there, or on its way), and
  the generated tokens when it finishes, so a burst of one new prompt does not all go local
  expecting KV that is still being computed;
- a worker that restarted (new epoch) or left the registry starts empty.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

DEFAULT_BLOCKS = 1 << 16  # per worker, when the worker does not say how much KV it holds


def chain(
    token_ids: list[int], block_size: int, salt: str = "", limit: int | None = None, known: list[int] = ()
) -> list[int]:
    """The hashes of the full blocks of token_ids, each over its tokens and the hash before it
    (the salt roots the chain, as cache_salt roots the engine's), at most `limit` of them.
    `known`: the hashes of its first blocks, already computed (the chain goes on from them)."""
    n = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    out = list(known[:n])
    h = out[-1] if out else root(salt)
    for i in range(len(out), n):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


def root(salt: str) -> int:
    """The hash a salt's chain starts from, the same in every process (a signed 64-bit int, as
    Python's hashes are)."""
    digest = hashlib.blake2b(b"splitserve-prefix\0" + salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[str, OrderedDict[int, None]] = {}  # worker id -> block hashes, least recent first
        self.epochs: dict[str, str] = {}
        self.caps: dict[str, int] = {}

    def workers(self, found: list) -> None:
        """Sync with a registry read (WorkerInfo-like: worker_id, epoch, kv_capacity_tokens): a
        worker gone or restarted starts empty; each keeps at most its KV cache's blocks."""
        ids = set()
        for w in found:
            ids.add(w.worker_id)
            if self.epochs.get(w.worker_id, w.epoch) != w.epoch:
                self.blocks.pop(w.worker_id, None)
            self.epochs[w.worker_id] = w.epoch
            self.caps[w.worker_id] = w.kv_capacity_tokens // self.block_size or DEFAULT_BLOCKS
        for wid in list(self.blocks):
            if wid not in ids:
                self.forget_worker(wid)

    def forget_worker(self, worker_id: str) -> None:
        self.blocks.pop(worker_id, None)
        self.epochs.pop(worker_id, None)
        self.caps.pop(worker_id, None)

    def chain(self, token_ids: list[int], salt: str = "", known: list[int] = ()) -> list[int]:
        """The hashes of token_ids' full blocks (`known`: those of its first blocks)."""
        return chain(token_ids, self.block_size, salt, known=known)

    def prompt_chain(self, token_ids: list[int], salt: str = "") -> list[int]:
        """The block hashes a prompt can find cached: at least its last token is left to compute
        (its logits give the first token), as the engine leaves it."""
        return chain(token_ids, self.block_size, salt, limit=(len(token_ids) - 1) // self.block_size)

    def cached_tokens(self, worker_id: str, hashes: list[int]) -> int:
        """Tokens of a prompt (its prompt_chain) the worker is expected to find cached: its longest
        recorded prefix of whole blocks."""
        held = self.blocks.get(worker_id)
        n = 0
        while held and n < len(hashes) and hashes[n] in held:
            n += 1
        return n * self.block_size

    def record(self, worker_id: str, hashes: list[int]) -> None:
        """The worker has computed the KV of the blocks of this chain: they are cached there now."""
        held = self.blocks.setdefault(worker_id, OrderedDict())
        for h in reversed(hashes):  # the chain's start is the last to go
            held[h] = None
            held.move_to_end(h)
        cap = self.caps.get(worker_id, DEFAULT_BLOCKS)
        while len(held) > cap:
            held.popitem(last=False)
