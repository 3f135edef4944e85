"""The paged KV pool: storage (runtime/kv_cache.py) and the engine's write path (slots, O(new tokens) writes, no pool
copy), and block ownership as KVCacheManager hands it out (invariants, ceil(tokens / block) blocks per sequence, a
full pool changes nothing). Exact block ids, prefix reuse and LRU eviction are in test_scheduler.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import RANDOM_CONFIGS

from trtbuild.configs import BuildConfig, ModelConfig, QuantConfig
from trtbuild.quantization import FP8_E4M3_MAX, INT8_MAX, fp8_e4m3_values, kv_pool_dtype, kv_pool_elem_type
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.kv_cache import KVCacheStorage, dequantize_kv, quantize_kv
from trtbuild.runtime.kv_cache_manager import RELEASED, KVCacheManager
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams

LAYERS, KV_HEADS, HEAD, BLOCK = 2, 2, 4, 4
VOCAB = RANDOM_CONFIGS["llama"][1]["vocab_size"]
ENGINE_OPTIONS = dict(max_batch_size=4, max_num_tokens=256)  # as in test_hf_parity: the session reuses the build


def make_storage(num_blocks: int) -> KVCacheStorage:
    return KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, num_blocks)


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


# --- storage ------------------------------------------------------------------------------------------------------


def test_storage_shape_and_sizes():
    storage = make_storage(8)
    assert storage.pool.shape == (8, LAYERS, 2, KV_HEADS, BLOCK, HEAD) and storage.pool.dtype == np.float32
    assert (storage.num_blocks, storage.tokens_per_block) == (8, BLOCK)
    assert storage.bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD * 4 == slot_kv(storage.pool, 0, 0).nbytes
    assert storage.bytes_per_block == BLOCK * storage.bytes_per_token
    assert storage.pool.nbytes == storage.num_blocks * storage.bytes_per_block
    assert not storage.pool.any()
    assert KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 3, dtype=np.float16).bytes_per_token == \
        LAYERS * 2 * KV_HEADS * HEAD * 2


@pytest.mark.parametrize(("kv_quant", "pool", "dtype", "elem_type"), [
    (None, "float32", np.float32, onnx.TensorProto.FLOAT), (None, "float16", np.float16, onnx.TensorProto.FLOAT16),
    ("int8", "float32", np.int8, onnx.TensorProto.INT8), ("fp8", "float32", np.uint8, onnx.TensorProto.UINT8),
])
def test_kv_pool_dtype_is_what_the_runtime_stores(kv_quant, pool, dtype, elem_type):
    """kv_pool_dtype (shared by the engine's kv_cache input and the runtime's pool): the build's dtype, or the 1-byte
    type quantize_kv writes (fp8 as uint8 bit patterns); a pool of another type is refused."""
    model = ModelConfig("LlamaForCausalLM", "llama", "float32", 64, 16, 32, LAYERS, 2, KV_HEADS, HEAD, 1e-5, 64,
                        quantization=QuantConfig(kv_cache_quant_algo=kv_quant))
    assert kv_pool_dtype(model, BuildConfig(kv_pool_dtype=pool)) == np.dtype(dtype)
    assert kv_pool_elem_type(model, BuildConfig(kv_pool_dtype=pool)) == elem_type
    if kv_quant:
        scales = np.ones((LAYERS, 2), dtype=np.float32)
        stored = quantize_kv(np.array([1000.0, -1.5, 0.25], dtype=np.float32), 1.0, kv_quant)
        assert stored.dtype == np.dtype(dtype)
        assert dequantize_kv(stored, 1.0, kv_quant)[0] == {"int8": 127, "fp8": 448}[kv_quant]  # saturated
        assert fp8_e4m3_values().max() == FP8_E4M3_MAX == 448 and INT8_MAX == 127
        KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 2, dtype=dtype, quant_algo=kv_quant, scales=scales)
        with pytest.raises(ValueError, match=f"a {kv_quant} KV cache is stored as"):
            KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 2, dtype=np.float32, quant_algo=kv_quant, scales=scales)


def test_slots_map_positions_through_the_block_table():
    storage = make_storage(8)
    table = [5, 2, 7]
    np.testing.assert_array_equal(storage.slots(table, 0, 10), [20, 21, 22, 23, 8, 9, 10, 11, 28, 29])
    np.testing.assert_array_equal(storage.slots(table, 3, 6), [23, 8, 9])
    np.testing.assert_array_equal(storage.slots(tuple(table), 11, 12), [31])
    assert storage.slots(table, 4, 4).size == 0


def test_write_touches_exactly_the_given_slots():
    storage = make_storage(8)
    rng = np.random.default_rng(1)
    storage.pool[...] = rng.standard_normal(storage.pool.shape)
    pool, data = storage.pool, storage.pool.__array_interface__["data"][0]
    before = pool.copy()
    slots = np.array([23, 8, 9, 28, 0])
    new_kv = rng.standard_normal((LAYERS, 2, len(slots), KV_HEADS, HEAD)).astype(np.float32)
    storage.write(new_kv, [slots])
    assert storage.pool is pool and storage.pool.__array_interface__["data"][0] == data  # in place
    expected = before.copy()
    for t, s in enumerate(slots):
        slot_kv(expected, s // BLOCK, s % BLOCK)[...] = new_kv[:, :, t]
    np.testing.assert_array_equal(storage.pool, expected)
    assert changed_slots(storage.pool, before) == sorted(slots.tolist())


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]  # "always [madvise] never" -> madvise
    except (OSError, IndexError):
        return "unavailable"


def test_pool_is_backed_by_huge_pages_where_the_kernel_offers_them():
    """A pool's first writes fault in 2 MiB pages, not 4 KiB ones, and only what is written becomes resident: the
    pool is block-major, so 16 consecutive blocks (32 KiB each here) lie in one or two huge pages. Small pools are
    left alone."""
    if (mode := _transparent_huge_pages()) not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode} on this machine")
    assert not make_storage(8).huge_pages  # far below one huge page
    storage = KVCacheStorage(LAYERS, KV_HEADS, 64, 16, 4096)  # 32 KiB blocks, 128 MiB in all
    assert storage.huge_pages
    tokens = 16 * 16  # blocks 2000..2015
    storage.write(np.ones((LAYERS, 2, tokens, KV_HEADS, 64), np.float32), [np.arange(tokens) + 16 * 2000])

    start, end = storage.pool.ctypes.data, storage.pool.ctypes.data + storage.pool.nbytes
    huge_kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    rss_kb = storage.resident_bytes // 1024
    if huge_kb == 0:  # madvise was taken (asserted above), but the kernel may find no free 2 MiB page to give
        pytest.skip("the kernel backed the advised pool with 4 KiB pages (no free huge page, or defrag off)")
    assert huge_kb >= 2048  # the 512 KiB written sit in huge pages
    assert rss_kb <= 2 * 2048 + 4096  # and not the rest of the 128 MiB


def test_reserve_makes_the_whole_pool_resident_and_keeps_it_zero():
    """reserve() faults every page in (as a GPU engine allocates its whole pool at start): the pool's resident bytes
    go from what was written to all of it, and every value is still zero."""
    storage = KVCacheStorage(LAYERS, KV_HEADS, 64, 16, 2048)  # 64 MiB: above glibc's largest mmap threshold
    before = storage.resident_bytes
    storage.reserve()
    if storage.resident_bytes == 0:
        pytest.skip("this system does not say which pages are resident (mincore)")
    assert before < storage.pool.nbytes // 4
    assert storage.resident_bytes >= storage.pool.nbytes - 4096
    assert not storage.pool.any()


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


@pytest.mark.parametrize(("dtype", "quant", "head", "target", "want"), [
    ("float32", QuantConfig(), 64, "cpu", "float32"),  # float32 weights: an exact KV cache too
    ("bfloat16", QuantConfig(), 64, "cpu", "float16"),
    ("float16", QuantConfig(), 64, "cpu", "float16"),
    ("float32", QuantConfig(quant_algo="weight_only", group_size=32), 64, "cpu", "float16"),  # a quantized GGUF
    ("float32", QuantConfig(quant_algo="fp8", kv_cache_quant_algo="fp8"), 64, "cpu", "float32"),  # its own pool
    ("bfloat16", QuantConfig(), 8, "cpu", "float32"),  # the native op does not read float16 at head size 8
    ("bfloat16", QuantConfig(), 64, "cuda", "float32"),  # the GPU targets' pool has the compute dtype
])
def test_the_default_pool_is_float16_where_weights_are_16_bit_or_quantized(dtype, quant, head, target, want):
    """As llama.cpp's default KV cache and vLLM's for a 16-bit model; recorded in the build config, so an engine
    says what it holds, and `--kv-pool-dtype` overrides it."""
    from trtbuild.builder.build import default_build_config

    heads = 4
    model = ModelConfig("LlamaForCausalLM", "llama", dtype, heads * head, 16, 32, LAYERS, heads, 2, head, 1e-5, 64,
                        quantization=quant)
    assert default_build_config(model, target=target).kv_pool_dtype == want
    assert default_build_config(model, target=target, kv_pool_dtype="float32").kv_pool_dtype == "float32"


@pytest.mark.parametrize("attention", ["native", "split"])
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
