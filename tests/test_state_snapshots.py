"""Prefix reuse for models with recurrent layers (runtime/recurrent_state.py): the state after a request's last full
block of known tokens is kept as a snapshot (after its prompt, and its newest after its answer), and a later request
whose leading blocks are cached up to such a block starts from a copy of it. Here: the copies and snapshots the KV
cache manager and scheduler make (exact ids), and conversations whose answers equal those computed from scratch."""

from __future__ import annotations

import numpy as np
import pytest

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.kv_cache_manager import NO_PREFIX, KVCacheManager
from trtbuild.runtime.recurrent_state import StateCopy, StateSnapshots, default_snapshots, state_bytes
from trtbuild.runtime.request import FinishReason, Request
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig


def test_snapshots_are_found_by_prefix_and_the_least_recently_used_goes_first():
    kept = StateSnapshots(2)
    assert (kept.keep(10), kept.keep(20)) == (0, 1)
    assert kept.keep(10) is None  # kept already: no copy to make, and now the most recently used
    assert kept.keep(30) == 1 and 20 not in kept and kept.find(20) == -1
    assert kept.find(10) == 0 and kept.keep(40) == 1  # 30 was the least recently used
    kept.drop(10)
    assert kept.free == [0] and kept.keep(50) == 0
    kept.clear()
    assert sorted(kept.free) == [0, 1] and 50 not in kept


def run(scheduler: Scheduler, sampled: list[int] | None = None):
    """One step with the given sampled token per sampling chunk; the chunks scheduled, as (start, tokens)."""
    out = scheduler.schedule()
    tokens = iter(sampled or [])
    scheduler.update(out, [[next(tokens)] for c in out.chunks if c.samples])
    return [(c.start, c.num_tokens) for c in out.chunks]


def test_a_prompt_stops_at_its_last_full_block_and_the_answer_keeps_its_newest_state():
    """Blocks of 4, an attention group and a convolution group (window 4), 2 slots, 2 snapshots."""
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(None, 4), num_state_slots=2, num_state_snapshots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_tokens=64, max_batch_size=2, max_seq_len=64), kv)
    a = Request("a", list(range(1, 11)), SamplingParams(max_tokens=8))
    scheduler.add_request(a)
    assert run(scheduler) == [(0, 8)]  # stops after block 1, so that the state after it can be kept
    assert kv.take_state_copies() == [StateCopy(slot=0, snapshot=0, save=True)]
    assert run(scheduler, [100]) == [(8, 2)] and kv.take_state_copies() == []
    assert run(scheduler, [101]) == [(10, 1)] and kv.take_state_copies() == []
    assert run(scheduler, [102]) == [(11, 1)]  # 12 computed: the answer's first kept state
    assert kv.take_state_copies() == [StateCopy(0, 1, True)] and kv.output_snapshot["a"] == a.block_hashes[2]
    for token in (103, 104, 105, 106):
        run(scheduler, [token])
    # 16 computed: the answer's newer state replaces its older one (in the same snapshot, freed first)
    assert kv.take_state_copies() == [StateCopy(0, 1, True)]
    assert dict(kv.snapshots.kept) == {a.block_hashes[1]: 0, a.block_hashes[3]: 1}
    scheduler.finish_requests([a], FinishReason.STOP)
    # the next turn: a's tokens and 3 more; 18 known before the last: 4 full blocks, a state kept after them
    b = Request("b", a.token_ids[:16] + [7, 8, 9], SamplingParams(max_tokens=2))
    prefix = kv.computed_prefix(b)
    assert (len(prefix), prefix.snapshot) == (4, 1)
    scheduler.add_request(b)
    assert run(scheduler, [5]) == [(16, 3)] and b.metrics.num_prefix_cached_tokens == 16
    assert kv.take_state_copies() == [StateCopy(slot=0, snapshot=1, save=False)]
    # a turn that changed a's answer after its 14th token finds the state after the prompt's blocks only
    c = Request("c", a.token_ids[:14] + [9, 9, 9, 9], SamplingParams(max_tokens=2))
    assert (len(kv.computed_prefix(c)), kv.computed_prefix(c).snapshot) == (2, 0)
    kv.reset_prefix_cache()  # b's blocks (b runs) stay: c would keep the state where it leaves them
    assert (len(kv.computed_prefix(c)), kv.computed_prefix(c).shared_blocks) == (0, 3)
    scheduler.finish_requests([b], FinishReason.STOP)
    kv.reset_prefix_cache()
    assert kv.computed_prefix(c) is NO_PREFIX


def test_a_prefix_shared_without_a_kept_state_gets_one_from_the_next_request_through_it():
    """a and b share their first 8 tokens (a system prompt), which a's state was not kept after: b stops there and
    keeps it, so c starts after it. Blocks of 4, one attention group, 3 slots, 4 snapshots."""
    kv = KVCacheManager(num_blocks=32, block_size=4, num_state_slots=3, num_state_snapshots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_tokens=64, max_batch_size=3, max_seq_len=64), kv)
    system = list(range(1, 9))
    a, b, c = (Request(r, system + [50 + 10 * i + j for j in range(6)], SamplingParams(max_tokens=1))
               for i, r in enumerate("abc"))
    scheduler.add_request(a)
    assert run(scheduler) == [(0, 12)] and run(scheduler, [5]) == [(12, 2)]
    assert kv.take_state_copies() == [StateCopy(0, 0, save=True)]  # after a's last full block only
    prefix = kv.computed_prefix(b)
    assert (len(prefix), prefix.shared_blocks) == (0, 2)
    scheduler.add_request(b)
    assert run(scheduler) == [(0, 8)] and b.metrics.num_prefix_cached_tokens == 0  # stops where it leaves a
    assert kv.take_state_copies() == [StateCopy(0, 1, save=True)] and "b" not in kv.branch_points
    assert run(scheduler) == [(8, 4)] and kv.take_state_copies() == [StateCopy(0, 2, save=True)]
    assert run(scheduler, [5]) == [(12, 2)]
    scheduler.add_request(c)
    assert run(scheduler) == [(8, 4)] and c.metrics.num_prefix_cached_tokens == 8
    assert kv.take_state_copies() == [StateCopy(0, 1, save=False), StateCopy(0, 3, save=True)]


def test_without_snapshots_no_prefix_is_reused_and_chunks_are_not_cut():
    kv = KVCacheManager(num_blocks=16, block_size=4, windows=(None, 4), num_state_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_tokens=64, max_batch_size=2, max_seq_len=64), kv)
    scheduler.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=2)))
    assert run(scheduler, [5]) == [(0, 10)] and kv.take_state_copies() == []
    assert not kv.pool.enable_caching and kv.state_save_point(scheduler.running[0], 0) == 0


@pytest.fixture(scope="module", params=["qwen3_5", "granite4_h", "mamba2"])
def engine(request, random_hf_model, engine_from_hf):
    """Gated DeltaNet layers, and Mamba2 layers (each beside convolution rows in the pool; Mamba2: no attention at
    all), blocks of 8."""
    return engine_from_hf(random_hf_model(request.param), max_batch_size=4, max_num_tokens=256)


def converse(core: EngineCore, turns: int, answer: int = 11) -> tuple[list[list[int]], np.ndarray, list[int]]:
    """A conversation: each turn's prompt is the last prompt, its answer and 5 new tokens. Returns every turn's answer,
    every answer token's logprob, and how many of each prompt's tokens came from the cache."""
    rng = np.random.default_rng(7)
    prompt, answers, logprobs, cached = rng.integers(3, 300, size=13).tolist(), [], [], []
    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True, logprobs=0)
    for turn in range(turns):
        request = core.make_request(prompt, params, request_id=f"turn{turn}")
        core.add_request(request)
        tokens = []
        while core.has_unfinished():
            for out in core.step():
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.logprobs]
        answers.append(tokens)
        cached.append(request.metrics.num_prefix_cached_tokens)
        prompt = prompt + tokens + rng.integers(3, 300, size=5).tolist()
    return answers, np.array(logprobs), cached


def test_each_turn_of_a_conversation_starts_after_the_last_answer(engine):
    """Turn t's prompt is 13 + 16 (t - 1) tokens: the state after the last full block of the last turn's computed
    tokens (its answer's last token is never computed) is restored, and the answers are those computed from
    scratch."""
    reused, logprobs, cached = converse(EngineCore(engine, RuntimeConfig(num_threads=1)), turns=4)
    scratch, want, none = converse(EngineCore(engine, RuntimeConfig(num_threads=1, max_state_snapshots=0)), turns=4)
    assert reused == scratch and none == [0, 0, 0, 0]
    np.testing.assert_allclose(logprobs, want, atol=1e-4, rtol=0)
    assert cached == [0] + [(13 + 16 * t - 6) // 8 * 8 for t in range(1, 4)] == [0, 16, 32, 48]


def test_requests_sharing_a_prompt_run_together_from_its_state(engine):
    """A prompt computed once, then three requests that extend it, in one batch: each restores the state after the
    first one's prompt into its own slot."""
    core = EngineCore(engine, RuntimeConfig(num_threads=1))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    shared = list(range(40, 64))
    first = core.make_request(shared, params)
    core.add_request(first)
    while core.has_unfinished():
        core.step()
    extended = [core.make_request(shared + [7 + i, 9], params) for i in range(3)]
    for r in extended:
        core.add_request(r)
    copies = []
    original = core.engine.copy_states
    core.engine.copy_states = lambda c: (copies.extend(c), original(c))
    while core.has_unfinished():
        core.step()
    assert [r.metrics.num_prefix_cached_tokens for r in extended] == [24, 24, 24]
    prompt_state = core.kv.snapshots.find(first.block_hashes[2])
    assert [(c.slot, c.snapshot, c.save) for c in copies if not c.save] == [(s, prompt_state, False) for s in (0, 1, 2)]
    fresh = EngineCore(engine, RuntimeConfig(num_threads=1, max_state_snapshots=0))
    want = [fresh.make_request(shared + [7 + i, 9], params) for i in range(3)]
    for r in want:
        fresh.add_request(r)
    while fresh.has_unfinished():
        fresh.step()
    assert [r.token_ids for r in extended] == [r.token_ids for r in want]


def test_requests_after_one_that_shared_a_system_prompt_start_after_it(engine):
    """Requests of one system prompt (20 tokens) and different questions, one after another: the first two compute it
    (the second keeps the state after its 16 shared tokens), the others start after it; the answers and logprobs are
    those computed without snapshots."""
    def answers(core: EngineCore) -> tuple[list[list[int]], np.ndarray, list[int]]:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
        tokens, logprobs, cached = [], [], []
        for i in range(4):
            request = core.make_request(list(range(100, 120)) + [7 + i, 30 + i, 9, 11 + i], params)
            core.add_request(request)
            while core.has_unfinished():
                logprobs += [lp.logprob for out in core.step() for lp in out.logprobs]
            tokens.append(request.token_ids[request.num_prompt_tokens:])
            cached.append(request.metrics.num_prefix_cached_tokens)
        return tokens, np.array(logprobs), cached

    got, logprobs, cached = answers(EngineCore(engine, RuntimeConfig(num_threads=1)))
    want, want_logprobs, none = answers(EngineCore(engine, RuntimeConfig(num_threads=1, max_state_snapshots=0)))
    assert got == want and cached == [0, 0, 16, 16] and none == [0, 0, 0, 0]
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_states_kept_are_two_per_sequence_and_8_within_a_tenth_of_memory_unless_asked(engine):
    model = read_engine_config(engine).model
    per_state = state_bytes(model)
    assert default_snapshots(model, 4, 10**12) == 16 and default_snapshots(model, 1, 10**12) == 10
    assert default_snapshots(model, 4, 50 * per_state) == 5 and default_snapshots(model, 4, 0) == 1
    build = BuildConfig(max_batch_size=8)
    assert RuntimeConfig().resolve(build).max_state_snapshots is None  # the default, by the model's state size
    assert RuntimeConfig(max_state_snapshots=3).resolve(build).max_state_snapshots == 3
    assert RuntimeConfig(max_state_snapshots=3, enable_prefix_caching=False).resolve(build).max_state_snapshots == 0
    with pytest.raises(ConfigError, match="max_state_snapshots"):
        RuntimeConfig(max_state_snapshots=-1)
    core = EngineCore(engine, RuntimeConfig(num_threads=1, warm_up=False))
    assert core.kv.snapshots.free == list(range(16)) and core.engine.states.snapshots.shape[0] == 16


def test_states_that_memory_cannot_hold_are_refused_at_start(engine, monkeypatch):
    """Running and kept states are resident only once written: a count memory cannot hold is refused before any
    request, naming what to lower, instead of the server being killed when requests fill them."""
    from trtbuild.runtime import memory

    available = memory.available_memory_bytes()
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: available)  # NOTE: fixed, for the count below
    snapshots = available // state_bytes(read_engine_config(engine).model)  # + the 4 running slots: too many
    with pytest.raises(TrtbuildError, match=r"recurrent states \(4 running sequences' and \d+ kept.*--max-state-snap"):
        EngineCore(engine, RuntimeConfig(num_threads=1, max_state_snapshots=int(snapshots), warm_up=False))


def test_the_cuda_engine_restores_states_as_the_cpu_engine(random_hf_model, engine_from_hf):
    """The cuda target's snapshots live on its device beside the running states (Triton's interpreter on CPU here)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev]); the cuda target needs it")
    options = dict(max_seq_len=64, tokens_per_block=4, max_batch_size=4, max_num_tokens=32)
    hf = random_hf_model("qwen3_5")
    cpu, cuda = engine_from_hf(hf, **options), engine_from_hf(hf, target="cuda", **options)
    config = RuntimeConfig(num_threads=1, kv_cache_blocks=48, warm_up=False)
    want, want_logprobs, want_cached = converse(EngineCore(cpu, config), turns=3, answer=6)
    got, logprobs, cached = converse(EngineCore(cuda, config), turns=3, answer=6)
    assert got == want and cached == want_cached == [0, 16, 28]
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "prompt-lookup drafts"])
def test_a_soak_of_a_qwen3_5_server_returns_every_token_with_kept_states(tmp_path, monkeypatch, drafts):
    """benchmarks/soak.py for a few seconds on a Qwen3.5 server (its prompts repeat, so states are kept and restored
    beside preemptions, cancels and dropped streams; with drafts, also rolled back after rejected ones): every
    completed stream equals its request alone, the pool is whole again (the 60-second runs are in
    docs/reliability.md)."""
    from gguf_helpers import make_hf_folder
    from helpers import assert_soak_passes, require_shared_models

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    convert(make_hf_folder("qwen3_5", tmp_path / "hf", {}), tmp_path / "ckpt")
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=256, tokens_per_block=8,
                          max_batch_size=8, max_num_tokens=128)
    assert_soak_passes(engine, kv_cache_blocks=40, speculative_tokens=drafts)
