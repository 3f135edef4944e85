"""Shared by the KV cache tests: a small pool's dimensions, requests, block counts, and the pool layout's slots."""

from __future__ import annotations

import numpy as np

from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams

LAYERS, KV_HEADS, HEAD, BLOCK = 2, 2, 4, 4


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), SamplingParams())


def ceil_blocks(tokens: int, block: int = BLOCK) -> int:
    return -(-tokens // block)


# The pool layout, [blocks, layers, K|V, kv_heads, tokens_per_block, head_size] (builder/network.kv_cache_shape),
# is known only to these two helpers.
def slot_kv(pool: np.ndarray, block: int, offset: int) -> np.ndarray:
    """A view of one token slot's K and V in every layer: [layers, 2, kv_heads, head_size], as new_kv[:, :, t]."""
    return pool[block, :, :, :, offset]


def changed_slots(pool: np.ndarray, before: np.ndarray) -> list[int]:
    """Flat slot ids (block * tokens_per_block + offset) whose K or V differ, in any layer or head."""
    return np.flatnonzero((pool != before).any(axis=(1, 2, 3, 5)).reshape(-1)).tolist()
