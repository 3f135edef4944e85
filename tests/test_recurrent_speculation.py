"""Speculative decoding on models with recurrent layers (runtime/recurrent_state.py): a step whose chunk ends in drafts
keeps the state from before them in its slot's draft checkpoint; a rejected draft copies it back and the accepted
drafts are computed again at the head of the next chunk. Here: the scheduler's rollback (exact counts and copies),
and greedy answers with drafts (right, wrong and partly right, on purpose) equal to those without, token for token,
logprobs within 1e-4, on Qwen3.5 (gated DeltaNet), Granite 4.0-H and Mamba2 engines, verified on the host or by the
engine, on the CPU engine and the cuda plan; an engine built before checkpoints is refused with what to do."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Sequence

import numpy as np
import onnx
import pytest

from trtbuild.errors import ConfigError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.recurrent_state import DRAFT_CHECKPOINT, StateCopy
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig
from trtbuild.runtime.speculative import Proposer, SpeculativeConfig

K = 3  # drafts a step


def test_a_rejected_draft_rolls_the_state_back_and_the_accepted_ones_are_computed_again():
    kv = KVCacheManager(num_blocks=16, block_size=4, num_state_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_tokens=64, max_batch_size=2, max_seq_len=64), kv)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20))
    scheduler.add_request(a)
    out = scheduler.schedule()
    scheduler.update(out, [[100]])
    scheduler.set_draft_tokens(a, [101, 102, 103])
    out = scheduler.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_drafts, chunk.num_logits) == (5, 4, 3, 4)
    scheduler.update(out, [[101, 200]])  # 101 accepted, 102 rejected: 200 instead
    assert a.token_ids[5:] == [100, 101, 200] and a.num_computed_tokens == 6  # the state is after 100 only
    assert kv.take_state_copies() == [StateCopy(0, DRAFT_CHECKPOINT, save=False)]
    scheduler.set_draft_tokens(a, [201, 202, 203])
    out = scheduler.schedule()
    (chunk,) = out.chunks  # 101 again, 200, then the new drafts
    assert (chunk.start, chunk.num_tokens, chunk.num_drafts, chunk.num_logits) == (6, 5, 3, 4)
    scheduler.update(out, [[201, 202, 203, 204]])  # all accepted: no copy back
    assert a.num_computed_tokens == 11 and len(a.token_ids) == 12 and kv.take_state_copies() == []
    scheduler.set_draft_tokens(a, [205, 206, 207])
    scheduler.update(scheduler.schedule(), [[300]])  # none accepted
    assert a.num_computed_tokens == 12 and kv.take_state_copies() == [StateCopy(0, DRAFT_CHECKPOINT, save=False)]


class Scripted(Proposer):
    """Drafts from the answers computed without drafts: the first `good` of them right, then a wrong one, `good`
    cycling over 0..K, so that steps accept none, some and all of their drafts."""

    def __init__(self, answers: dict[str, list[int]], vocab_size: int) -> None:
        self.answers, self.vocab_size = answers, vocab_size
        self.good = itertools.cycle(range(K + 1))

    def propose_batch(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, limit in zip(requests, max_tokens, strict=True):
            truth, good = self.answers[request.request_id][request.num_output_tokens:], next(self.good)
            wrong = [(truth[good] + 1) % self.vocab_size] if good < len(truth) else []
            drafts.append((truth[:good] + wrong)[:limit])
        return drafts


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams
             ) -> tuple[dict, dict, list[Request]]:
    """Every request's answer and its tokens' logprobs, by request id, and the requests (their metrics count
    drafts)."""
    answers, logprobs, requests = {}, {}, []
    for i, prompt in enumerate(prompts):
        requests.append(core.make_request(prompt, params, request_id=f"r{i}"))
        core.add_request(requests[-1])
        answers[f"r{i}"], logprobs[f"r{i}"] = [], []
    while core.has_unfinished():
        for out in core.step():
            answers[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    return answers, logprobs, requests


def drafts(requests: list[Request]) -> tuple[int, int]:
    """Drafts accepted, and drafted, in all."""
    return (sum(r.metrics.num_accepted_draft_tokens for r in requests),
            sum(r.metrics.num_draft_tokens for r in requests))


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 300, size=n).tolist() for n in (7, 13, 21)]


def assert_drafts_change_nothing(plain: EngineCore, drafted: EngineCore, logprobs: int | None = 0) -> None:
    """The scripted drafts' answers (3 requests batched) are the plain ones, with their logprobs; steps rejected
    drafts and accepted all of them, and every slot went back."""
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    want, want_logprobs, _ = generate(plain, prompts(), params)
    drafted.proposer = Scripted(want, drafted.vocab_size)
    rollbacks = []
    original = drafted.kv.roll_back_state
    drafted.kv.roll_back_state = lambda request: (rollbacks.append(request.request_id), original(request))
    got, got_logprobs, requests = generate(drafted, prompts(), params)
    accepted, _ = drafts(requests)
    assert got == want
    for rid in want:
        np.testing.assert_allclose(got_logprobs[rid], want_logprobs[rid], atol=1e-4, rtol=0)
    assert accepted and rollbacks, "drafts were meant to be accepted and rejected"
    assert not drafted.kv.state_slots.held


def speculative(**options) -> RuntimeConfig:
    return RuntimeConfig(num_threads=1, speculative=SpeculativeConfig(num_speculative_tokens=K), **options)


@pytest.fixture(scope="module", params=["qwen3_5", "granite4_h", "mamba2"])
def engine(request, random_hf_model, engine_from_hf):
    return engine_from_hf(random_hf_model(request.param), max_batch_size=4, max_num_tokens=256)


def test_greedy_answers_with_drafts_are_the_answers_without(engine):
    assert_drafts_change_nothing(EngineCore(engine, RuntimeConfig(num_threads=1)), EngineCore(engine, speculative()))


def test_prompt_lookup_on_a_conversation_keeps_its_states_right(engine):
    """n-gram drafts across the turns of a conversation whose kept states are restored (runtime/recurrent_state.py):
    the answers of tests/test_state_snapshots.py's conversation without drafts."""
    from test_state_snapshots import converse

    want, want_logprobs, want_cached = converse(EngineCore(engine, RuntimeConfig(num_threads=1)), turns=3)
    core = EngineCore(engine, speculative())
    got, logprobs, cached = converse(core, turns=3)
    assert got == want and cached[1:] and all(cached[1:])
    np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


def test_drafts_the_engine_verifies_itself(random_hf_model, engine_from_hf):
    """An engine built with --speculative-decoding-mode draft-tokens verifies greedy drafts in its graph; the states
    roll back as with drafts verified on the host."""
    path = random_hf_model("qwen3_5")
    plain = engine_from_hf(path, max_batch_size=4, max_num_tokens=256)
    verifying = engine_from_hf(path, max_batch_size=4, max_num_tokens=256, speculative_decoding_mode="draft-tokens",
                               max_draft_len=K)
    core = EngineCore(verifying, speculative())
    assert core.engine.max_draft_len == K
    assert_drafts_change_nothing(EngineCore(plain, RuntimeConfig(num_threads=1)), core, logprobs=None)


def test_the_cuda_engine_rolls_states_back_as_the_cpu_engine(random_hf_model, engine_from_hf):
    """The cuda plan's scans keep the checkpoint in its device states (Triton's interpreter on CPU here)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev]); the cuda target needs it")
    options = dict(max_seq_len=64, tokens_per_block=4, max_batch_size=4, max_num_tokens=64)
    path = random_hf_model("granite4_h")
    cpu, cuda = engine_from_hf(path, **options), engine_from_hf(path, target="cuda", **options)
    config = dict(kv_cache_blocks=48, warm_up=False)
    assert_drafts_change_nothing(EngineCore(cpu, RuntimeConfig(num_threads=1, **config)),
                                 EngineCore(cuda, speculative(**config)))


def test_an_engine_built_before_state_checkpoints_is_refused_with_what_to_do(engine, tmp_path):
    """Its recurrent nodes lack the state_checkpoints input: it runs as before, but not with drafts, nor as a draft
    model."""
    old = tmp_path / "old"
    shutil.copytree(engine, old)
    (graph_file,) = old.glob("*.onnx")
    model = onnx.load(str(graph_file), load_external_data=False)
    inputs = [i for i in model.graph.input if i.name == "state_checkpoints"]
    model.graph.input.remove(inputs[0])
    for node in model.graph.node:
        if node.input and node.input[-1] == "state_checkpoints":
            node.input.pop()
    onnx.save(model, str(graph_file))
    EngineCore(old, RuntimeConfig(num_threads=1, warm_up=False))
    with pytest.raises(ConfigError, match="rebuild the engine from its checkpoint, or run it without speculative"):
        EngineCore(old, speculative(warm_up=False))
    with pytest.raises(ConfigError, match="could keep their state part-way, which drafting needs; rebuild it"):
        EngineCore(engine, draft_model(old))


def draft_model(draft_dir) -> RuntimeConfig:
    return RuntimeConfig(num_threads=1, speculative=SpeculativeConfig(K, method="draft_model",
                                                                       draft_engine_dir=str(draft_dir)))


def test_a_recurrent_model_drafting_for_itself_is_always_right(engine):
    """The draft's own states roll back too (its catch-up keeps the state before the newest token): drafting for
    itself, every draft is accepted, and the answers are the plain ones."""
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    want, _, _ = generate(EngineCore(engine, RuntimeConfig(num_threads=1)), prompts(), params)
    core = EngineCore(engine, draft_model(engine))
    got, _, requests = generate(core, prompts(), params)
    accepted, drafted = drafts(requests)
    assert got == want and accepted == drafted > 0
    assert not core.proposer.seqs and not core.proposer.kv.state_slots.held


@pytest.fixture(scope="module")
def small_draft(random_hf_model, engine_from_hf, tmp_path_factory):
    """(the Qwen3.5 target engine, the model cut to its first 2 layers by `convert --num-layers`, built with smaller
    steps so that its catch-ups split)."""
    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert

    path, work = random_hf_model("qwen3_5"), tmp_path_factory.mktemp("draft")
    convert(path, work / "ckpt", num_layers=2)
    draft = build_engine(work / "ckpt", work / "draft", max_batch_size=2, max_num_tokens=16, max_seq_len=256)
    return engine_from_hf(path, max_batch_size=4, max_num_tokens=256), draft


def test_a_smaller_recurrent_draft(small_draft):
    """Some drafts are rejected, and the answers are the plain ones."""
    target, draft = small_draft
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    want, _, _ = generate(EngineCore(target, RuntimeConfig(num_threads=1)), prompts(), params)
    core = EngineCore(target, draft_model(draft))
    got, _, requests = generate(core, prompts(), params)
    accepted, drafted = drafts(requests)
    assert got == want and 0 < accepted < drafted


def test_the_draft_keeps_the_state_a_fresh_prefill_computes(small_draft):
    """Mid-run, each request's draft checkpoint holds the state that the draft engine computes from scratch over
    the tokens before it (in pieces of its max_num_tokens)."""
    from trtbuild.runtime.engine import CpuEngine, SequenceChunk

    target, draft = small_draft
    core = EngineCore(target, draft_model(draft))
    for i, prompt in enumerate(prompts()[:2]):
        core.add_request(core.make_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}"))
    fresh = CpuEngine(draft, num_threads=1, num_blocks=64)
    checked = 0
    for _ in range(10):
        core.step()
        proposer = core.proposer
        for request in core.scheduler.running:
            seq = proposer.seqs.get(request.request_id)
            if seq is None or not seq.kept_state:
                continue
            n, bs = seq.kept_state, proposer.kv.block_size
            blocks = list(range(-(-n // bs)))
            for start in range(0, n, 16):
                fresh.step([SequenceChunk(0, request.token_ids[start : min(start + 16, n)], start, 1, blocks,
                                          state_slot=0)])
            states = proposer.engine.states
            kept = states.states[states.num_slots + proposer.kv.state_slot(seq)]
            np.testing.assert_allclose(kept, fresh.states.states[0], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked > 5 and sum(r.metrics.num_accepted_draft_tokens < r.metrics.num_draft_tokens
                               for r in core.scheduler.running)
