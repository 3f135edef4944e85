"""The paged KV pool: fixed-size blocks in one array, per-sequence block tables, and O(new tokens) writes."""

from __future__ import annotations

import numpy as np


class PagedKVCache:
    """A pool of `num_blocks` blocks of `tokens_per_block` tokens for every layer, K and V.

    Invariants: a block id is either in the free list or owned by exactly one sequence; a sequence holding n
    tokens owns ceil(n / tokens_per_block) blocks. With `growable`, an empty free list doubles the pool instead
    of failing, so memory follows the tokens actually held (the runtime issue replaces this with a budget).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, tokens_per_block: int, num_blocks: int,
                 dtype: np.dtype = np.float32, growable: bool = True) -> None:
        self.tokens_per_block = tokens_per_block
        self.growable = growable
        self.pool = np.zeros((num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_size), dtype=dtype)
        self.free_blocks: list[int] = list(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.shape[2]

    @property
    def bytes_per_token(self) -> int:
        return self.pool[:, :, 0, 0].nbytes

    def _grow(self) -> None:
        extra = np.zeros_like(self.pool)
        self.free_blocks.extend(range(self.num_blocks, 2 * self.num_blocks))
        self.pool = np.concatenate([self.pool, extra], axis=2)

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give `seq_id` enough blocks to hold `num_tokens` tokens; returns its block table."""
        needed = -(-num_tokens // self.tokens_per_block) - len(self.block_tables.get(seq_id, ()))
        if needed > len(self.free_blocks) and not self.growable:  # fail before taking anything: no partial table
            raise MemoryError(f"KV cache pool is full: sequence {seq_id} needs {needed} more blocks, "
                              f"{len(self.free_blocks)} are free")
        table = self.block_tables.setdefault(seq_id, [])
        for _ in range(max(needed, 0)):
            if not self.free_blocks:
                self._grow()
            table.append(self.free_blocks.pop(0))
        return table

    def free(self, seq_id: int) -> None:
        self.free_blocks.extend(self.block_tables.pop(seq_id, []))

    def slots(self, seq_id: int, start: int, end: int) -> np.ndarray:
        """Flat slot ids (block * tokens_per_block + offset) of token positions start..end-1 of a sequence."""
        positions = np.arange(start, end)
        table = np.asarray(self.block_tables[seq_id], dtype=np.int64)
        return table[positions // self.tokens_per_block] * self.tokens_per_block + positions % self.tokens_per_block

    def write(self, new_kv: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store a step's new K/V, new_kv [layers, 2, T, kv_heads, head], at their slots: O(T), no pool copy."""
        layers, _, blocks, block_size = self.pool.shape[:4]
        flat = self.pool.reshape(layers, 2, blocks * block_size, *self.pool.shape[4:])  # a view, not a copy
        flat[:, :, slot_mapping] = new_kv
