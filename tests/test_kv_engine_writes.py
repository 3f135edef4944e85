"""The engine's KV write path: new K/V into their slots, no pool copy, blocks per tokens held, float16 pools."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import RANDOM_CONFIGS, needs_f16c
from kv_helpers import ceil_blocks, changed_slots, req, slot_kv

from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.kv_cache_manager import KVCacheManager

VOCAB = RANDOM_CONFIGS["llama"][1]["vocab_size"]
ENGINE_OPTIONS = dict(max_batch_size=4, max_num_tokens=256)  # as in test_hf_parity: the session reuses the build


# --- through the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_dir(random_hf_model, engine_from_hf):
    return engine_from_hf(random_hf_model("llama"), **ENGINE_OPTIONS)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def feeds_for(engine: CpuEngine, chunks: list[SequenceChunk], pool: np.ndarray) -> dict[str, np.ndarray]:
    """The engine inputs for `chunks`, built independently of CpuEngine.step from the chunks' block tables."""
    tables = np.zeros((len(chunks), engine.max_blocks_per_seq), dtype=np.int64)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_ids)] = c.block_ids
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
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=16)
    block = engine.info.build.tokens_per_block
    pool = engine.kv.pool
    empty = pool.copy()
    tables = {0: [9, 4], 1: [2]}  # non-contiguous, out of order
    chunks = [SequenceChunk(0, tokens(13, 0), 0, 13, tables[0]), SequenceChunk(1, tokens(5, 1), 0, 1, tables[1])]
    logits = engine.step(chunks)
    assert engine.kv.pool is pool  # written in place, no copy
    want_logits, new_kv = engine.session.run(None, feeds_for(engine, chunks, empty))
    np.testing.assert_array_equal(logits, want_logits)
    assert new_kv.shape == (engine.info.model.num_hidden_layers, 2, 18, engine.info.model.num_key_value_heads,
                            engine.info.model.head_size)
    expected = empty.copy()
    for t in range(18):
        seq, pos = (0, t) if t < 13 else (1, t - 13)
        slot_kv(expected, tables[seq][pos // block], pos % block)[...] = new_kv[:, :, t]
    np.testing.assert_array_equal(pool, expected)  # exactly those slots, nothing else
    assert np.abs(new_kv).min() > 0  # (every token's K and V really landed: no zero rows left behind)

    # a decode step writes one slot per layer and K/V, and leaves the rest of the pool alone
    before = pool.copy()
    engine.step([SequenceChunk(0, tokens(1, 2), 13, 1, tables[0])])
    assert engine.kv.pool is pool
    assert changed_slots(pool, before) == [tables[0][13 // block] * block + 13 % block]


def test_pool_is_reused_across_steps_and_block_placement_does_not_change_logits(engine_dir):
    """Steps read and write the one pool object; where a sequence's blocks lie in it does not change its logits."""
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=8)
    block = engine.info.build.tokens_per_block
    pool = engine.kv.pool
    a = tokens(2 * block + 3, 3)
    engine.step([SequenceChunk(0, a[: 2 * block], 0, 0, [6, 1, 4])])
    assert engine.kv.pool is pool
    logits = engine.step([SequenceChunk(0, a[2 * block :], 2 * block, 1, [6, 1, 4])])
    assert engine.kv.pool is pool and engine.kv.num_blocks == 8
    fresh = CpuEngine(engine_dir, num_threads=1, num_blocks=3)  # contiguous blocks, a pool just big enough
    fresh.step([SequenceChunk(0, a[: 2 * block], 0, 0, [0, 1, 2])])
    np.testing.assert_allclose(logits, fresh.step([SequenceChunk(0, a[2 * block :], 2 * block, 1, [0, 1, 2])]),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="too few"):  # a table that does not cover the chunk is refused
        engine.step([SequenceChunk(0, a, 0, 1, [6, 1])])
    engine.allocate_kv_cache(5)  # a new, empty pool of the asked size
    assert engine.kv.pool is not pool and engine.kv.num_blocks == 5 and not engine.kv.pool.any()


@pytest.mark.parametrize("max_seq_len", [64, 256])
def test_blocks_used_follow_tokens_held_not_max_seq_len(max_seq_len, random_hf_model, engine_from_hf):
    engine_dir = engine_from_hf(random_hf_model("llama"), **dict(ENGINE_OPTIONS, max_seq_len=max_seq_len))
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=10)  # fewer blocks than one max_seq_len=256 sequence
    block = engine.info.build.tokens_per_block
    assert engine.info.build.max_seq_len == max_seq_len
    kv = KVCacheManager(num_blocks=10, block_size=block)
    held, requests = 0, []
    for seq, n in enumerate([1, block - 1, block, block + 1, 3 * block + 2]):
        r = req(str(seq), tokens(n, seq))
        assert kv.allocate(r, n)
        requests.append(r)
        logits = engine.step([SequenceChunk(r.request_id, r.token_ids, 0, 1, kv.block_table(r))])
        assert logits.shape == (1, VOCAB) and np.isfinite(logits).all()
        held += ceil_blocks(n, block)
        assert len(kv.block_table(r)) == ceil_blocks(n, block)
        assert kv.pool.num_blocks - kv.pool.num_free == held
    assert held == 9
    assert engine.kv.num_blocks == 10 and engine.kv.pool.nbytes == 10 * block * engine.kv.bytes_per_token
    for r in requests:
        kv.free(r)
    assert kv.pool.num_free == kv.pool.num_blocks


def test_logits_only_for_requested_tokens(engine_dir):
    """One call mixing pasts 0, 9 and 20 returns exactly the rows asked for, equal to the all-rows call's."""
    a, b, c = tokens(21, 4), tokens(14, 5), tokens(6, 6)
    tables = [[0, 1, 2], [3, 4], [5]]

    def run(num_logits: tuple[int, int, int]) -> np.ndarray:
        engine = CpuEngine(engine_dir, num_threads=1, num_blocks=8)
        engine.step([SequenceChunk(0, a[:20], 0, 0, tables[0]), SequenceChunk(1, b[:9], 0, 0, tables[1])])
        return engine.step([SequenceChunk(0, a[20:], 20, num_logits[0], tables[0]),
                            SequenceChunk(1, b[9:], 9, num_logits[1], tables[1]),
                            SequenceChunk(2, c, 0, num_logits[2], tables[2])])

    vocab = VOCAB
    full = run((1, 5, 6))
    assert full.shape == (12, vocab)
    for counts in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 3, 2), (0, 5, 1)]:
        got = run(counts)
        assert got.shape == (sum(counts), vocab), counts
        rows = [0] * counts[0] + list(range(6 - counts[1], 6)) + list(range(12 - counts[2], 12))
        np.testing.assert_allclose(got, full[rows], rtol=1e-5, atol=1e-5 * np.abs(full).max(), err_msg=str(counts))
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=8)
    with pytest.raises(ValueError, match="num_logits"):
        engine.step([SequenceChunk(0, a[:3], 0, 4, [0])])


def test_a_step_mixing_decodes_with_a_long_chunk_runs_as_two_calls_with_the_same_results(engine_dir, monkeypatch):
    """Two decode tokens beside a 200-token prefill chunk would be padded to 200 query rows each; the engine runs
    them as a second call instead. Logits (in chunk order) and the pool come out as from one call."""
    import trtbuild.runtime.engine as engine_module

    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=64)
    rng = np.random.default_rng(5)
    engine.kv.pool[...] = rng.standard_normal(engine.kv.pool.shape) * 0.1  # the decodes' past: 20 tokens each
    block = engine.info.build.tokens_per_block
    chunks = [SequenceChunk("d0", tokens(1, 7), 20, 1, list(range(0, 4))),
              SequenceChunk("p", tokens(200, 8), 0, 3, list(range(8, 8 + -(-200 // block)))),
              SequenceChunk("d1", tokens(1, 9), 20, 1, list(range(4, 8)))]
    assert engine_module.attention_groups(chunks) == [[1], [0, 2]]
    short_prefill = SequenceChunk("q", tokens(30, 1), 0, 1, list(range(20, 24)))  # 2 x 30 x 50 pairs: not worth it
    assert engine_module.attention_groups([chunks[0], short_prefill, chunks[2]]) == [[0, 1, 2]]
    start = engine.kv.pool.copy()
    calls = []
    run = engine.session.run
    monkeypatch.setattr(engine.session, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    split = engine.step(chunks)
    split_pool = engine.kv.pool.copy()
    assert len(calls) == 2 and split.shape == (5, VOCAB)

    engine.kv.pool[...] = start
    monkeypatch.setattr(engine_module, "PADDING_SPLIT_PAIRS", 1 << 40)  # one call
    whole = engine.step(chunks)
    assert len(calls) == 3
    np.testing.assert_allclose(split, whole, rtol=0, atol=1e-5 * np.abs(whole).max())
    np.testing.assert_allclose(split_pool, engine.kv.pool, rtol=0, atol=1e-5)
    assert not np.array_equal(split_pool, start)


# the native op reads a float16 pool with AVX-512 or F16C (a `native` build is refused without either)
@pytest.mark.parametrize("attention", [pytest.param("native", marks=needs_f16c), "split"])
def test_float16_pool_halves_the_bytes_and_rounds_each_stored_value_once(random_hf_model, engine_from_hf, attention):
    """`kv_pool_dtype: float16`, with either attention (the native op reads the float16 pool in place at this head
    size, 16): the pool holds float16 (half the bytes per token), every new K/V is rounded once to float16 when
    stored, attention sees exactly the stored values (a prompt chunked 7 + 6 scores what one 13-token chunk does),
    and the logits stay within float16 rounding of the float32 engine's."""
    hf = random_hf_model("llama")
    full = CpuEngine(engine_dir := engine_from_hf(hf, **ENGINE_OPTIONS), num_threads=1, num_blocks=16)
    half_dir = engine_from_hf(hf, kv_pool_dtype="float16", attention=attention, **ENGINE_OPTIONS)
    half, chunked = (CpuEngine(half_dir, num_threads=1, num_blocks=16) for _ in range(2))
    assert engine_dir != half_dir and half.info.build.kv_pool_dtype == "float16"
    assert half.info.build.attention == attention
    assert half.kv.pool.dtype == np.float16 and 2 * half.kv.bytes_per_token == full.kv.bytes_per_token
    prompt, table = tokens(13, 5), [3, 7]
    want = full.step([SequenceChunk(0, prompt, 0, 13, table)])
    got = half.step([SequenceChunk(0, prompt, 0, 13, table)])
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    # layer 0's K and V come from the embeddings alone: stored as float16(the float32 engine's values)
    np.testing.assert_array_equal(half.kv.pool[:, 0], full.kv.pool[:, 0].astype(np.float16))
    chunked.step([SequenceChunk(0, prompt[:7], 0, 0, table)])
    last = chunked.step([SequenceChunk(0, prompt[7:], 7, 1, table)])
    np.testing.assert_allclose(last, got[-1:], rtol=0, atol=1e-5 * np.abs(got).max())
    np.testing.assert_array_equal(chunked.kv.pool, half.kv.pool)
