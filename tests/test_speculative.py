"""Speculative decoding: n-gram proposals, verification (greedy and rejection sampling), scheduling of drafts, and
end to end on real engines: the tokens are exactly those of plain decoding, in fewer engine steps."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_pool_full, drive

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams, SamplingState
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig
from trtbuild.runtime.speculative import NgramProposer, SpeculativeConfig, verify

VOCAB = 8


def ngram(max_n: int = 4, min_n: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(4, prompt_lookup_max=max_n, prompt_lookup_min=min_n))


def test_ngram_proposes_what_followed_the_latest_match_longest_first():
    assert ngram().propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert ngram().propose([1, 2, 3, 4, 1, 2], 10) == [3, 4, 1, 2]  # up to the end of the context
    assert ngram().propose([7, 1, 9, 5, 1, 8, 5, 1], 2) == [8, 5]  # "5 1" last seen before "8 5"
    assert ngram().propose([1, 9, 2, 1, 8, 3, 2, 1], 2) == [8, 3]  # "2 1" beats the later single "1"
    assert ngram(max_n=2, min_n=2).propose([1, 2, 3, 4, 5, 1], 3) == []  # no 2-gram repeats
    assert ngram().propose([1, 2, 3], 3) == [] and ngram().propose([4], 3) == []
    assert ngram().propose([1, 2, 1, 2], 0) == []


def test_config_errors_name_the_field():
    for kwargs, message in ((dict(num_speculative_tokens=0), "num_speculative_tokens"),
                            (dict(num_speculative_tokens=2, method="eagle"), "method"),
                            (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
                             r"prompt_lookup_min must be at least 1 and at most prompt_lookup_max \(2\), got 3")):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**kwargs)


def rows(*argmaxes: int, margin: float = 4.0) -> np.ndarray:
    logits = np.zeros((len(argmaxes), VOCAB), dtype=np.float32)
    logits[np.arange(len(argmaxes)), argmaxes] = margin
    return logits


def state(prompt=(0, 1), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt))


def test_greedy_verification_accepts_the_agreeing_prefix_then_corrects():
    s = state()
    got = verify(rows(5, 6, 3), [5, 7], s)
    assert (got.token_ids, got.num_accepted) == ([5, 6], 1)
    got = verify(rows(5, 6, 3), [5, 6], s)
    assert (got.token_ids, got.num_accepted) == ([5, 6, 3], 2)  # all accepted, plus the bonus token
    got = verify(rows(2, 6, 3), [5, 6], s)
    assert (got.token_ids, got.num_accepted) == ([2], 0)
    assert s.token_ids == [0, 1]  # verification leaves the state as it was
    with pytest.raises(ValueError, match="2 drafts need 3 logits rows"):
        verify(rows(1, 2), [1, 2], s)


def test_each_row_sees_the_tokens_accepted_before_it():
    """A frequency penalty on row 1 counts the draft accepted on row 0, as plain decoding would."""
    logits = rows(5, 5, 0)
    logits[1, 4] = 3.0  # row 1: token 5 leads by 1.0, less than the penalty of 2 for having emitted it once
    got = verify(logits, [5, 4], state(frequency_penalty=2.0))
    assert got.token_ids == [5, 4, 0]


def test_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft, the first token is distributed as p: accept d with p(d), else draw from p without d."""
    p = np.array([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0])
    logits = np.log(np.maximum(p, 1e-30)).astype(np.float32)[None, :].repeat(2, axis=0)
    trials = 20_000
    for draft in (1, 3, 6):  # likely, unlikely, impossible (p = 0)
        counts = np.zeros(VOCAB)
        accepted = 0
        for seed in range(trials):
            got = verify(logits, [draft], state(temperature=1.0, seed=seed))
            counts[got.token_ids[0]] += 1
            accepted += got.num_accepted
        assert np.abs(counts / trials - p).max() < 0.012, (draft, counts / trials)
        assert abs(accepted / trials - p[draft]) < 0.012


def make_scheduler(max_num_tokens: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_tokens=max_num_tokens, max_batch_size=4, max_seq_len=64)
    return Scheduler(config, KVCacheManager(16, 4))


def test_drafts_are_scheduled_as_known_tokens_with_one_logit_each():
    s = make_scheduler()
    r = Request("a", list(range(10, 17)), SamplingParams(max_tokens=20))  # 7 prompt tokens
    s.add_request(r)
    out = s.schedule()
    s.update(out, [[30]])  # prefill -> first token; 7 computed, 8 known
    r.spec_token_ids = [31, 32, 33]
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_logits, chunk.num_drafts) == (7, 4, 4, 3)
    assert chunk.block_ids == (0, 1, 2)  # positions 7..10 reach the third block of 4
    s.update(out, [[31, 40]])  # draft 31 accepted, 32 rejected in favour of 40
    assert r.token_ids[7:] == [30, 31, 40] and r.num_computed_tokens == 9 and r.spec_token_ids == []
    assert (r.metrics.num_draft_tokens, r.metrics.num_accepted_draft_tokens) == (3, 1)


def test_drafts_shrink_to_the_token_budget_and_stop_at_a_stop_token():
    s = make_scheduler(max_num_tokens=3)
    r = Request("a", [1, 2], SamplingParams(max_tokens=20, stop_token_ids=[9]))
    s.add_request(r)
    s.update(s.schedule(), [[5]])
    r.spec_token_ids = [6, 9, 7, 8]
    out = s.schedule()
    assert (out.chunks[0].num_tokens, out.chunks[0].num_drafts) == (3, 2) and r.spec_token_ids == [6, 9]
    s.update(out, [[6, 9, 4]])  # both accepted, but the second is a stop token: the bonus token is dropped
    assert r.finished and r.output_ids == [5, 6, 9] and not s.kv.blocks


def run(engine, prompts, params, k: int | None, **options):
    spec = SpeculativeConfig(k) if k else None
    core = EngineCore(engine, RuntimeConfig(num_threads=1, speculative=spec, **options))
    tokens, finals, stats = drive(core, prompts, params)
    assert_pool_full(core)
    return tokens, finals, stats


@pytest.mark.parametrize("k, max_steps", [(1, 0.8), (4, 0.6)])
def test_greedy_tokens_equal_plain_decoding_in_fewer_steps(stories_engine, k, max_steps):
    """The tiny story model repeats itself after these prompts, so prompt lookup drafts are often right."""
    prompts = ["Tom had a big red ball. Tom had a big red ball. Tom", 'Mom said, "Yes, yes, yes', "Lily and Ben"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (80, 50, 1)]
    plain, _, plain_stats = run(stories_engine, prompts, params, None)
    spec, finals, spec_stats = run(stories_engine, prompts, params, k)
    assert spec == plain and [len(t) for t in spec] == [80, 50, 1]
    drafted = sum(f.metrics.num_draft_tokens for f in finals)
    accepted = sum(f.metrics.num_accepted_draft_tokens for f in finals)
    assert 0 < accepted <= drafted and finals[2].metrics.num_draft_tokens == 0
    assert len(plain_stats) == 80 and len(spec_stats) <= max_steps * len(plain_stats)


def test_spec_decoding_under_preemption_and_stop_strings(llama_engine, stories_engine):
    prompts = [np.random.default_rng(n).integers(3, 320, size=n).tolist() for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _, _ = run(llama_engine, prompts, params, None)
    spec, _, _ = run(llama_engine, prompts, params, 3, kv_cache_blocks=10)  # preempts: 3 x ~6 blocks in 10
    assert spec == plain
    stop = SamplingParams(max_tokens=60, stop=["Lily"], ignore_eos=True)
    (plain_tokens,), (plain_final,), _ = run(stories_engine, ["Once upon a time, Lily"], stop, None)
    (spec_tokens,), (spec_final,), _ = run(stories_engine, ["Once upon a time, Lily"], stop, 4)
    assert spec_tokens == plain_tokens and spec_final.finish_reason == plain_final.finish_reason == "stop"
    assert spec_final.num_output_tokens == len(spec_tokens)


def test_seeded_sampling_with_drafts_is_reproducible_alone_and_batched(stories_engine):
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    (alone,), _, _ = run(stories_engine, ["Once upon a time"], params, 3)
    batched, _, _ = run(stories_engine, ["Lily and Ben", "Once upon a time"],
                        [SamplingParams(max_tokens=30, temperature=1.0, seed=1), params], 3)
    assert batched[1] == alone and len(alone) == 40
