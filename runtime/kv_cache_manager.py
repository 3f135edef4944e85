"""Per-request block tables over a BlockPool, with prefix reuse of full blocks identified by chained hashes, and the
release of blocks no query can see again when every layer attends within a sliding window."""

from __future__ import annotations

from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.runtime.block_pool import BlockPool, hash_block
from trtbuild.runtime.request import Request

RELEASED = -1  # a table entry whose block went back to the pool (every later query is past it: `window`)


class KVCacheManager:
    """Owns which blocks each request holds. A request holding n computed tokens has a table of >= ceil(n /
    block_size) entries, one per block of its positions; its first `num_cached[request]` full blocks are registered
    in the pool's content index. With `window` (every layer attends to its last `window` tokens only), the entries of
    blocks that no later query sees are RELEASED and their blocks back in the pool; the engine is given block 0 in
    their place, which its windowed attention never reads (or masks out)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_size = block_size
        self.window = window
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

    def release_outside_window(self, request: Request) -> None:
        """Give back the blocks wholly before the window of the request's next query (position n =
        num_computed_tokens sees keys n - window + 1 .. n): no later query of it reads them. They stay cached
        (a later request with the same prefix can revive them)."""
        table = self.blocks.get(request.request_id)
        if not self.window or not table:
            return
        dead = min(max(request.num_computed_tokens - self.window + 1, 0) // self.block_size, len(table))
        old = [b for b in table[:dead] if b != RELEASED]
        if old:
            self.pool.free(old)
            table[:dead] = [RELEASED] * dead

    def free(self, request: Request) -> None:
        """Return the request's blocks; tail blocks go first in the free queue so shared prefixes live longest."""
        table = self.blocks.pop(request.request_id, [])
        self.num_cached.pop(request.request_id, None)
        self.pool.free([b for b in reversed(table) if b != RELEASED])

    def block_table(self, request: Request) -> list[int]:
        """The request's block ids by position, for the engine (block 0 where one was released)."""
        return [0 if b == RELEASED else b for b in self.blocks.get(request.request_id, [])]


def releasable_window(model: ModelConfig, build: BuildConfig) -> int | None:
    """The window past which an engine's blocks can go back to the pool: when its attention applies the model's
    sliding window in every layer (Mistral, Phi-3). None where some layer reads every block (Gemma 2 / 3 and OLMo 3's
    full layers) or the engine is no longer than the window. NOTE: no builder import here: the Triton backend's
    Python stub runs the runtime without onnx."""
    every_layer = all(model.is_sliding(i) for i in range(model.num_hidden_layers))
    return model.sliding_window if every_layer and model.window_applies(build.max_seq_len) else None
