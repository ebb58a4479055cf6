"""The paged KV cache: a block pool and the tensor it indexes.

The scheduler owns block allocation (``can_allocate`` / ``allocate`` / ``free``);
running out is a ``False`` from ``can_allocate`` and the scheduler preempts, never
an exception. The model only ever sees slot numbers.
"""

from __future__ import annotations

import torch

from splitserve.engine.model import ModelShape


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "allocate() without can_allocate()"
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()


class PagedKVCache:
    def __init__(self, shape: ModelShape, cache_bytes: int, block_size: int, device: torch.device | None = None,
                 spare_block: bool = False):
        per_block = shape.kv_bytes_per_token * block_size
        num_blocks = max(1, cache_bytes // per_block)
        self.pool = BlockPool(num_blocks, block_size)
        # spare_block: one more block after the pool's, never handed out; padding rows and
        # tokens of captured CUDA graph steps (cuda_graphs.py) write and read only it.
        self.spare_block = num_blocks if spare_block else None
        slots = (num_blocks + spare_block) * block_size
        # kv: [layers, 2 (k, v), slots, Hkv, D] (slot = block * block_size + offset). NOTE: zeroed
        # (pages faulted in) at start-up; faulting them lazily cost 15x on the first KV writes of a busy step.
        self.kv = torch.zeros(
            shape.num_layers, 2, slots, shape.num_kv_heads, shape.head_dim, dtype=torch.float32, device=device,
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
