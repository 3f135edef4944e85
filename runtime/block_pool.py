"""KV block bookkeeping: reference counts, a content-hash index of full blocks, and LRU eviction.

Invariants:
- every block is either in use (ref_count > 0) or in the free queue (ref_count == 0), never both;
- a free block may still be cached (it keeps its hash) and can be revived by a prefix hit until it is evicted;
- allocation takes from the front of the free queue (least recently freed first) and evicts its cached hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: equal hashes mean equal tokens in this block and in every block before it."""
    # NOTE: Python's tuple hash of ints is deterministic across runs (no hash randomization for ints).
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the free queue (evicting their cached contents); the caller checked num_free."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by a prefix lookup (reviving free ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop a reference; blocks reaching zero go to the back of the free queue in the order given."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)  # uncached blocks are reused first

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache(self, block: int, block_hash: int) -> None:
        """Register a full block's content hash (first writer wins; duplicates stay uncached)."""
        if self.enable_caching and block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None

    def reset_cache(self) -> None:
        for block in range(self.num_blocks):
            if self.ref_counts[block] == 0:
                self._evict(block)
