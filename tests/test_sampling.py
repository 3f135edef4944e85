"""Sampling: parameter validation, greedy = argmax, seeded draws independent of the batch, exact distributions of
temperature / top-k / top-p / min-p, penalty formulas, min_tokens / ignore_eos / bad words masking, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import STORIES260K, require_shared_models

from trtbuild.runtime.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    SamplingState,
    process_logits,
    sampling_distribution,
)

EOS = 2


def state(prompt=(5, 6), eos=(EOS,), output=(), **params) -> SamplingState:
    s = SamplingState(SamplingParams(**params), list(prompt), eos)
    for t in output:
        s.append(t)
    return s


def greedy_token(logits_row, s: SamplingState) -> int:
    return int(Sampler().sample(np.asarray([logits_row], dtype=np.float32), [s]).token_ids[0])


# ---- validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.5, "temperature must be a number >= 0 (0 is greedy), got -0.5"),
    ("temperature", float("inf"), "temperature must be"),
    ("top_k", -1, "top_k must be an integer >= 0 (0 is off), got -1"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("top_p", 0, "top_p must be in (0, 1], got 0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", 1.01, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0, "repetition_penalty must be a number > 0 (1 is off), got 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2], got -3"),
    ("seed", -1, "seed must be None or an integer >= 0, got -1"),
    ("seed", "7", "seed must be None or an integer >= 0"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1, got 0"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0, got -1"),
    ("min_tokens", 65, "min_tokens must be <= max_tokens (64), got 65"),
    ("stop", ("ok", ""), "stop must be non-empty strings"),
    ("stop", 5, "stop must be non-empty strings, got 5"),
    ("stop_token_ids", (3, -1), "stop_token_ids must be token ids >= 0, got (3, -1)"),
    ("bad_words", ("",), "bad_words must be non-empty strings"),
    ("bad_words_ids", ((1, 2), ()), "bad_words_ids must be non-empty sequences of token ids >= 0"),
    ("bad_words_ids", ("ab",), "bad_words_ids must be non-empty sequences"),
    ("ignore_eos", 1, "ignore_eos must be a bool, got 1"),
    ("logprobs", -1, f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got -1"),
    ("logprobs", MAX_LOGPROBS + 1, "logprobs must be None or an integer"),
    ("include_stop_str_in_output", "yes", "include_stop_str_in_output must be a bool"),
])
def test_invalid_params_name_the_field(field, value, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message)
    assert str(e.value).startswith(field)


def test_params_defaults_and_sequences_become_tuples():
    p = SamplingParams()
    assert p.greedy and p.max_tokens == 64 and p.logprobs is None and not p.include_stop_str_in_output
    p = SamplingParams(stop="###", stop_token_ids=[7, 8], bad_words=["a", "b"], bad_words_ids=[[1, 2], [3]],
                       seed=np.int64(3), temperature=np.float32(0.5))
    assert p.stop == ("###",) and p.stop_token_ids == (7, 8) and p.bad_words == ("a", "b")
    assert p.bad_words_ids == ((1, 2), (3,))
    hash(p)  # frozen and hashable
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # keyword-only: a positional value cannot land in the wrong field


def test_state_checks_ids_against_the_vocabulary():
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingState(SamplingParams(stop_token_ids=(100,)), [1], vocab_size=100)
    with pytest.raises(ValueError, match="^bad_words_ids"):
        SamplingState(SamplingParams(bad_words_ids=((3, 200),)), [1], vocab_size=100)
    with pytest.raises(ValueError, match="^bad_words"):
        SamplingState(SamplingParams(bad_words=("dog",)), [1])  # strings need a tokenizer
    with pytest.raises(ValueError, match="token_ids must start with prompt_ids"):
        SamplingState(SamplingParams(), [1, 2], token_ids=[1, 3])


# ---- greedy ----------------------------------------------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    logits[1, [7, 3, 40]] = 9.0  # a three-way tie for the maximum
    logits[4, :] = 0.0  # all tied
    out = Sampler().sample(logits, [state() for _ in range(6)])
    assert out.token_ids.dtype == np.int64 and out.token_ids.shape == (6,)
    assert out.token_ids.tolist() == np.argmax(logits, axis=1).tolist()
    assert out.token_ids[1] == 3 and out.token_ids[4] == 0


def test_a_greedy_batch_that_changes_no_logits_skips_processing_and_one_that_does_not():
    logits = np.random.default_rng(1).standard_normal((3, 50)).astype(np.float32)
    plain = [state() for _ in range(3)]
    assert not any(s.changes_logits() for s in plain)
    assert Sampler().sample(logits, plain).token_ids.tolist() == np.argmax(logits, axis=1).tolist()
    top = int(np.argmax(logits[1]))
    for changed in (state(logit_bias={top: -100.0}), state(bad_words_ids=[[top]]), state(repetition_penalty=1.5),
                    state(min_tokens=2, output=())):
        assert changed.changes_logits()
    biased = [plain[0], state(logit_bias={top: -100.0}), plain[2]]  # one row changes: the batch is processed
    tokens = Sampler().sample(logits, biased).token_ids
    assert tokens[1] != top and tokens[[0, 2]].tolist() == np.argmax(logits[[0, 2]], axis=1).tolist()


def test_sample_leaves_logits_and_state_tokens_alone():
    logits = np.random.default_rng(1).standard_normal((2, 30)).astype(np.float32)
    before = logits.copy()
    states = [state(repetition_penalty=2.0, frequency_penalty=1.0, bad_words_ids=((4,),)), state(temperature=1.0)]
    Sampler().sample(logits, states)
    assert np.array_equal(logits, before)
    assert [s.output_ids for s in states] == [[], []]


# ---- seeded sampling -------------------------------------------------------------------------------------------

def run_steps(target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 50) -> list[int]:
    """Sample `steps` tokens for `target` at row `position` of a batch with `others`; return the target's tokens."""
    vocab = 64
    target_logits = np.random.default_rng(1234)  # the target sees the same logits in every run
    noise = np.random.default_rng(position)  # the other rows differ between runs
    states = [state(prompt=(1, 2, 3), **vars(p)) for p in others]
    states.insert(position, SamplingState(target, [1, 2, 3], (EOS,)))
    sampler, out = Sampler(), []
    for _ in range(steps):
        logits = noise.standard_normal((len(states), vocab)).astype(np.float32) * 3
        logits[position] = target_logits.standard_normal(vocab).astype(np.float32) * 3
        tokens = sampler.sample(logits, states).token_ids
        for s, t in zip(states, tokens, strict=True):
            s.append(t)
        out.append(int(tokens[position]))
    return out


def test_seeded_request_draws_the_same_alone_and_in_any_batch():
    target = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                            frequency_penalty=0.3, seed=42)
    others = [SamplingParams(temperature=t, top_p=p, seed=s) for t, p, s in
              ((1.0, 1.0, 1), (0.0, 1.0, None), (1.5, 0.5, None), (0.7, 0.9, 42))]
    others += [SamplingParams(temperature=1.0, top_k=5), SamplingParams(), SamplingParams(temperature=2.0, seed=9)]
    alone = run_steps(target, [], 0)
    assert len(set(alone)) > 5  # really sampling
    assert run_steps(target, others, 0) == alone
    assert run_steps(target, others, 5) == alone
    assert run_steps(target, others[::-1], 7) == alone
    assert run_steps(SamplingParams(**{**vars(target), "seed": 43}), [], 0) != alone


# ---- distributions ---------------------------------------------------------------------------------------------

PROBS = np.array([0.35, 0.25, 0.15, 0.10, 0.07, 0.05, 0.02, 0.01])
PERM = np.array([5, 2, 7, 0, 3, 6, 1, 4])  # token PERM[i] has probability PROBS[i]
LOGITS = np.zeros(8, dtype=np.float32)
LOGITS[PERM] = np.log(PROBS)


@pytest.mark.parametrize("params, kept", [
    (dict(temperature=1.0), range(8)),
    (dict(temperature=0.5), range(8)),  # p ~ PROBS ** 2
    (dict(temperature=1.0, top_k=3), range(3)),
    (dict(temperature=1.0, top_p=0.8), range(4)),  # cumulative .35 .60 .75 .85: the 4th reaches 0.8
    (dict(temperature=1.0, top_p=0.5), range(2)),
    (dict(temperature=1.0, top_p=0.2), range(1)),
    (dict(temperature=1.0, min_p=0.25), range(4)),  # p >= 0.25 * 0.35
    (dict(temperature=2.0, top_k=6, top_p=0.7, min_p=0.6), range(3)),  # k: 6; p (renormalized): 4; min-p: 3
])
def test_empirical_distribution_matches_the_renormalized_one(params, kept):
    p = SamplingParams(seed=7, **params)
    kept = PERM[list(kept)]
    weights = np.zeros(8)
    weights[PERM] = PROBS ** (1 / p.temperature)
    expected = np.zeros(8)
    expected[kept] = weights[kept] / weights[kept].sum()
    ids, probs = sampling_distribution(LOGITS, p)
    exact = np.zeros(8)
    exact[ids] = probs
    np.testing.assert_allclose(exact, expected, atol=1e-6)

    n, s, sampler = 20_000, SamplingState(p, [1]), Sampler()
    draws = [int(sampler.sample(LOGITS[None], [s]).token_ids[0]) for _ in range(n)]
    freq = np.bincount(draws, minlength=8) / n
    assert set(np.flatnonzero(freq)) <= set(kept.tolist())  # never an excluded token
    assert np.abs(freq - expected).max() < 0.02, (freq, expected)


def test_top_p_on_a_large_vocabulary_equals_the_full_sort():
    rng = np.random.default_rng(3)
    for scale in (0.5, 2.0, 8.0):  # flat (head too small: full sort) to peaked (head suffices)
        logits = (rng.standard_normal(50_000) * scale).astype(np.float32)
        logits[[10, 20, 30]] = logits.max()  # ties at the top
        p = SamplingParams(temperature=1.0, top_p=0.9)
        ids, probs = sampling_distribution(logits, p)
        full = np.exp(logits.astype(np.float64) - logits.max())
        full /= full.sum()
        order = np.argsort(-full, kind="stable")
        keep = int(np.searchsorted(np.cumsum(full[order]), 0.9)) + 1
        assert ids.tolist() == order[:keep].tolist()
        np.testing.assert_allclose(probs, full[order[:keep]] / full[order[:keep]].sum(), rtol=1e-9)


# ---- penalties -------------------------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = np.array([[2.0, -1.0, 3.0, -4.0, 0.5, 1.0]], dtype=np.float32)
    s = state(prompt=(0, 1), output=(3, 3), repetition_penalty=2.0)
    got = process_logits(logits, [s])[0]
    assert got.tolist() == [1.0, -2.0, 3.0, -8.0, 0.5, 1.0]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = np.array([[2.0, -1.0, 3.0, -4.0, 0.5, 1.0]], dtype=np.float32)
    s = state(prompt=(0, 1, 4), output=(5, 2, 5, 5), frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(logits, [s])[0]
    expected = logits[0].copy()
    expected[5] -= 3 * 0.5 + 0.25
    expected[2] -= 1 * 0.5 + 0.25
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_penalties_per_row_in_a_batch_and_in_order():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 40)).astype(np.float32) * 4
    states = [state(prompt=(1, 7), output=(9, 9, 30), repetition_penalty=1.5, frequency_penalty=-0.5,
                    presence_penalty=1.0),
              state(prompt=(9,), output=(1,)),  # no penalties: untouched
              state(prompt=(2, 3), output=(3, 39), presence_penalty=-2.0)]
    got = process_logits(logits, states)
    want = logits.copy()
    for t in (1, 7, 9, 30):  # repetition first (prompt + output) ...
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    for t, count in ((9, 2), (30, 1)):  # ... then frequency and presence (output only)
        want[0, t] -= -0.5 * count + 1.0
    want[2, [3, 39]] += 2.0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# ---- masking ---------------------------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = np.zeros(10, dtype=np.float32)
    logits[[EOS, 7]] = [5.0, 4.0]  # EOS the favourite, stop token 7 next
    s = state(min_tokens=3, stop_token_ids=(7,))
    picks = []
    for _ in range(4):
        picks.append(greedy_token(logits, s))
        s.append(picks[-1])
    assert picks == [0, 0, 0, EOS]  # neither EOS nor the stop token before 3 outputs


def test_ignore_eos_leaves_eos_an_ordinary_token():
    logits = np.zeros(10, dtype=np.float32)
    logits[EOS] = 5.0
    assert greedy_token(logits, state(min_tokens=3, ignore_eos=True)) == EOS
    assert greedy_token(logits, state(min_tokens=3)) != EOS
    logits[7] = 4.0
    assert greedy_token(logits, state(min_tokens=3, ignore_eos=True, stop_token_ids=(7,))) == EOS


def test_bad_words_single_token_always_and_multi_token_after_its_prefix():
    logits = np.arange(10, dtype=np.float32)  # argmax 9, then 8, then 7
    assert greedy_token(logits, state(bad_words_ids=((9,),))) == 8
    words = ((4, 5, 9), (3, 8))
    assert greedy_token(logits, state(prompt=(1, 2), bad_words_ids=words)) == 9  # no prefix matched
    assert greedy_token(logits, state(prompt=(1, 4), output=(5,), bad_words_ids=words)) == 8  # 4 5 -> ban 9
    assert greedy_token(logits, state(prompt=(4, 5), bad_words_ids=words)) == 8  # prefix within the prompt
    assert greedy_token(logits, state(prompt=(4, 5), output=(3,), bad_words_ids=words)) == 9  # 3 -> ban 8 only
    assert greedy_token(logits, state(prompt=(5, 4), bad_words_ids=words)) == 9  # order matters
    s = state(prompt=(3,), bad_words_ids=((3, 9), (9,)), temperature=1.0, seed=0)
    draws = {int(Sampler().sample(logits[None], [s]).token_ids[0]) for _ in range(300)}
    assert 9 not in draws and len(draws) > 3


def test_bad_words_strings_are_tokenized_without_special_tokens():
    require_shared_models()
    from trtbuild.runtime.tokenizer import Tokenizer

    tok = Tokenizer(STORIES260K)
    s = SamplingState(SamplingParams(bad_words=("little dog", "Lily")), [1], tokenizer=tok, vocab_size=512)
    assert s.bad_words_ids == (tuple(tok.encode("little dog", add_special_tokens=False)),
                               tuple(tok.encode("Lily", add_special_tokens=False)))
    assert all(1 not in w for w in s.bad_words_ids) and len(s.bad_words_ids[0]) > 1
    assert tok.encode("little dog")[0] == 1  # the plain encode does add BOS


# ---- logprobs --------------------------------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_top_n_sorted():
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, 100)).astype(np.float32) * 3
    logits[0, [17, 4]] = logits[0].max() + 1  # a tie at the top: lower id first
    states = [state(logprobs=5, repetition_penalty=3.0, temperature=0.7, seed=1, prompt=(4, 17)),
              state(logprobs=0), state()]
    out = Sampler().sample(logits, states)
    ref = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(ref[0, first.token_id], abs=1e-9)  # raw, not penalized or tempered
    assert [t for t, _ in first.top] == [4, 17] + np.argsort(-ref[0], kind="stable")[2:5].tolist()
    np.testing.assert_allclose([lp for _, lp in first.top], np.sort(ref[0])[::-1][:5], atol=1e-9)
    assert first.rank == 1 + int((ref[0] > ref[0, first.token_id] + 1e-12).sum())
    second = out.logprobs[1]
    assert second.top == () and second.rank == 1 and second.logprob == pytest.approx(ref[1].max(), abs=1e-9)
    assert out.logprobs[2] is None


def test_logit_bias_is_added_after_masks_and_penalties():
    logits = np.zeros((1, 6), dtype=np.float32)
    params = SamplingParams(logit_bias={2: 5.0, 4: -100}, bad_words_ids=[[3]])
    state = SamplingState(params, [1], vocab_size=6)
    out = process_logits(logits, [state])
    assert out[0, 2] == 5.0 and out[0, 4] == -100 and out[0, 3] == -np.inf and out[0, 0] == 0
    assert params.logit_bias == ((2, 5.0), (4, -100))
    with pytest.raises(ValueError, match="logit_bias must be token ids below the vocabulary size 6"):
        SamplingState(SamplingParams(logit_bias={9: 1.0}), [1], vocab_size=6)
