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
    (chunk,) = scheduler.schedule().chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_drafts, chunk.num_logits) == (5, 4, 3, 4)
    scheduler.update(scheduler_output(chunk), [[101, 200]])  # 101 accepted, 102 rejected: 200 instead
    assert a.token_ids[5:] == [100, 101, 200] and a.num_computed_tokens == 6  # the state is after 100 only
    assert kv.take_state_copies() == [StateCopy(0, DRAFT_CHECKPOINT, save=False)]
    scheduler.set_draft_tokens(a, [201, 202, 203])
    (chunk,) = scheduler.schedule().chunks  # 101 again, 200, then the new drafts
    assert (chunk.start, chunk.num_tokens, chunk.num_drafts, chunk.num_logits) == (6, 5, 3, 4)
    scheduler.update(scheduler_output(chunk), [[201, 202, 203, 204]])  # all accepted: no copy back
    assert a.num_computed_tokens == 11 and len(a.token_ids) == 12 and kv.take_state_copies() == []
    scheduler.set_draft_tokens(a, [205, 206, 207])
    (chunk,) = scheduler.schedule().chunks
    scheduler.update(scheduler_output(chunk), [[300]])  # none accepted
    assert a.num_computed_tokens == 12 and kv.take_state_copies() == [StateCopy(0, DRAFT_CHECKPOINT, save=False)]


def scheduler_output(chunk):
    from trtbuild.runtime.scheduler import SchedulerOutput

    return SchedulerOutput([chunk], [])


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


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, dict, int]:
    """Every request's answer and its tokens' logprobs, by request id, and the drafts accepted in all."""
    answers, logprobs, requests = {}, {}, []
    for i, prompt in enumerate(prompts):
        requests.append(core.make_request(prompt, params, request_id=f"r{i}"))
        core.add_request(requests[-1])
        answers[f"r{i}"], logprobs[f"r{i}"] = [], []
    while core.has_unfinished():
        for out in core.step():
            answers[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    return answers, logprobs, sum(r.metrics.num_accepted_draft_tokens for r in requests)


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
    got, got_logprobs, accepted = generate(drafted, prompts(), params)
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
    """Its recurrent nodes lack the state_checkpoints input: it runs as before, but not with drafts."""
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
