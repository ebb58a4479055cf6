"""The paged KV cache: a block pool and the tensor it indexes.

The scheduler owns block allocation (``can_allocate`` / ``allocate`` / ``free``);
running out is a ``False`` from ``can_allocate`` and the scheduler preempts, never
an exception. The model only ever sees slot numbers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from splitserve.engine.model import ModelShape


class BlockPool:
    """Fixed-size KV blocks, handed out and taken back, with an optional prefix cache.

    Prefix cache (``prefix_caching``): once a block is full of computed KV, ``register``
    files it under its tokens and the entry of the block before it, so an entry stands for
    the whole prefix up to its end. A later sequence whose prompt starts with that prefix
    takes the same blocks (``lookup`` then ``take``) and computes only the rest. Blocks are
    counted: a shared block goes back to the pool when its last holder lets it go, and it
    keeps its entry there. Blocks that hold no entry are handed out first (the most
    recently freed first, as without the cache); cached ones only when none is left, the
    least recently freed first and the end of a prefix before its start. So a cached
    block costs nothing that a free one would not: it counts as free. A shared block is
    never written: it is full, and a sequence writes only past the KV it has.

    Entries are keyed by the tokens themselves, not a hash of them: two prefixes can
    never be taken for one another. Entry ids are never reused, so the entries after an
    evicted one can no longer be reached and go when their blocks are handed out.

    A prefix starts from a root: 0, or a sequence's cache salt (a string, never equal to an
    entry id). Prefixes under different roots are never shared, so requests salted apart
    cannot find, or time, one another's prompts.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by none: oldest first
        self._refs = [0] * num_blocks
        # (prev entry, or the root for a first block; tokens) -> (entry, block)
        self._entries: dict[tuple[int | str, tuple[int, ...]], tuple[int, int]] = {}
        self._entry_of: dict[int, tuple[tuple[int | str, tuple[int, ...]], int]] = {}  # block -> (its key, its entry)
        self._entry_ids = itertools.count(1)  # 0: the empty prefix

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a cached prefix's KV (held by a sequence or not)."""
        return len(self._entry_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def freed_by(self, tables: list[list[int]]) -> int:
        """How many blocks would come back if these block tables were let go (a block shared
        with a table not among them stays held)."""
        held: dict[int, int] = {}
        for table in tables:
            for b in table:
                held[b] = held.get(b, 0) + 1
        return sum(self._refs[b] == n for b, n in held.items())

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free, "allocate() without can_allocate()"
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently freed cached block: its entry goes
                b, _ = self._evictable.popitem(last=False)
                key, _ = self._entry_of.pop(b)
                del self._entries[key]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Let go of blocks (a block table, emptied); each returns when no one holds it."""
        for b in reversed(blocks):
            assert self._refs[b] > 0, f"block {b} freed twice"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._entry_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
        blocks.clear()

    def lookup(self, token_ids: list[int], max_tokens: int, root: int | str = 0) -> tuple[list[int], int | str]:
        """The cached blocks holding the longest prefix of token_ids under root (0, or a cache
        salt), whole blocks and at most max_tokens tokens, and the entry of the last one (root:
        none). Takes nothing."""
        blocks: list[int] = []
        entry = root
        if not self.prefix_caching:
            return blocks, entry
        bs = self.block_size
        for i in range(max_tokens // bs):
            hit = self._entries.get((entry, tuple(token_ids[i * bs : (i + 1) * bs])))
            if hit is None:
                break
            entry, b = hit
            blocks.append(b)
        return blocks, entry

    def take(self, blocks: list[int]) -> None:
        """Hold blocks found by lookup (one more holder each)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def register(
        self, token_ids: list[int], block_table: list[int], first: int, end: int, entry: int | str
    ) -> int | str:
        """File blocks [first, end) of a sequence, full of computed KV, in the prefix cache.
        entry: that of block first - 1 (the root for none). Returns the entry of block end - 1.

        A block whose prefix another block already holds stays out of the cache (the other
        one is found), but the blocks after it are filed under that prefix."""
        if not self.prefix_caching:
            return entry
        bs = self.block_size
        for i in range(first, end):
            b = block_table[i]
            own = self._entry_of.get(b)
            if own is not None:  # taken from the cache
                entry = own[1]
                continue
            key = (entry, tuple(token_ids[i * bs : (i + 1) * bs]))
            hit = self._entries.get(key)
            if hit is not None:
                entry = hit[0]
                continue
            entry = next(self._entry_ids)
            self._entries[key] = (entry, b)
            self._entry_of[b] = (key, entry)
        return entry

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks held stay held; free cached ones become plain free)."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._entries.clear()
        self._entry_of.clear()


class PagedKVCache:
    def __init__(
        self,
        shape: ModelShape,
        cache_bytes: int,
        block_size: int,
        device: torch.device | None = None,
        spare_block: bool = False,
        prefix_caching: bool = False,
    ):
        per_block = shape.kv_bytes_per_token * block_size
        num_blocks = max(1, cache_bytes // per_block)
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
        # spare_block: one more block after the pool's, never handed out; padding rows and
        # tokens of captured CUDA graph steps (cuda_graphs.py) write and read only it.
        self.spare_block = num_blocks if spare_block else None
        slots = (num_blocks + spare_block) * block_size
        # kv: [layers, 2 (k, v), slots, Hkv, D] (slot = block * block_size + offset). NOTE: zeroed
        # (pages faulted in) at start-up; faulting them lazily cost 15x on the first KV writes of a busy step.
        self.kv = torch.zeros(
            shape.num_layers,
            2,
            slots,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=getattr(torch, shape.kv_dtype),
            device=device,
        )

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot numbers [end - start] int64 of token positions [start, end) of a sequence."""
        bs = self.pool.block_size
        first, last = start // bs, -(-end // bs)
        blocks = torch.tensor(block_table[first:last], dtype=torch.int64)
        flat = (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()  # [blocks * bs]
        off = first * bs
        return flat[start - off : end - off]
