"""Per-request block tables over a BlockPool, one table per KV cache group (configs/kv_groups.py), with prefix reuse
of full blocks identified by chained hashes, and the release of the blocks a sliding-window group no longer reads.
A model with recurrent layers (linear attention, Mamba2) also gives each request a state slot, and reuses a prefix
only up to a block after which a snapshot of the state was kept (runtime/recurrent_state.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trtbuild.configs import KVCacheGroup, max_blocks_held
from trtbuild.runtime.block_pool import BlockPool, hash_block
from trtbuild.runtime.recurrent_state import DRAFT_CHECKPOINT, StateCopy, StateSlots, StateSnapshots
from trtbuild.runtime.request import Request

RELEASED = -1  # a table entry whose block went back to the pool (every later query is past it: `window`)


@dataclass(frozen=True)
class CachedPrefix:
    """Cached blocks for a request's leading full blocks: one table per group, each `len(self)` entries long (a
    sliding group's entries before its window are RELEASED), and the snapshot of the recurrent state after them (-1:
    a model without recurrent layers). `shared_blocks`: with recurrent layers, the leading blocks other requests
    computed, cached beyond the kept state (a prefix they share, e.g. a system prompt: its state is worth keeping)."""

    tables: tuple[tuple[int, ...], ...] = ()
    snapshot: int = -1
    shared_blocks: int = 0

    def __len__(self) -> int:
        return len(self.tables[0]) if self.tables else 0


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    """Owns which blocks each request holds. A request holding n computed tokens has, per group, a table of >=
    ceil(n / block_size) entries, one per block of its positions; its first `num_cached[request]` full blocks are
    registered in the pool's content index (per group: a block holds its group's layers only). A group with a window
    (its layers attend to their last `window` tokens only) RELEASES the entries of blocks no later query reads and
    gives their blocks back to the pool; the engine is given block 0 in their place, which its windowed attention
    never reads (or masks out). All groups draw from one pool, so memory goes where the requests need it."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,), num_state_slots: int = 0,
                 num_state_snapshots: int = 0) -> None:
        """`windows`: one per KV cache group, its layers' sliding window (None: they read every position).
        `num_state_slots`: recurrent state slots (a model with recurrent layers; 0: none), one per running
        request; `num_state_snapshots`: states kept for prefix reuse. NOTE: with slots and no snapshots, no prefix is
        reused: the state after it is not kept."""
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshots = StateSnapshots(num_state_snapshots) if num_state_slots and num_state_snapshots else None
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching and (
            self.state_slots is None or self.snapshots is not None))
        self.block_size = block_size
        self.windows = tuple(windows)
        self.blocks: dict[str, list[list[int]]] = {}
        self.num_cached: dict[str, int] = {}
        self.state_copies: list[StateCopy] = []  # for the engine, before its next step (take_state_copies)
        self.output_snapshot: dict[str, int] = {}  # the prefix hash of the snapshot a request's outputs made last
        self.branch_points: dict[str, int] = {}  # where a request leaves a shared prefix whose state is not kept

    @classmethod
    def for_groups(cls, groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int,
                   enable_prefix_caching: bool = True, num_state_slots: int = 0,
                   num_state_snapshots: int = 0) -> KVCacheManager:
        return cls(num_blocks, block_size, enable_prefix_caching, [g.window for g in groups], num_state_slots,
                   num_state_snapshots)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def _key(self, group: int, block_hash: int) -> int:
        """A block's key in the content index: its group's blocks hold other layers of the same tokens."""
        return block_hash if group == 0 else hash((group, block_hash))

    def window_start(self, group: int, position: int) -> int:
        """The first block of `group` that a query at `position` reads (0 for a group without a window)."""
        window = self.windows[group]
        return max(position - window + 1, 0) // self.block_size if window else 0

    def _extend_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first num_tokens tokens (computed once, then reused)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            # NOTE: K/V computed under a LoRA adapter are not the base model's: its blocks chain from their own root
            root = hash(("lora", request.lora_key)) if request.lora_id else None
            hashes.append(hash_block(hashes[-1] if hashes else root, request.token_ids[i * bs : (i + 1) * bs]))
        return hashes[: num_tokens // bs]

    def computed_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of leading full blocks whose K/V are cached for every group: all of them for a group
        without a window, those inside the window of the first query after them for a sliding one; with recurrent
        layers, also a snapshot of the state after them. The last known token is never taken from the cache: it
        must be computed to produce the next token's logits."""
        if not self.pool.enable_caching:
            return NO_PREFIX
        hashes = self._extend_hashes(request, len(request.token_ids) - 1)

        def cached(group: int, first: int, end: int) -> bool:
            return all(self.pool.lookup(self._key(group, h)) is not None for h in hashes[first:end])

        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                n = next((i for i in range(n) if not cached(g, i, i + 1)), n)
        shared = 0 if self.snapshots is None else next(
            (i for i in range(len(hashes)) if not cached(0, i, i + 1)), len(hashes))
        while n and not ((self.snapshots is None or hashes[n - 1] in self.snapshots) and
                         all(cached(g, self.window_start(g, n * self.block_size), n)
                             for g, window in enumerate(self.windows) if window)):
            n -= 1
        if not n:
            return CachedPrefix(shared_blocks=shared) if shared else NO_PREFIX
        starts = [self.window_start(g, n * self.block_size) for g in range(self.num_groups)]
        return CachedPrefix(tuple((RELEASED,) * s + tuple(self.pool.lookup(self._key(g, h)) for h in hashes[s:n])
                                  for g, s in enumerate(starts)),
                            -1 if self.snapshots is None else self.snapshots.find(hashes[n - 1]), shared)

    def blocks_needed(self, request: Request, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Free blocks that allocate(request, num_tokens, prefix) would consume."""
        tables = self.blocks.get(request.request_id, [[]] * self.num_groups)
        total = -(-num_tokens // self.block_size)
        needed = sum(max(total - len(table) - len(prefix), 0) for table in tables)
        revived = sum(1 for table in prefix.tables for b in table if b != RELEASED and self.pool.ref_counts[b] == 0)
        return needed + revived

    def allocate(self, request: Request, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        """Make the request hold, in every group, blocks for its first num_tokens tokens (taking `prefix` blocks
        first). Returns False, changing nothing, when the pool lacks free blocks."""
        if self.blocks_needed(request, num_tokens, prefix) > self.pool.num_free:
            return False
        if self.state_slots is not None and not self.state_slots.take(request.request_id):
            return False
        tables = self.blocks.setdefault(request.request_id, [[] for _ in self.windows])
        if prefix:
            for table, cached in zip(tables, prefix.tables, strict=True):
                self.pool.touch([b for b in cached if b != RELEASED])
                table.extend(cached)
            self.num_cached[request.request_id] = len(prefix)
            if prefix.snapshot >= 0:
                self.state_copies.append(StateCopy(self.state_slot(request), prefix.snapshot, save=False))
        if branch := self._branch_point(prefix):
            self.branch_points[request.request_id] = branch
        total = -(-num_tokens // self.block_size)
        for table in tables:
            table.extend(self.pool.allocate(max(total - len(table), 0)))
        return True

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | None:
        """Make `child` hold the K/V of the parent's computed tokens: their full blocks shared (one more reference),
        their partial last block copied into a new block of each group. Returns the (source, destination) blocks the
        KV storage must copy, or None, changing nothing, when the pool lacks a free block for each copy or the model
        keeps recurrent states (which are not shared: the child recomputes its tokens)."""
        if self.state_slots is not None:
            return None
        n = parent.num_computed_tokens
        full, partial = divmod(n, self.block_size)
        if partial and self.num_groups > self.pool.num_free:
            return None
        tables, copies = [], []
        for table in self.blocks[parent.request_id]:
            shared = table[:full]
            self.pool.touch([b for b in shared if b != RELEASED])
            tables.append(list(shared))
            if partial:
                (block,) = self.pool.allocate(1)
                copies.append((table[full], block))
                tables[-1].append(block)
        self.blocks[child.request_id] = tables
        self.num_cached[child.request_id] = min(self.num_cached.get(parent.request_id, 0), full)
        return copies

    def max_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, computing at most chunk_tokens per step."""
        return max_blocks_held(self.windows, self.block_size, num_tokens, chunk_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (all tokens computed) for reuse by later requests."""
        if not self.pool.enable_caching:
            return
        hashes = self._extend_hashes(request, request.num_computed_tokens)
        start = self.num_cached.get(request.request_id, 0)
        for g, table in enumerate(self.blocks[request.request_id]):
            for i in range(start, len(hashes)):
                if table[i] != RELEASED:
                    self.pool.cache(table[i], self._key(g, hashes[i]))
        self.num_cached[request.request_id] = len(hashes)

    def _save_points(self, request: Request) -> tuple[int, int]:
        """Where the request's state is kept: where it leaves a prefix others share (0: nowhere), and after the last
        full block of its known tokens."""
        return (self.branch_points.get(request.request_id, 0),
                len(request.token_ids) // self.block_size * self.block_size)

    def _branch_point(self, prefix: CachedPrefix) -> int:
        """Where a request admitted with `prefix` leaves the prefix it shares with others, if no state is kept there."""
        return prefix.shared_blocks * self.block_size if prefix.shared_blocks > len(prefix) else 0

    def state_save_point(self, request: Request, start: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """The first position after `start` where a prefill chunk of the request stops, so that the state there can be
        kept (0: none); `prefix`: what a waiting request is about to be admitted with."""
        if self.snapshots is None:
            return 0
        points = (*self._save_points(request), self._branch_point(prefix))
        return min((p for p in points if p > start), default=0)

    def keep_state(self, request: Request) -> None:
        """After a step (and cache_full_blocks): snapshot the request's state if its computed tokens end at a save
        point. A request keeps one snapshot of its outputs, its newest: the states a conversation's next turn can
        use are after its prompt and after its answer; a request sharing a prefix that has no state kept (a system
        prompt) keeps the state after it, for the requests that follow."""
        n = request.num_computed_tokens
        if self.snapshots is None or not n or n not in self._save_points(request):
            return
        prefix_hash = request.block_hashes[n // self.block_size - 1]
        if n == self.branch_points.get(request.request_id):
            del self.branch_points[request.request_id]
        elif request.num_output_tokens > 1:  # NOTE: the first output token came with the prompt's last chunk
            previous = self.output_snapshot.get(request.request_id)
            if previous is not None and previous != prefix_hash:
                self.snapshots.drop(previous)
            self.output_snapshot[request.request_id] = prefix_hash
        snapshot = self.snapshots.keep(prefix_hash)
        if snapshot is not None:
            self.state_copies.append(StateCopy(self.state_slot(request), snapshot, save=True))

    def roll_back_state(self, request: Request) -> None:
        """A draft of the request's last step was rejected: its slot goes back to the state kept before the drafts
        (the step's state checkpoint, runtime/recurrent_state.py)."""
        self.state_copies.append(StateCopy(self.state_slot(request), DRAFT_CHECKPOINT, save=False))

    def take_state_copies(self) -> list[StateCopy]:
        """The state copies the engine must make before its next step, in order (given once)."""
        copies, self.state_copies = self.state_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: blocks no request holds, and kept states."""
        self.pool.reset_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
            self.output_snapshot.clear()
            self.branch_points.clear()

    def release_outside_window(self, request: Request) -> None:
        """Give back each sliding group's blocks wholly before the window of the request's next query (position n =
        num_computed_tokens sees keys n - window + 1 .. n): no later query of it reads them. They stay cached
        (a later request with the same prefix can revive them)."""
        for g, table in enumerate(self.blocks.get(request.request_id, ())):
            if not self.windows[g]:
                continue
            dead = min(self.window_start(g, request.num_computed_tokens), len(table))
            old = [b for b in table[:dead] if b != RELEASED]
            if old:
                self.pool.free(old)
                table[:dead] = [RELEASED] * dead

    def free(self, request: Request) -> None:
        """Return the request's blocks; tail blocks go first in the free queue so shared prefixes live longest."""
        tables = self.blocks.pop(request.request_id, [])
        self.num_cached.pop(request.request_id, None)
        self.output_snapshot.pop(request.request_id, None)
        self.branch_points.pop(request.request_id, None)
        if self.state_slots is not None:
            self.state_slots.release(request.request_id)
        for table in tables:
            self.pool.free([b for b in reversed(table) if b != RELEASED])

    def block_tables(self, request: Request) -> tuple[tuple[int, ...], ...]:
        """The request's block ids by position, one table per group, for the engine (block 0 where one was
        released)."""
        return tuple(tuple(0 if b == RELEASED else b for b in table)
                     for table in self.blocks.get(request.request_id, [[]] * self.num_groups))

    def state_slot(self, request: Request) -> int:
        """The request's recurrent state slot (-1: none, or a model without recurrent layers)."""
        return -1 if self.state_slots is None else self.state_slots.slot(request.request_id)

    def block_table(self, request: Request) -> list[int]:
        """The first group's table (the only one of most engines)."""
        return list(self.block_tables(request)[0])
