"""Beam search (SamplingParams.beam_width, runtime/beam_search.py): the answers and scores of Hugging Face's
generate(num_beams=k) on stories260K, ending tokens and length penalties included; forks sharing KV blocks (exact
ids); beams batched with other requests, preempted, aborted; what cannot be combined with beams."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import STORIES260K, require_shared_models

from trtbuild.errors import ConfigError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.kv_cache import KVCacheStorage
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.scheduler import Scheduler

PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def hf():
    require_shared_models()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32).eval()


def hf_beams(hf, ids: list[int], k: int, max_new_tokens: int, length_penalty: float, eos: list[int] | None):
    """(output tokens up to and with the first ending token, score) of HF's k answers, best first."""
    hf.generation_config.eos_token_id = eos
    out = hf.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, do_sample=False,
                      max_new_tokens=max_new_tokens, length_penalty=length_penalty, output_scores=True,
                      return_dict_in_generate=True)
    answers = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = seq[len(ids):]
        ends = [i for i, t in enumerate(gen) if t in (eos or [])]
        answers.append((tuple(gen[: ends[0] + 1] if ends else gen), score))
    return answers


@pytest.mark.parametrize(("k", "length_penalty", "stop_at_dot"), [(4, 1.0, False), (4, 1.0, True), (3, 2.0, True),
                                                                  (2, 0.0, True)])
def test_beams_equal_hugging_face_generate_num_beams(stories_engine, hf, k, length_penalty, stop_at_dot):
    """Without an ending token every beam runs to max_tokens; with "." as a stop token (HF: a second EOS id) beams
    end at different lengths and the length penalty decides their order."""
    llm = LLM(stories_engine, RuntimeConfig(warm_up=False))
    ids = llm.core.tokenizer.encode(PROMPT)
    dot = llm.core.tokenizer.encode(".", add_special_tokens=False)[-1]
    params = SamplingParams(beam_width=k, max_tokens=30 if stop_at_dot else 12, length_penalty=length_penalty,
                            stop_token_ids=[dot] if stop_at_dot else [], ignore_eos=not stop_at_dot)
    (done,) = llm.generate([ids], params)
    want = hf_beams(hf, ids, k, params.max_tokens, length_penalty, [2, dot] if stop_at_dot else None)
    assert [b.token_ids for b in done.beams] == [t for t, _ in want]
    assert [b.score for b in done.beams] == pytest.approx([s for _, s in want], abs=1e-4)
    assert done.token_ids == list(done.beams[0].token_ids) and done.text == done.beams[0].text
    if stop_at_dot:
        assert {b.finish_reason.value for b in done.beams} == {"stop"} and not any("." in b.text for b in done.beams)
    assert llm.core.kv.pool.num_free == llm.core.kv.pool.num_blocks  # every beam's blocks came back


def test_a_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = Request("p", list(range(10, 20)), SamplingParams(beam_width=2))
    assert kv.allocate(parent, 10)
    parent.num_computed_tokens = 10  # 2 full blocks + 2 tokens
    child = Request("c", list(parent.token_ids), parent.sampling)
    assert kv.fork(parent, child) == [(2, 3)]
    assert kv.block_table(parent) == [0, 1, 2] and kv.block_table(child) == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free(parent)
    assert kv.pool.ref_counts[:4] == [1, 1, 0, 1]
    storage = KVCacheStorage(num_layers=2, num_kv_heads=1, head_size=4, tokens_per_block=4, num_blocks=8)
    storage.pool[2] = np.arange(storage.pool[2].size).reshape(storage.pool[2].shape)
    storage.copy_blocks([(2, 3)])
    assert np.array_equal(storage.pool[3], storage.pool[2]) and not storage.pool[4].any()
    full = Request("f", list(range(8)), parent.sampling)
    assert kv.allocate(full, 8)
    full.num_computed_tokens = 8
    assert kv.fork(full, Request("g", list(range(8)), parent.sampling)) == []  # nothing partial: all shared


def test_beams_in_a_batch_with_other_requests_and_through_preemption(stories_engine, monkeypatch):
    prompts = [PROMPT, "Tom had a big red ball", "The sun was hot"]
    params = [SamplingParams(beam_width=3, max_tokens=20), SamplingParams(max_tokens=20),
              SamplingParams(beam_width=2, max_tokens=16, length_penalty=0.5)]
    llm = LLM(stories_engine, RuntimeConfig(warm_up=False))
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    together = llm.generate(prompts, params)
    # a pool of 10 blocks of 8 tokens cannot hold 6 beams of ~35 tokens: beams are preempted and recomputed
    squeezed = LLM(stories_engine, RuntimeConfig(kv_cache_blocks=10, warm_up=False))
    idle = []  # beams waiting for their group's others, preempted to let a waiting beam in
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, r, last=False: (idle.append(last), preempt(self, r, last)))
    preempted = squeezed.generate(prompts, params)
    assert len(idle) > sum(idle) > 0
    tight = squeezed.core
    for results in (together, preempted):
        assert [c.token_ids for c in results] == [c.token_ids for c in alone]
        assert [[b.token_ids for b in c.beams or []] for c in results] == [[b.token_ids for b in c.beams or []]
                                                                          for c in alone]
    assert tight.kv.pool.num_free == tight.kv.pool.num_blocks


def test_aborting_a_beam_search_frees_every_beam(stories_engine):
    core = EngineCore(stories_engine, RuntimeConfig(warm_up=False))
    request = core.make_request(PROMPT, SamplingParams(beam_width=4, max_tokens=50, ignore_eos=True))
    core.add_request(request)
    for _ in range(5):
        assert core.step() == []  # a beam search answers once, at its end
    assert len(core.scheduler.running) == 4
    out = core.abort_request(request.request_id)
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert not core.scheduler.running and core.kv.pool.num_free == core.kv.pool.num_blocks
    assert not core.beam_groups and not core.scheduler.beam_slots


def test_what_beam_search_refuses(stories_engine):
    for field, value in [("temperature", 0.7), ("top_p", 0.9), ("seed", 1), ("stop", "."), ("logprobs", 1)]:
        with pytest.raises(ConfigError, match=f"{field} cannot be set with beam_width 2"):
            SamplingParams(beam_width=2, **{field: value})
    with pytest.raises(ConfigError, match=r"beam_width must be an integer in \[1, 32\]"):
        SamplingParams(beam_width=0)
    core = EngineCore(stories_engine, RuntimeConfig(max_batch_size=4, warm_up=False))
    with pytest.raises(ValueError, match="beam_width 5 is more than the engine runs at once"):
        core.make_request(PROMPT, SamplingParams(beam_width=5))
