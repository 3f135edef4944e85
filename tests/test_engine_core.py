"""EngineCore, LLM and AsyncEngine on real engines: batching, chunking, preemption and prefix reuse never change a
request's tokens; stop conditions, aborts, validation, metrics; the threaded loop's streams, cancel, back-pressure
and shutdown."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from helpers import assert_pool_full, drive

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore, RequestOutput
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

VOCAB = 320  # helpers.RANDOM_CONFIGS["llama"]
LENGTHS = (1, 3, 7, 8, 9, 17, 30, 45)  # around block boundaries, up to several blocks
PROMPTS = [np.random.default_rng(100 + n).integers(3, VOCAB, size=n).tolist() for n in LENGTHS]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
STORY = ", there was a little girl named Lily. She loved to play outside in the park."
TIMEOUT = 60  # seconds any stream may wait for its next output: a hang fails instead of blocking the suite


def config(**options) -> RuntimeConfig:
    return RuntimeConfig(num_threads=1, **options)


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
    """The start-up step (the engine's largest batch: max_batch_size prompts sharing max_num_tokens) runs before any
    request owns a block and writes only block 0; a pool of 6 blocks hands block 0 out again, and every request
    gets the tokens an engine without the warm-up gives it."""
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


# ---- stop conditions (stories260K, greedy) ---------------------------------------------------------------------


def test_greedy_story_and_stop_string(stories_engine):
    llm = LLM(stories_engine, config())
    full = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40))[0]
    assert full.text.startswith(STORY) and full.finish_reason == "length"
    stopped = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop=("Lily",)))[0]
    assert stopped.text == ", there was a little girl named " and stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]  # the token completing "Lily" is the last
    assert llm.core.tokenizer.decode(stopped.token_ids).endswith("Lily")
    kept = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop=["park", "Lily"],
                                                              include_stop_str_in_output=True))[0]
    assert kept.text == ", there was a little girl named Lily" and kept.finish_reason == "stop"
    # the stop string completes on the very token that also reaches max_tokens: still "stop", text cut
    exact = llm.generate(["Once upon a time"], SamplingParams(max_tokens=len(stopped.token_ids), stop="Lily"))[0]
    assert (exact.text, exact.finish_reason) == (stopped.text, "stop")
    assert_pool_full(llm.core)


def test_stop_token_ids_and_max_tokens(stories_engine):
    llm = LLM(stories_engine, config())
    full = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40))[0]
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    # the stop token's own text is not part of the output (as vLLM), the text before it is
    assert out.text == llm.generate(["Once upon a time"], SamplingParams(max_tokens=first))[0].text
    assert full.text.startswith(out.text) and len(out.text) < len(full.text)
    short = llm.generate(["Once upon a time"], SamplingParams(max_tokens=5))[0]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:5]
    assert full.text.startswith(short.text) and short.text
    # min_tokens masks stop token ids until enough tokens were generated
    later = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop_token_ids=[stop_id],
                                                               min_tokens=first + 1))[0]
    assert stop_id not in later.token_ids[: first + 1] and later.token_ids[:first] == full.token_ids[:first]


def test_min_tokens_masks_eos(llama_engine):
    """A greedy request that ends with EOS; with min_tokens beyond that point EOS is never picked before it."""
    llm = LLM(llama_engine, config())
    candidates = [np.random.default_rng(seed).integers(3, VOCAB, size=6).tolist() for seed in range(64)]
    runs = llm.generate(candidates, SamplingParams(max_tokens=40))
    eos = llm.core.eos_token_ids
    hits = [(p, c) for p, c in zip(candidates, runs, strict=True) if c.finish_reason == "stop"
            and len(c.token_ids) >= 3]
    assert hits, "no prompt of the random model ends with EOS within 40 tokens"
    prompt, base = hits[0]
    assert base.token_ids[-1] in eos and not set(base.token_ids[:-1]) & set(eos)
    k = len(base.token_ids) - 1
    out = llm.generate([prompt], SamplingParams(max_tokens=40, min_tokens=k + 4))[0]
    assert out.token_ids[:k] == base.token_ids[:k]
    assert not set(out.token_ids[: k + 4]) & set(eos) and len(out.token_ids) >= k + 4
    ignored = llm.generate([prompt], SamplingParams(max_tokens=k + 3, ignore_eos=True))[0]
    assert ignored.token_ids[: k + 1] == base.token_ids and ignored.finish_reason == "length"


# ---- validation ------------------------------------------------------------------------------------------------


def test_make_request_validation_names_the_field(llama_engine, stories_engine):
    core = EngineCore(llama_engine, config())
    ok = SamplingParams()
    cases = [
        ([], ok, "prompt is empty"),
        ([5] * 256, ok, "prompt has 256 tokens.*max_seq_len is 256"),
        ([5, VOCAB], ok, r"prompt_token_ids: .*\[320\].*outside the vocabulary"),
        ([-1, 5], ok, r"prompt_token_ids: .*\[-1\]"),
        ("hello", ok, "prompt: this engine has no tokenizer"),
        ([5, 6], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids must be token ids below"),
        ([5, 6], SamplingParams(bad_words_ids=[[1, VOCAB + 3]]), "bad_words_ids must be token ids below"),
        ([5, 6], SamplingParams(bad_words=["x"]), "bad_words need a tokenizer"),
    ]
    for prompt, params, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            core.make_request(prompt, params)
    for field, value in (("temperature", -1), ("top_p", 0), ("top_k", -2), ("max_tokens", 0), ("seed", -1),
                         ("min_p", 2), ("logprobs", 99)):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    small = EngineCore(llama_engine, config(kv_cache_blocks=4))  # 32 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks but the whole cache holds 4"):
        small.make_request([5] * 20, SamplingParams(max_tokens=20))
    small.make_request([5] * 20, SamplingParams(max_tokens=12))
    # LLM validates every prompt before queuing any
    llm = LLM(llama_engine, config())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[5, 6], [5, VOCAB]], ok)
    with pytest.raises(ValueError, match="params: got 1 for 2 prompts"):
        llm.generate([[5, 6], [7]], [ok])
    assert not llm.core.has_unfinished() and not llm.core.tracked
    assert not core.has_unfinished() and not core.tracked  # validation left no trace
    text_core = EngineCore(stories_engine, config())
    request = text_core.make_request("Once upon a time", SamplingParams(bad_words=["Lily"]))
    assert request.prompt_ids[0] == 1 and len(request.prompt_ids) > 1  # BOS + text


def test_runtime_config_beyond_the_engine_is_refused(llama_engine):
    with pytest.raises(ValueError, match="max_batch_size 9 exceeds the engine's build limit 8"):
        EngineCore(llama_engine, config(max_batch_size=9))
    with pytest.raises(ValueError, match="max_num_tokens 129 exceeds the engine's build limit 128"):
        EngineCore(llama_engine, config(max_num_tokens=129))
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineCore(llama_engine, config(policy="fifo"))
    with pytest.raises(ValueError, match="kv_cache_blocks must be at least 1"):
        EngineCore(llama_engine, config(kv_cache_blocks=0))


def test_runtime_config_resolves_against_the_build_limits():
    build = BuildConfig(max_batch_size=8, max_num_tokens=128)
    assert RuntimeConfig().resolve(build) == RuntimeConfig(max_batch_size=8, max_num_tokens=128)
    assert RuntimeConfig(max_batch_size=2).resolve(build).max_batch_size == 2
    with pytest.raises(ConfigError, match="max_batch_size 9 exceeds the engine's build limit 8") as e:
        RuntimeConfig(max_batch_size=9).resolve(build)
    assert e.value.field == "max_batch_size" and "--" not in str(e.value)  # the CLI adds flag names


def test_kv_pool_is_sized_from_the_engine_io_spec(llama_engine):
    info = read_engine_config(llama_engine)
    per_block = info.kv_cache_bytes_per_block
    m, b = info.model, info.build
    assert per_block == m.num_hidden_layers * 2 * m.num_key_value_heads * b.tokens_per_block * m.head_size * 4
    core = EngineCore(llama_engine, config(kv_cache_memory=5.5 * per_block, kv_cache_blocks=None))
    assert core.engine.kv.num_blocks == core.kv.pool.num_blocks == 5  # allocated once, at the size asked
    assert core.engine.kv.bytes_per_block == per_block
    with pytest.raises(ConfigError, match=f"holds no KV block \\({per_block} bytes each\\)"):
        EngineCore(llama_engine, config(kv_cache_memory=per_block - 1.0, kv_cache_blocks=None))


def test_request_ids_are_unique(llama_engine):
    core = EngineCore(llama_engine, config())
    core.add_request(core.make_request([5, 6], GREEDY, request_id="x"))
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        core.add_request(core.make_request([7], GREEDY, request_id="x"))
    core.abort_request("x")
    assert_pool_full(core)


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


# ---- AsyncEngine -----------------------------------------------------------------------------------------------


def collect(stream, timeout: float = TIMEOUT) -> tuple[list[int], RequestOutput]:
    tokens = []
    while True:
        out = stream.get(timeout=timeout)
        tokens += out.new_token_ids
        if out.finished:
            return tokens, out


def gate_steps(core: EngineCore, after: int = 0) -> tuple[threading.Event, threading.Event]:
    """Make the core's loop wait before each step past the first `after` until `gate` is set; `waiting` is set once
    the loop waits there."""
    gate, waiting, real_step, count = threading.Event(), threading.Event(), core.step, [0]

    def step():
        count[0] += 1
        if count[0] > after and not gate.is_set():
            waiting.set()
            assert gate.wait(TIMEOUT), "the test never opened the gate"
        return real_step()

    core.step = step
    return gate, waiting


def test_async_concurrent_submits_get_their_alone_tokens(llama_engine, alone):
    engine = AsyncEngine(EngineCore(llama_engine, config()))
    results: list[list[int] | None] = [None] * len(PROMPTS)
    barrier = threading.Barrier(len(PROMPTS))

    def client(i: int) -> None:
        barrier.wait(TIMEOUT)
        results[i] = collect(engine.submit(PROMPTS[i], GREEDY))[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    try:
        assert results == alone
        assert engine.num_finished == len(PROMPTS) and engine.num_unfinished == 0
        assert_pool_full(engine.core)
    finally:
        engine.shutdown()


def test_async_cancel_mid_stream(llama_engine):
    core = EngineCore(llama_engine, config())
    gate, _ = gate_steps(core, after=3)
    engine = AsyncEngine(core)
    try:
        stream = engine.submit(PROMPTS[5], SamplingParams(max_tokens=200, ignore_eos=True))
        first = stream.get(timeout=TIMEOUT)
        assert not first.finished and len(first.new_token_ids) == 1
        stream.cancel()
        gate.set()
        tokens, final = collect(stream)
        assert final.finished and final.finish_reason == "abort"
        assert len(tokens) + 1 < 10  # stopped within a step or two of the cancel, far from 200
        assert stream.finished and list(stream) == []
        assert engine.cancel(stream.request_id) is False  # already gone
        assert_pool_full(core)
    finally:
        engine.shutdown()


def test_async_queue_full(llama_engine, alone):
    core = EngineCore(llama_engine, config())
    gate, _ = gate_steps(core)  # hold the loop so that nothing finishes while we submit
    engine = AsyncEngine(core, max_queue_size=2)
    try:
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        streams = [engine.submit(PROMPTS[i], long) for i in range(2)]
        with pytest.raises(QueueFullError):
            engine.submit(PROMPTS[2], long)
        with pytest.raises(ValueError, match="prompt_token_ids"):  # validation still comes first
            engine.submit([VOCAB], long)
        assert engine.num_unfinished == 2
        gate.set()
        for s in streams:
            tokens, final = collect(s)
            assert final.finish_reason == "length" and len(tokens) == 200
        assert collect(engine.submit(PROMPTS[2], GREEDY))[0] == alone[2]  # room again
        assert_pool_full(core)
    finally:
        engine.shutdown()


def test_async_queued_prompt_tokens_are_bounded_and_released(llama_engine, alone):
    """Memory held by queued requests is bounded in prompt tokens, not only in number; finishing frees it."""
    limit = len(PROMPTS[0]) + len(PROMPTS[1])
    core = EngineCore(llama_engine, config(max_queued_tokens=limit))
    gate, _ = gate_steps(core)
    engine = AsyncEngine(core)
    try:
        assert engine.max_queued_tokens == limit
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        streams = [engine.submit(PROMPTS[i], long) for i in range(2)]
        with pytest.raises(QueueFullError, match=f"{limit} prompt tokens .* limit of {limit}"):
            engine.submit(PROMPTS[2][:1], long)  # one token more than the limit, while the queue has room
        gate.set()
        for s in streams:
            assert collect(s)[1].finish_reason == "length"
        assert collect(engine.submit(PROMPTS[0], GREEDY))[0] == alone[0]  # released: room again
        default = AsyncEngine(EngineCore(llama_engine, config(warm_up=False)))
        pool = default.core.kv.pool.num_blocks * default.core.kv.block_size
        assert default.max_queued_tokens == max(4 * pool, default.core.scheduler.config.max_seq_len)
        default.shutdown()
    finally:
        engine.shutdown()


def test_async_shutdown_ends_every_pending_stream(llama_engine):
    core = EngineCore(llama_engine, config())
    gate, waiting = gate_steps(core)
    engine = AsyncEngine(core)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    running = engine.submit(PROMPTS[0], long)
    assert waiting.wait(TIMEOUT) and running.request_id in core.tracked  # the loop took it and sits at the gate
    queued = engine.submit(PROMPTS[1], long)  # added to the core before the shutdown command
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    for _ in range(1000):  # wait until the shutdown command is queued behind `queued`
        if engine._commands.qsize() == 2:
            break
        threading.Event().wait(0.01)
    assert engine._commands.qsize() == 2
    late = engine.submit(PROMPTS[2], long)  # queued behind the shutdown command: never reaches the core
    gate.set()
    stopper.join(TIMEOUT)
    assert not engine._thread.is_alive()
    for stream in (running, queued, late):
        tokens, final = collect(stream)
        assert final.finished and final.finish_reason == "abort" and len(tokens) < 200
    with pytest.raises(EngineDeadError):
        engine.submit(PROMPTS[3], long)
    assert_pool_full(core)


def test_async_engine_error_reaches_every_stream(llama_engine):
    core = EngineCore(llama_engine, config())

    def broken_step():
        raise RuntimeError("boom")

    core.step = broken_step
    engine = AsyncEngine(core)
    stream = engine.submit(PROMPTS[0], GREEDY)
    with pytest.raises(EngineDeadError, match="boom"):
        stream.get(timeout=TIMEOUT)
    engine._thread.join(TIMEOUT)
    with pytest.raises(EngineDeadError, match="boom"):
        engine.submit(PROMPTS[1], GREEDY)
    assert_pool_full(core)


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", b'{"version": "1.0", "model": ', r"tokenizer\.json is not a valid tokenizer \("),
    ("generation_config.json", b"{not json", r"generation_config\.json is not a valid generation config \("),
    ("generation_config.json", b'{"eos_token_id": "two"}', r"generation_config\.json is not a valid generation "
                                                            r"config \(eos_token_id 'two' is not a token id"),
])
def test_corrupt_tokenizer_files_are_one_line_errors_naming_the_file(stories_engine, tmp_path, name, content, message):
    import shutil

    from click.testing import CliRunner

    from trtbuild.cli import main

    engine = tmp_path / "engine"
    shutil.copytree(stories_engine, engine)
    (engine / name).write_bytes(content)
    with pytest.raises(TrtbuildError, match=message):
        EngineCore(engine, config(warm_up=False))
    result = CliRunner().invoke(main, ["run", "--engine", str(engine), "--prompt", "Once", "--max-tokens", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.search(message, result.output) and len(result.output.strip().splitlines()) == 1


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(stories_engine, monkeypatch):
    core = EngineCore(stories_engine, config())
    limit = core.scheduler.config.max_seq_len * core.tokenizer.max_token_bytes
    monkeypatch.setattr(core.tokenizer, "encode", lambda *_: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(ValueError, match=rf"prompt: {limit + 1} bytes cannot fit in the engine's max_seq_len"):
        core.make_request("a" * (limit + 1), GREEDY)
    with pytest.raises(ValueError, match="bytes cannot fit"):
        core.make_request("é" * (limit // 2 + 1), GREEDY)  # counted in UTF-8 bytes, not characters
