"""SamplingParams.prompt_logprobs: every prompt token's logprob (vLLM's prompt_logprobs), from the engine's logits of
every prompt position: the scheduler's rows (exact counts), Hugging Face's log_softmax on stories260K, chunked
prefill, the prefix cache skipped, batching with other requests, preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import STORIES260K, require_shared_models

from trtbuild.errors import ConfigError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import MAX_LOGPROBS, SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def test_scheduler_asks_a_row_for_every_prompt_position_but_the_last_in_every_chunk():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_tokens=8, max_batch_size=4, max_seq_len=64, max_prefill_chunk=4), kv)
    scored = Request("s", list(range(10, 20)), SamplingParams(max_tokens=3, prompt_logprobs=0))
    plain = Request("p", list(range(10, 20)), SamplingParams(max_tokens=3))
    s.add_request(scored)
    s.add_request(plain)
    rows = []
    for _ in range(3):
        out = s.schedule()
        rows.append([(c.request.request_id, c.start, c.num_tokens, c.num_logits, c.num_prompt_logits, c.samples)
                     for c in out.chunks])
        s.update(out, [[5] for c in out.chunks if c.samples])
    assert rows == [[("s", 0, 4, 4, 4, False), ("p", 0, 4, 0, 0, False)],
                    [("s", 4, 4, 4, 4, False), ("p", 4, 4, 0, 0, False)],
                    # the prompt's last position samples: 1 prompt row (scores token 9) + 1 row to sample from
                    [("s", 8, 2, 2, 1, True), ("p", 8, 2, 1, 0, True)]]
    out = s.schedule()  # decoding: the prompt was scored, so one row each
    assert [(c.num_logits, c.num_prompt_logits) for c in out.chunks] == [(1, 0), (1, 0)]


def test_a_request_scoring_its_prompt_does_not_read_the_prefix_cache_but_one_after_its_first_token_does():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_tokens=32, max_batch_size=4, max_seq_len=64), kv)
    first = Request("a", list(range(10, 19)), SamplingParams(max_tokens=2))
    s.add_request(first)
    s.update(s.schedule(), [[5]])
    s.finish_requests([first], first.finish_reason)  # its 2 full blocks stay cached
    scored = Request("b", list(range(10, 19)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    s.add_request(scored)
    (chunk,) = s.schedule().chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_prompt_logits) == (0, 9, 8)
    assert scored.metrics.num_prefix_cached_tokens == 0
    assert Scheduler.scores_prompt(scored)
    scored.token_ids.append(7)  # once it has output, a recomputation (preemption) may reuse cached blocks
    assert not Scheduler.scores_prompt(scored)


def test_prompt_logprobs_is_checked_like_logprobs():
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1, 1.5):
        with pytest.raises(ConfigError, match=r"prompt_logprobs must be None or an integer in \[0, 20\]"):
            SamplingParams(prompt_logprobs=bad)


@pytest.fixture(scope="module")
def hf_logprobs():
    """prompt ids -> Hugging Face's log_softmax [len, vocab] of stories260K (float64)."""
    require_shared_models()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32).eval()

    def get(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, -1).numpy()

    return get


def _check_against_hf(prompt_ids, scores, want, k):
    assert scores[0] is None and len(scores) == len(prompt_ids)
    for p in range(1, len(prompt_ids)):
        lp, row = scores[p], want[p - 1]  # the logits at position p - 1 predict token p
        assert lp.token_id == prompt_ids[p]
        assert lp.logprob == pytest.approx(row[prompt_ids[p]], abs=2e-4)
        assert lp.rank == int((row > row[prompt_ids[p]] + 1e-6).sum()) + 1
        assert [t for t, _ in lp.top] == list(np.argsort(-row, kind="stable")[:k])
        assert [v for _, v in lp.top] == pytest.approx(np.sort(row)[::-1][:k], abs=2e-4)


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_hugging_face_whole_or_in_chunks(stories_engine, hf_logprobs, chunk):
    llm = LLM(stories_engine, RuntimeConfig(max_prefill_chunk=chunk, warm_up=False))
    prompt_ids = llm.core.tokenizer.encode(PROMPT)
    (done,) = llm.generate([prompt_ids], SamplingParams(max_tokens=4, prompt_logprobs=3, logprobs=0))
    _check_against_hf(prompt_ids, done.prompt_logprobs, hf_logprobs(prompt_ids), 3)
    # the sampled tokens and their logprobs are what a request without prompt_logprobs gets (it reads the cached
    # prompt blocks, so its last position runs in another batch shape: float32 rounding)
    (plain,) = llm.generate([prompt_ids], SamplingParams(max_tokens=4, logprobs=0))
    assert done.token_ids == plain.token_ids and plain.prompt_logprobs is None
    assert [lp.logprob for lp in done.logprobs] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-5)


def test_prompt_logprobs_in_a_batch_with_decoding_requests_and_after_a_cached_prefix(stories_engine, hf_logprobs):
    llm = LLM(stories_engine, RuntimeConfig(warm_up=False))
    ids = llm.core.tokenizer.encode(PROMPT)
    other = llm.core.tokenizer.encode("The dog ran to the park")
    alone = llm.generate([other, ids], SamplingParams(max_tokens=6))
    # the same prompt again: its blocks are cached, yet a scoring request computes (and scores) every position
    params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, prompt_logprobs=0)]
    outputs = list(llm.stream([other, ids], params))
    together = llm.generate([other, ids], params)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    _check_against_hf(ids, together[1].prompt_logprobs, hf_logprobs(ids), 0)
    first = [o for i, o in outputs if i == 1 and o.new_token_ids][0]
    assert first.prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for i, o in outputs if o is not first)


def test_a_request_preempted_during_its_prompt_still_scores_each_prompt_token_once(stories_engine, hf_logprobs):
    """A pool of 6 blocks of 8 tokens: two 20-token prompts in chunks of 8; the second is preempted to let the first
    grow, then recomputed from its first token."""
    core = EngineCore(stories_engine, RuntimeConfig(kv_cache_blocks=6, max_prefill_chunk=8, warm_up=False))
    ids = core.tokenizer.encode(PROMPT)[:20]
    a = core.make_request(ids, SamplingParams(max_tokens=20, prompt_logprobs=1, ignore_eos=True))
    b = core.make_request(ids[::-1], SamplingParams(max_tokens=20, prompt_logprobs=1, ignore_eos=True))
    core.add_request(a)
    core.add_request(b)
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert a.metrics.num_preemptions + b.metrics.num_preemptions >= 1
    for request in (a, b):
        (first,) = [o for o in outputs if o.request_id == request.request_id and o.prompt_logprobs is not None]
        _check_against_hf(request.prompt_ids, first.prompt_logprobs, hf_logprobs(request.prompt_ids), 1)
