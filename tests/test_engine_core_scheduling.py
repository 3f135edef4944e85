"""EngineCore scheduling: batching, chunking, preemption, prefix reuse and warm-up keep tokens; aborts, metrics."""

from __future__ import annotations

import numpy as np
import pytest
from engine_core_helpers import GREEDY, LENGTHS, PROMPTS, VOCAB, config
from helpers import assert_pool_full, drive

from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def alone(llama_engine) -> list[list[int]]:
    """Each prompt's greedy tokens, run by itself."""
    llm = LLM(llama_engine, config(enable_prefix_caching=False))
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


# ---- batching never changes tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "budget", "min_steps", "min_running"), [
    ({}, 128, 24, 8),  # every prompt in the first step (120 tokens), then 23 decode steps of all 8
    ({"max_prefill_chunk": 3}, 128, 15 + 23, 8),  # the 45-token prompt needs 15 prefill steps
    ({"max_num_tokens": 5}, 5, (sum(LENGTHS) + 8 * 23) // 5, 5),  # 5 tokens a step, decodes included
], ids=["whole", "chunk3", "budget5"])
def test_batched_greedy_equals_alone(llama_engine, alone, options, budget, min_steps, min_running):
    core = EngineCore(llama_engine, config(**options))
    tokens, finals, stats = drive(core, PROMPTS, GREEDY)
    assert tokens == alone
    assert [f.finish_reason for f in finals] == ["length"] * len(PROMPTS)
    assert max(s.num_running for s in stats) >= min_running  # really batched
    assert max(s.num_scheduled_tokens for s in stats) <= budget
    assert len(stats) >= min_steps
    if not options:
        assert len(stats) == min_steps
    assert_pool_full(core)


def test_llm_generate_batched_equals_alone(llama_engine, alone):
    llm = LLM(llama_engine, config())
    completions = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in completions] == alone
    assert {c.finish_reason for c in completions} == {"length"} and all(c.text == "" for c in completions)
    assert_pool_full(llm.core)


def test_seeded_sampling_is_the_same_alone_and_batched(llama_engine, alone):
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=16, ignore_eos=True)
               for i in range(4)]
    llm = LLM(llama_engine, config())
    by_itself = [llm.generate([PROMPTS[i]], sampled[i])[0].token_ids for i in range(4)]
    # batched with each other and with greedy requests, in another order
    mixed = [PROMPTS[7], PROMPTS[3], PROMPTS[0], PROMPTS[5], PROMPTS[2], PROMPTS[1], PROMPTS[6]]
    params = [GREEDY, sampled[3], sampled[0], GREEDY, sampled[2], sampled[1], GREEDY]
    got = [c.token_ids for c in LLM(llama_engine, config(max_prefill_chunk=4)).generate(mixed, params)]
    assert [got[2], got[5], got[4], got[1]] == by_itself
    assert [got[0], got[3], got[6]] == [alone[7], alone[5], alone[6]]
    assert by_itself[0] != alone[0][:16]  # really sampled, not greedy
    reseeded = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16,
                                                         ignore_eos=True))[0].token_ids
    assert reseeded != by_itself[0]  # the seed matters


# ---- KV memory pressure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False], ids=["prefix_caching", "no_caching"])
def test_tiny_pool_preempts_and_still_returns_exact_tokens(llama_engine, alone, caching):
    # 12 blocks of 8 tokens: the longest request alone needs 9 (45 + 24 tokens), all 8 together 43
    core = EngineCore(llama_engine, config(kv_cache_blocks=12, policy="max_utilization", enable_prefix_caching=caching))
    tokens, finals, stats = drive(core, PROMPTS, GREEDY)
    assert tokens == alone
    assert [f.finish_reason for f in finals] == ["length"] * len(PROMPTS)
    preemptions = sum(f.metrics.num_preemptions for f in finals)
    assert preemptions > 0 and sum(s.num_preempted for s in stats) == preemptions
    assert_pool_full(core)


def test_tiny_pool_guaranteed_no_evict_never_preempts(llama_engine, alone):
    core = EngineCore(llama_engine, config(kv_cache_blocks=12, policy="guaranteed_no_evict"))
    tokens, finals, stats = drive(core, PROMPTS, GREEDY)
    assert tokens == alone
    assert all(f.metrics.num_preemptions == 0 for f in finals) and not any(s.num_preempted for s in stats)
    assert max(s.num_running for s in stats) < len(PROMPTS)  # the pool, not the batch size, limited admission
    assert_pool_full(core)


# ---- prefix caching --------------------------------------------------------------------------------------------


def test_start_up_makes_the_kv_pool_resident(llama_engine):
    """With the warm-up, the whole pool is faulted in at start (no step waits for memory later); without it, the
    pool stays lazily mapped. NOTE: 64 MiB pools, above glibc's largest mmap threshold (32 MiB): a smaller zeroed
    array may come from reused, already resident heap memory."""
    cold = EngineCore(llama_engine, config(warm_up=False, kv_cache_blocks=16384))
    warm = EngineCore(llama_engine, config(kv_cache_blocks=16384, max_num_tokens=64, max_batch_size=4))
    assert warm.engine.kv.pool.nbytes >= 64 << 20
    if warm.engine.kv.resident_bytes == 0:
        pytest.skip("this system does not say which pages are resident (mincore)")
    assert warm.engine.kv.resident_bytes >= warm.engine.kv.pool.nbytes - 4096
    assert cold.engine.kv.resident_bytes < cold.engine.kv.pool.nbytes // 4


def test_start_up_warm_up_writes_only_block_0_and_changes_no_tokens(llama_engine):
    """The start-up step (the engine's largest batch: max_batch_size sequences of one token) runs before any request
    owns a block and writes only block 0; a pool of 6 blocks hands block 0 out again, and every request gets the
    tokens an engine without the warm-up gives it."""
    cold = EngineCore(llama_engine, config(warm_up=False, kv_cache_blocks=6))
    warm = EngineCore(llama_engine, config(kv_cache_blocks=6, max_num_tokens=64, max_batch_size=4))
    assert not cold.engine.kv.pool.any()
    written = np.flatnonzero(warm.engine.kv.pool.any(axis=(1, 2, 3, 4, 5)))  # blocks holding any nonzero value
    assert written.tolist() == [0] and warm.kv.pool.num_free == 6
    for i in (1, 3, 5):  # each gets block 0 (the free queue hands out the least recently freed first)
        assert drive(warm, [PROMPTS[i]], GREEDY)[0] == drive(cold, [PROMPTS[i]], GREEDY)[0]


def test_prefix_caching_reuses_blocks_and_keeps_tokens(llama_engine):
    rng = np.random.default_rng(5)
    shared = rng.integers(3, VOCAB, size=43).tolist()  # 5 full blocks + 3 tokens
    first, second, aligned = shared + [11, 12, 13], shared + [21, 22], shared + [31] * 5  # aligned: 6 full blocks
    expected = [c.token_ids for c in LLM(llama_engine, config(enable_prefix_caching=False)).generate(
        [first, second, aligned], GREEDY)]
    core = EngineCore(llama_engine, config())
    tokens, finals, _ = drive(core, [first], GREEDY)
    assert tokens == [expected[0]] and finals[0].metrics.num_prefix_cached_tokens == 0
    tokens, finals, _ = drive(core, [second], GREEDY)
    assert finals[0].metrics.num_prefix_cached_tokens == 40  # the 5 shared full blocks
    assert tokens == [expected[1]]
    # the whole prompt again: every full block is reused except the one holding the last prompt token
    tokens, finals, _ = drive(core, [first], GREEDY)
    assert finals[0].metrics.num_prefix_cached_tokens == 40 and tokens == [expected[0]]
    # a prompt of whole blocks, twice: its last block holds the last prompt token, which is always recomputed
    tokens, finals, _ = drive(core, [aligned], GREEDY)
    assert finals[0].metrics.num_prefix_cached_tokens == 40 and tokens == [expected[2]]
    tokens, finals, _ = drive(core, [aligned], GREEDY)
    assert finals[0].metrics.num_prefix_cached_tokens == 40 and tokens == [expected[2]]
    assert_pool_full(core)
    off = EngineCore(llama_engine, config(enable_prefix_caching=False))
    drive(off, [first], GREEDY)
    assert drive(off, [second], GREEDY)[1][0].metrics.num_prefix_cached_tokens == 0


# ---- abort -----------------------------------------------------------------------------------------------------


def test_abort_mid_generation_returns_blocks(llama_engine):
    core = EngineCore(llama_engine, config(max_batch_size=1))
    running = core.make_request(PROMPTS[7], SamplingParams(max_tokens=100, ignore_eos=True))
    waiting = core.make_request(PROMPTS[6], GREEDY)
    core.add_request(running)
    core.add_request(waiting)
    got = []
    for _ in range(5):
        got += [t for o in core.step() for t in o.new_token_ids]
    assert len(got) == 5 and core.kv.pool.num_free < core.kv.pool.num_blocks
    out = core.abort_request(running.request_id)
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert out.num_output_tokens == 5 and out.metrics is not None
    out = core.abort_request(waiting.request_id)  # never scheduled
    assert out.finished and out.finish_reason == "abort" and out.num_output_tokens == 0
    assert core.abort_request(running.request_id) is None  # already gone
    assert core.abort_request("no-such-request") is None
    assert not core.has_unfinished() and core.step() == []
    assert_pool_full(core)


def test_llm_stream_closed_early_aborts_its_requests(llama_engine):
    llm = LLM(llama_engine, config())
    stream = llm.stream(PROMPTS[:3], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.core.has_unfinished()
    assert_pool_full(llm.core)


# ---- metrics ---------------------------------------------------------------------------------------------------


def test_finished_request_metrics_are_ordered(llama_engine):
    core = EngineCore(llama_engine, config(max_batch_size=2))
    _, finals, _ = drive(core, PROMPTS[:4], GREEDY)
    for i, f in enumerate(finals):
        m = f.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft is not None and m.ttft >= m.queue_time >= 0
        assert (f.num_prompt_tokens, f.num_output_tokens) == (len(PROMPTS[i]), GREEDY.max_tokens)
    # with 2 slots the last two requests waited for the first two to finish
    assert finals[3].metrics.first_scheduled_time >= finals[0].metrics.finished_time
