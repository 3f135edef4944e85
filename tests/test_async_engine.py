"""AsyncEngine's threaded loop on a real engine: concurrent streams, cancel, back-pressure, shutdown, engine errors."""

from __future__ import annotations

import threading

import pytest
from engine_core_helpers import GREEDY, PROMPTS, VOCAB, config
from helpers import assert_pool_full

from trtbuild.runtime.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from trtbuild.runtime.engine_core import EngineCore, RequestOutput
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

TIMEOUT = 60  # seconds any stream may wait for its next output: a hang fails instead of blocking the suite


@pytest.fixture(scope="module")
def alone(llama_engine) -> list[list[int]]:
    """Each prompt's greedy tokens, run by itself."""
    llm = LLM(llama_engine, config(enable_prefix_caching=False))
    return [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


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
