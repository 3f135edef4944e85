"""KV block ownership as KVCacheManager hands it out: invariants, ceil(tokens / block) blocks, full-pool refusals.

Exact block ids, prefix reuse and LRU eviction are in test_scheduler.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import BLOCK, ceil_blocks, req

from trtbuild.runtime.kv_cache_manager import RELEASED, KVCacheManager
from trtbuild.runtime.request import Request

# --- ownership (KVCacheManager over BlockPool) ----------------------------------------------------------------------


def assert_ownership(kv: KVCacheManager, requests: dict[str, Request]) -> None:
    """Every block is free (ref 0, in the free queue once) or held (ref = number of tables holding it, over every
    group), never both; a table never holds a block twice; the content index and the blocks' hashes agree; a table's
    registered blocks carry its own hashes (keyed by group); a windowed group released exactly the blocks before its
    window."""
    pool = kv.pool
    held = [b for tables in kv.blocks.values() for table in tables for b in table if b != RELEASED]
    for tables in kv.blocks.values():
        assert len(tables) == kv.num_groups
        live = [b for table in tables for b in table if b != RELEASED]
        assert len(set(live)) == len(live), tables
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held.count(block), (block, kv.blocks)
        assert (pool.ref_counts[block] == 0) == (block in pool.free_queue), block
    assert len(pool.free_queue) == pool.num_blocks - len(set(held))
    assert {h: b for b, h in enumerate(pool.block_hash) if h is not None} == pool.cached
    for rid, tables in kv.blocks.items():
        r = requests[rid]
        for g, table in enumerate(tables):
            for i in range(kv.num_cached.get(rid, 0)):
                if table[i] != RELEASED:
                    assert pool.block_hash[table[i]] in (None, kv._key(g, r.block_hashes[i]))
            start = kv.window_start(g, r.num_computed_tokens)
            assert all(b == RELEASED for b in table[:start]) and RELEASED not in table[start:], (g, table)


@pytest.mark.parametrize("windows", [(None,), (6,), (None, 6, 6)], ids=["full", "sliding", "hybrid"])
@pytest.mark.parametrize("caching", [True, False])
def test_ownership_invariants_under_random_admit_grow_free(caching, windows):
    """Random traffic with shared prefixes: allocate (with prefix reuse), grow, register full blocks, release what
    fell out of a window, free; for one group of full layers, one of sliding layers and a hybrid of both."""
    rng = np.random.default_rng(0)
    num_blocks = 12 * len(windows)
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=caching, windows=windows)
    live: dict[str, Request] = {}
    prefixes = [rng.integers(0, 5, size=8).tolist() for _ in range(3)]
    hits = refused = 0
    for i in range(300):
        op = rng.random()
        if op < 0.4 or not live:  # admit: a shared prefix + a random tail
            r = req(f"r{i}", prefixes[rng.integers(3)][: rng.integers(1, 9)] + rng.integers(0, 5, size=rng.integers(
                0, 6)).tolist())
            prefix = kv.computed_prefix(r)
            hits += bool(prefix)
            n = len(r.token_ids)
            if kv.allocate(r, n, prefix):
                live[r.request_id] = r
                r.num_computed_tokens = n
                kv.cache_full_blocks(r)
                kv.release_outside_window(r)
                assert all(len(t) == ceil_blocks(n) for t in kv.block_tables(r))
            else:
                refused += 1
                assert r.request_id not in kv.blocks
        elif op < 0.75:  # grow by a decoded token
            r = live[list(live)[rng.integers(len(live))]]
            r.token_ids.append(int(rng.integers(0, 5)))
            if kv.allocate(r, len(r.token_ids)):
                r.num_computed_tokens = len(r.token_ids)
                kv.cache_full_blocks(r)
                kv.release_outside_window(r)
            else:
                r.token_ids.pop()
            assert all(len(t) == ceil_blocks(r.num_computed_tokens) for t in kv.block_tables(r))
        else:
            kv.free(live.pop(list(live)[rng.integers(len(live))]))
        assert_ownership(kv, live)
    assert refused and (hits if caching else not hits)
    for r in live.values():
        kv.free(r)
    assert kv.pool.num_free == num_blocks and not kv.blocks


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 8, 9, 31])
def test_a_sequence_owns_ceil_tokens_over_block_size_blocks(tokens):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    r, before = req("a", [1]), []
    for n in range(1, tokens + 1):  # growing one token at a time, as decoding does
        assert kv.allocate(r, n)
        assert len(kv.block_table(r)) == ceil_blocks(n)
        assert kv.block_table(r)[: len(before)] == before  # growth appends, the blocks held stay where they are
        before = list(kv.block_table(r))
    assert kv.pool.num_free == 16 - ceil_blocks(tokens)
    assert kv.allocate(r, 1) and len(kv.block_table(r)) == ceil_blocks(tokens)  # never shrinks while held


def test_a_full_pool_refuses_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a, b, c = req("a", list(range(3 * BLOCK))), req("b", [1]), req("c", [2])
    assert kv.allocate(a, 3 * BLOCK)
    a.num_computed_tokens = 3 * BLOCK
    kv.cache_full_blocks(a)
    table_a, free = list(kv.block_table(a)), list(kv.pool.free_queue)
    assert not kv.allocate(b, 2 * BLOCK)  # needs 2 blocks, 1 is free
    assert kv.blocks == {"a": [table_a]} and list(kv.pool.free_queue) == free  # no partial table
    assert not kv.allocate(a, 5 * BLOCK)
    assert kv.blocks == {"a": [table_a]} and list(kv.pool.free_queue) == free
    # a prefix hit that would still need too many fresh blocks takes no reference on the shared blocks
    d = req("d", list(range(2 * BLOCK)) + [99] * (2 * BLOCK + 1))
    prefix = kv.computed_prefix(d)
    assert prefix.tables == (tuple(table_a[:2]),)
    assert not kv.allocate(d, len(d.token_ids), prefix)
    assert kv.pool.ref_counts[table_a[0]] == 1 and "d" not in kv.blocks and "d" not in kv.num_cached
    assert kv.allocate(b, BLOCK)  # what does fit still works
    assert not kv.allocate(c, 1)
    kv.free(a)
    assert kv.allocate(c, 1)
    assert kv.pool.num_free == 2
