"""The paged KV pool (runtime/kv_cache.py) and the engine's write path: ownership, growth, O(new tokens) writes."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import RANDOM_CONFIGS

from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.kv_cache import PagedKVCache

LAYERS, KV_HEADS, HEAD, BLOCK = 2, 2, 4, 4
VOCAB = RANDOM_CONFIGS["llama"][1]["vocab_size"]
ENGINE_OPTIONS = dict(max_batch_size=4, max_num_tokens=256)  # as in test_hf_parity: the session reuses the build


def make_cache(num_blocks: int, growable: bool = True) -> PagedKVCache:
    return PagedKVCache(LAYERS, KV_HEADS, HEAD, BLOCK, num_blocks, growable=growable)


def assert_ownership(cache: PagedKVCache) -> None:
    """Every block is free or owned by exactly one sequence, never both, never twice."""
    owned = [b for table in cache.block_tables.values() for b in table]
    everything = owned + cache.free_blocks
    assert sorted(everything) == list(range(cache.num_blocks)), (cache.block_tables, cache.free_blocks)


def test_block_ids_are_handed_out_and_returned_in_order():
    cache = make_cache(8)
    assert cache.ensure_capacity(1, 5) == [0, 1]
    assert cache.ensure_capacity(2, 4) == [2]
    assert cache.ensure_capacity(1, 8) == [0, 1]  # still fits: nothing new
    assert cache.ensure_capacity(1, 9) == [0, 1, 3]
    assert cache.ensure_capacity(3, 0) == []
    assert cache.free_blocks == [4, 5, 6, 7]
    assert_ownership(cache)
    cache.free(1)
    assert cache.free_blocks == [4, 5, 6, 7, 0, 1, 3]  # freed blocks queue behind the never-used ones
    assert 1 not in cache.block_tables
    cache.free(1)  # freeing twice (or an unknown sequence) is a no-op
    assert cache.free_blocks == [4, 5, 6, 7, 0, 1, 3]
    assert cache.ensure_capacity(4, 5 * BLOCK) == [4, 5, 6, 7, 0]
    assert cache.ensure_capacity(2, 2 * BLOCK) == [2, 1]
    assert cache.free_blocks == [3]
    assert_ownership(cache)
    assert cache.num_blocks == 8


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 8, 9, 31])
def test_a_sequence_owns_ceil_tokens_over_block_size_blocks(tokens):
    cache = make_cache(16)
    for n in range(1, tokens + 1):  # growing one token at a time, as decoding does
        table = cache.ensure_capacity(7, n)
        assert len(table) == -(-n // BLOCK)
    assert len(cache.free_blocks) == 16 - -(-tokens // BLOCK)


def test_growth_doubles_the_pool_and_keeps_contents():
    cache = make_cache(2)
    rng = np.random.default_rng(0)
    cache.ensure_capacity(1, 2 * BLOCK)
    cache.pool[...] = rng.standard_normal(cache.pool.shape)
    before = cache.pool.copy()
    assert cache.free_blocks == []
    assert cache.ensure_capacity(2, 1) == [2]
    assert cache.num_blocks == 4 and cache.pool.shape == (LAYERS, 2, 4, BLOCK, KV_HEADS, HEAD)
    np.testing.assert_array_equal(cache.pool[:, :, :2], before)
    assert not cache.pool[:, :, 2:].any()
    assert cache.free_blocks == [3]
    assert cache.ensure_capacity(3, 5 * BLOCK) == [3, 4, 5, 6, 7]  # 4 -> 8 blocks on the way
    assert cache.num_blocks == 8 and cache.free_blocks == []
    np.testing.assert_array_equal(cache.pool[:, :, :2], before)
    assert cache.bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD * 4
    assert cache.pool.nbytes == cache.num_blocks * BLOCK * cache.bytes_per_token
    assert_ownership(cache)


def test_a_full_fixed_pool_raises_and_changes_nothing():
    cache = make_cache(4, growable=False)
    cache.ensure_capacity(1, 3 * BLOCK)
    pool = cache.pool
    with pytest.raises(MemoryError):
        cache.ensure_capacity(2, 2 * BLOCK)  # needs 2 blocks, 1 is free
    assert cache.block_tables == {1: [0, 1, 2]} and cache.free_blocks == [3]  # no partial table
    with pytest.raises(MemoryError):
        cache.ensure_capacity(1, 5 * BLOCK)
    assert cache.block_tables == {1: [0, 1, 2]} and cache.free_blocks == [3]
    assert cache.ensure_capacity(2, BLOCK) == [3]  # what does fit still works
    with pytest.raises(MemoryError):
        cache.ensure_capacity(3, 1)
    assert cache.pool is pool and cache.num_blocks == 4
    cache.free(1)
    assert cache.ensure_capacity(3, 1) == [0]


def test_slots_map_positions_through_the_block_table():
    cache = make_cache(8)
    cache.block_tables[5] = [5, 2, 7]
    np.testing.assert_array_equal(cache.slots(5, 0, 10), [20, 21, 22, 23, 8, 9, 10, 11, 28, 29])
    np.testing.assert_array_equal(cache.slots(5, 3, 6), [23, 8, 9])
    assert cache.slots(5, 4, 4).size == 0


def test_write_touches_exactly_the_given_slots():
    cache = make_cache(8)
    rng = np.random.default_rng(1)
    cache.pool[...] = rng.standard_normal(cache.pool.shape)
    pool, data = cache.pool, cache.pool.__array_interface__["data"][0]
    before = pool.copy()
    slots = np.array([23, 8, 9, 28, 0])
    new_kv = rng.standard_normal((LAYERS, 2, len(slots), KV_HEADS, HEAD)).astype(np.float32)
    cache.write(new_kv, slots)
    assert cache.pool is pool and cache.pool.__array_interface__["data"][0] == data  # in place
    expected = before.copy()
    for t, s in enumerate(slots):
        expected[:, :, s // BLOCK, s % BLOCK] = new_kv[:, :, t]
    np.testing.assert_array_equal(cache.pool, expected)
    changed = np.flatnonzero((cache.pool != before).any(axis=(0, 1, 4, 5)).reshape(-1))
    assert sorted(changed.tolist()) == sorted(slots.tolist())


# --- through the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(random_hf_model, engine_from_hf):
    return engine_from_hf(random_hf_model("llama"), **ENGINE_OPTIONS)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def feeds_for(engine: CpuEngine, chunks: list[SequenceChunk], pool: np.ndarray) -> dict[str, np.ndarray]:
    """The engine inputs for `chunks`, built independently of CpuEngine.step from the block tables it holds."""
    tables = np.zeros((len(chunks), engine.max_blocks_per_seq), dtype=np.int64)
    for i, c in enumerate(chunks):
        table = engine.kv.block_tables[c.seq_id]
        tables[i, : len(table)] = table
    lengths = [len(c.token_ids) for c in chunks]
    ends = np.cumsum(lengths)
    return {
        "input_ids": np.array([t for c in chunks for t in c.token_ids], dtype=np.int64),
        "position_ids": np.concatenate([np.arange(c.start, c.start + len(c.token_ids)) for c in chunks]),
        "query_start_loc": np.concatenate([[0], ends]).astype(np.int64),
        "past_lengths": np.array([c.start for c in chunks], dtype=np.int64),
        "block_tables": tables,
        "logits_indices": np.concatenate([np.arange(e - c.num_logits, e) for c, e in zip(chunks, ends, strict=True)]
                                         ).astype(np.int64),
        "kv_cache": pool,
    }


def test_prefill_writes_the_sessions_new_kv_into_its_slots(engine_dir):
    engine = CpuEngine(engine_dir, num_threads=1, initial_blocks=16)
    block = engine.info.build.tokens_per_block
    pool = engine.kv.pool
    empty = pool.copy()
    chunks = [SequenceChunk(0, tokens(13, 0), 0, num_logits=13), SequenceChunk(1, tokens(5, 1), 0)]
    logits = engine.step(chunks)
    assert engine.kv.pool is pool  # written in place, no copy
    assert engine.kv.block_tables == {0: [0, 1], 1: [2]}
    want_logits, new_kv = engine.session.run(None, feeds_for(engine, chunks, empty))
    np.testing.assert_array_equal(logits, want_logits)
    assert new_kv.shape == (engine.info.model.num_hidden_layers, 2, 18, engine.info.model.num_key_value_heads,
                            engine.info.model.head_size)
    expected = empty.copy()
    for t in range(18):
        seq, pos = (0, t) if t < 13 else (1, t - 13)
        expected[:, :, engine.kv.block_tables[seq][pos // block], pos % block] = new_kv[:, :, t]
    np.testing.assert_array_equal(pool, expected)  # exactly those slots, nothing else
    assert np.abs(new_kv).min() > 0  # (every token's K and V really landed: no zero rows left behind)

    # a decode step writes one slot per layer and K/V, and leaves the rest of the pool alone
    before = pool.copy()
    engine.step([SequenceChunk(0, tokens(1, 2), 13)])
    assert engine.kv.pool is pool
    changed = (pool != before).any(axis=(0, 1, 4, 5))
    assert np.argwhere(changed).tolist() == [[1, 13 % block]]


def test_pool_is_reused_until_it_grows_and_growth_keeps_the_cache(engine_dir):
    engine = CpuEngine(engine_dir, num_threads=1, initial_blocks=2)
    block = engine.info.build.tokens_per_block
    pool = engine.kv.pool
    a = tokens(2 * block + 3, 3)
    engine.step([SequenceChunk(0, a[: 2 * block], 0, num_logits=0)])
    assert engine.kv.pool is pool and engine.kv.num_blocks == 2
    held = pool.copy()
    logits = engine.step([SequenceChunk(0, a[2 * block :], 2 * block)])  # needs a third block: the pool doubles
    assert engine.kv.pool is not pool and engine.kv.num_blocks == 4
    np.testing.assert_array_equal(engine.kv.pool[:, :, :2], held)
    # the grown pool is the one the next step reads: same logits as an engine that never had to grow
    fresh = CpuEngine(engine_dir, num_threads=1, initial_blocks=8)
    fresh.step([SequenceChunk(0, a[: 2 * block], 0, num_logits=0)])
    np.testing.assert_allclose(logits, fresh.step([SequenceChunk(0, a[2 * block :], 2 * block)]), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("max_seq_len", [64, 256])
def test_blocks_used_follow_tokens_held_not_max_seq_len(max_seq_len, random_hf_model, engine_from_hf):
    engine_dir = engine_from_hf(random_hf_model("llama"), **dict(ENGINE_OPTIONS, max_seq_len=max_seq_len))
    engine = CpuEngine(engine_dir, num_threads=1, initial_blocks=1)
    block = engine.info.build.tokens_per_block
    assert engine.info.build.max_seq_len == max_seq_len
    held = 0
    for seq, n in enumerate([1, block - 1, block, block + 1, 3 * block + 2]):
        engine.step([SequenceChunk(seq, tokens(n, seq), 0)])
        held += -(-n // block)
        assert len(engine.kv.block_tables[seq]) == -(-n // block)
        assert engine.kv.num_blocks - len(engine.kv.free_blocks) == held
    assert held == 9
    assert engine.kv.num_blocks == 16  # 1 block doubled until 9 fit, whatever max_seq_len allows
    assert engine.kv.pool.nbytes == 16 * block * engine.kv.bytes_per_token
    for seq in range(5):
        engine.release(seq)
    assert len(engine.kv.free_blocks) == engine.kv.num_blocks


def test_logits_only_for_requested_tokens(engine_dir):
    """One call mixing pasts 0, 9 and 20 returns exactly the rows asked for, equal to the all-rows call's."""
    a, b, c = tokens(21, 4), tokens(14, 5), tokens(6, 6)

    def run(num_logits: tuple[int, int, int]) -> np.ndarray:
        engine = CpuEngine(engine_dir, num_threads=1)
        engine.step([SequenceChunk(0, a[:20], 0, num_logits=0), SequenceChunk(1, b[:9], 0, num_logits=0)])
        return engine.step([SequenceChunk(0, a[20:], 20, num_logits=num_logits[0]),
                            SequenceChunk(1, b[9:], 9, num_logits=num_logits[1]),
                            SequenceChunk(2, c, 0, num_logits=num_logits[2])])

    vocab = VOCAB
    full = run((1, 5, 6))
    assert full.shape == (12, vocab)
    for counts in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 3, 2), (0, 5, 1)]:
        got = run(counts)
        assert got.shape == (sum(counts), vocab), counts
        rows = [0] * counts[0] + list(range(6 - counts[1], 6)) + list(range(12 - counts[2], 12))
        np.testing.assert_allclose(got, full[rows], rtol=1e-5, atol=1e-5 * np.abs(full).max(), err_msg=str(counts))
    engine = CpuEngine(engine_dir, num_threads=1)
    with pytest.raises(ValueError, match="num_logits"):
        engine.step([SequenceChunk(0, a[:3], 0, num_logits=4)])
