"""Per-request block tables over a BlockPool, with prefix reuse of full blocks identified by chained hashes."""

from __future__ import annotations

from trtbuild.runtime.block_pool import BlockPool, hash_block
from trtbuild.runtime.request import Request


class KVCacheManager:
    """Owns which blocks each request holds. A request holding n computed tokens owns >= ceil(n / block_size)
    blocks; its first `num_cached[request]` full blocks are registered in the pool's content index."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_size = block_size
        self.blocks: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def _extend_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first num_tokens tokens (computed once, then reused)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids[i * bs : (i + 1) * bs]))
        return hashes[: num_tokens // bs]

    def computed_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks. The last known token is never taken from the
        cache: it must be computed to produce the next token's logits."""
        if not self.pool.enable_caching:
            return []
        found = []
        for h in self._extend_hashes(request, len(request.token_ids) - 1):
            block = self.pool.lookup(h)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_needed(self, request: Request, num_tokens: int, prefix: list[int] = ()) -> int:
        """Free blocks that allocate(request, num_tokens, prefix) would consume."""
        have = len(self.blocks.get(request.request_id, ())) + len(prefix)
        revived = sum(1 for b in prefix if self.pool.ref_counts[b] == 0)
        return max(-(-num_tokens // self.block_size) - have, 0) + revived

    def allocate(self, request: Request, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Make the request hold blocks for its first num_tokens tokens (taking `prefix` blocks first).
        Returns False, changing nothing, when the pool lacks free blocks."""
        if self.blocks_needed(request, num_tokens, prefix) > self.pool.num_free:
            return False
        table = self.blocks.setdefault(request.request_id, [])
        if prefix:
            self.pool.touch(prefix)
            table.extend(prefix)
            self.num_cached[request.request_id] = len(prefix)
        table.extend(self.pool.allocate(max(-(-num_tokens // self.block_size) - len(table), 0)))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (all tokens computed) for reuse by later requests."""
        if not self.pool.enable_caching:
            return
        hashes = self._extend_hashes(request, request.num_computed_tokens)
        table, start = self.blocks[request.request_id], self.num_cached.get(request.request_id, 0)
        for i in range(start, len(hashes)):
            self.pool.cache(table[i], hashes[i])
        self.num_cached[request.request_id] = len(hashes)

    def free(self, request: Request) -> None:
        """Return the request's blocks; tail blocks go first in the free queue so shared prefixes live longest."""
        table = self.blocks.pop(request.request_id, [])
        self.num_cached.pop(request.request_id, None)
        self.pool.free(list(reversed(table)))

    def block_table(self, request: Request) -> list[int]:
        return self.blocks.get(request.request_id, [])
