"""The paged KV pool's storage: one array of fixed-size blocks for every layer, K and V, with O(new tokens) writes.

Which blocks a sequence owns is decided elsewhere (kv_cache_manager.py); this class only holds the numbers.
"""

from __future__ import annotations

import numpy as np


class KVCacheStorage:
    """pool[layer, 0 | 1 (K | V), kv_head, block, offset in block, :] (see builder/network.py: kv_cache_shape)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, tokens_per_block: int, num_blocks: int,
                 dtype: np.dtype = np.float32) -> None:
        self.shape = (num_layers, 2, num_kv_heads, num_blocks, tokens_per_block, head_size)
        self.dtype = np.dtype(dtype)
        # NOTE: np.zeros maps untouched pages lazily, so resident memory follows the blocks actually written.
        self.pool = np.zeros(self.shape, dtype=self.dtype)

    @property
    def num_blocks(self) -> int:
        return self.shape[3]

    @property
    def tokens_per_block(self) -> int:
        return self.shape[4]

    @property
    def bytes_per_token(self) -> int:
        layers, _, heads, _, _, size = self.shape
        return layers * 2 * heads * size * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.tokens_per_block

    def slots(self, block_ids: list[int] | tuple[int, ...], start: int, end: int) -> np.ndarray:
        """Flat slot ids (block * tokens_per_block + offset) of token positions start..end-1 of a sequence."""
        positions = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.tokens_per_block] * self.tokens_per_block + positions % self.tokens_per_block

    def write(self, new_kv: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store a step's new K/V, new_kv [layers, 2, T, kv_heads, head], at their slots: O(T), no pool copy."""
        layers, _, heads, blocks, block_size, size = self.shape
        flat = self.pool.reshape(layers, 2, heads, blocks * block_size, size)  # a view, not a copy
        flat[:, :, :, slot_mapping] = new_kv.transpose(0, 1, 3, 2, 4)
