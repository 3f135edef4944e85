"""Engines built with `--speculative-decoding-mode draft-tokens`: drafts verified inside the engine by
SpeculativeAccept give exactly the tokens of plain decoding (greedy) and of Python verification (seeded sampling),
only the rows the runtime still samples leave the engine, and requests the op cannot serve fall back to Python."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import RUNTIME_ENGINE_OPTIONS
from helpers import STORIES260K, assert_pool_full, drive, require_shared_models

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, DraftAccept, SequenceChunk
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.sampling import SamplingParams, SamplingState
from trtbuild.runtime.speculative import SpeculativeConfig, verify

MAX_DRAFT_LEN = 4
PROMPTS = ["Tom had a big red ball. Tom had a big red ball. Tom", 'Mom said, "Yes, yes, yes', "Lily and Ben"]


@pytest.fixture(scope="module")
def accept_engine(engine_from_hf):
    require_shared_models()
    return engine_from_hf(STORIES260K, **RUNTIME_ENGINE_OPTIONS, speculative_decoding_mode="draft-tokens",
                          max_draft_len=MAX_DRAFT_LEN)


def run(engine, prompts, params, k: int | None):
    """Tokens and finals of a run, and how many chunks the engine verified itself / how many logits rows left it."""
    core = EngineCore(engine, RuntimeConfig(num_threads=1, speculative=SpeculativeConfig(k) if k else None))
    counts = {"verified": 0, "rows": 0}
    execute = core.engine.execute

    def counting(chunks):
        out = execute(chunks)
        counts["verified"] += len(out.accepted)
        counts["rows"] += out.logits.shape[0]
        return out

    core.engine.execute = counting
    tokens, finals, _ = drive(core, prompts, params)
    assert_pool_full(core)
    return tokens, finals, counts


def test_config_records_the_mode_and_the_io_spec_its_tensors(accept_engine):
    info = read_engine_config(accept_engine)
    assert (info.build.speculative_decoding_mode, info.build.max_draft_len) == ("draft-tokens", MAX_DRAFT_LEN)
    doc = json.loads((accept_engine / "config.json").read_text())
    inputs = {i["name"]: i for i in doc["io"]["inputs"]}
    outputs = {o["name"]: o for o in doc["io"]["outputs"]}
    assert inputs["draft_tokens"]["shape"] == ["num_accepting", MAX_DRAFT_LEN]
    assert (inputs["uniforms"]["dtype"], inputs["uniforms"]["shape"]) == ("float64", ["num_accepting", 5])
    assert outputs["logits"]["shape"][0] == "num_logits_out" and set(outputs) >= {"num_accepted", "next_tokens"}
    assert "lower_speculative_accept:1" in doc["passes"]


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_tokens_equal_plain_decoding_with_drafts_verified_in_the_engine(stories_engine, accept_engine, k):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 40, 1)]
    plain, _, plain_counts = run(stories_engine, PROMPTS, params, None)
    spec, finals, counts = run(accept_engine, PROMPTS, params, k)
    assert spec == plain
    assert sum(f.metrics.num_accepted_draft_tokens for f in finals) > 0
    assert counts["verified"] > 0 and counts["rows"] < plain_counts["rows"]


def test_drafts_beyond_the_engines_max_draft_len_and_unsupported_sampling_fall_back(stories_engine, accept_engine):
    """More drafts than the engine takes, top-k, and log probs: verified in Python, with the same tokens."""
    params = [SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_k=5, seed=3)]
    plain, plain_finals, _ = run(stories_engine, PROMPTS[:2], params, 3)
    spec, finals, counts = run(accept_engine, PROMPTS[:2], params, 3)
    assert spec == plain and counts["verified"] == 0
    assert finals[0].logprobs == plain_finals[0].logprobs
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    assert run(accept_engine, PROMPTS[:1], greedy, MAX_DRAFT_LEN + 2)[0] == run(stories_engine, PROMPTS[:1], greedy,
                                                                                 None)[0]


def test_seeded_sampling_gives_the_tokens_of_python_verification(stories_engine, accept_engine):
    """The op reads the request's own random stream in verify's order: the same tokens, alone and batched with
    greedy and fallback requests."""
    params = [SamplingParams(max_tokens=50, temperature=t, seed=s, ignore_eos=True) for t, s in ((1.0, 1), (0.7, 2))]
    params.append(SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=4, ignore_eos=True))
    python, _, _ = run(stories_engine, PROMPTS, params, 3)
    engine, finals, counts = run(accept_engine, PROMPTS, params, 3)
    assert engine == python and counts["verified"] > 0
    assert sum(f.metrics.num_accepted_draft_tokens for f in finals[:2]) > 0


def test_a_plain_engine_refuses_to_verify_drafts(stories_engine, accept_engine):
    chunk = SequenceChunk(0, [5, 6, 7], 0, 3, [0], DraftAccept((6, 7), 0.0))
    with pytest.raises(ValueError, match="does not verify drafts"):
        CpuEngine(stories_engine, num_threads=1, num_blocks=4).execute([chunk])
    engine = CpuEngine(accept_engine, num_threads=1, num_blocks=4)
    with pytest.raises(ValueError, match="ends with its drafts"):
        engine.execute([SequenceChunk(0, [5, 6, 7], 0, 3, [0], DraftAccept((6, 8), 0.0))])
    for drafts in ((6, 7), (9, 7)):
        tokens = [5, *drafts]
        verifying = SequenceChunk(0, tokens, 0, 3, [0], DraftAccept(drafts, 0.0))
        out = engine.execute([verifying, SequenceChunk(1, [1, 2], 0, 1, [1])])
        assert out.logits.shape[0] == 1 and set(out.accepted) == {0}  # only the other chunk's row comes out
        rows = engine.execute([SequenceChunk(0, tokens, 0, 3, [0])]).logits
        verified = verify(rows, list(drafts), SamplingState(SamplingParams(), [5]))
        assert out.accepted[0] == (verified.num_accepted, verified.token_ids[-1])


def test_results_are_the_same_when_a_step_runs_as_two_calls(accept_engine, monkeypatch):
    """A long prefill chunk beside a verified decode chunk (split by attention_groups when padding would cost more):
    the same rows and accept results as one call."""
    import trtbuild.runtime.engine as engine_module

    chunks = [SequenceChunk(0, list(range(3, 43)), 0, 1, [0, 1, 2, 3, 4]),
              SequenceChunk(1, [7, 8, 9], 0, 3, [5], DraftAccept((8, 9), 0.7, (0.3, 0.9, 0.1))),
              SequenceChunk(2, [4, 5], 0, 2, [6])]
    engine = CpuEngine(accept_engine, num_threads=1, num_blocks=8)
    one = engine.execute(chunks)
    monkeypatch.setattr(engine_module, "PADDING_SPLIT_PAIRS", 0)
    assert len(engine_module.attention_groups(chunks)) == 2
    two = engine.execute(chunks)
    assert one.accepted == two.accepted and set(one.accepted) == {1} and one.logits.shape[0] == 3
    np.testing.assert_allclose(one.logits, two.logits, rtol=1e-5, atol=1e-5)
