"""Draft-target speculative decoding (runtime/draft_model.py) on real engines: greedy tokens equal plain decoding in
mixed batches, under preemption and with prefix reuse; a model drafting for itself is always right; both KV pools are
consistent and free at the end; mismatched tokenizers are refused; `convert --num-layers` makes the draft."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import RUNTIME_ENGINE_OPTIONS
from helpers import STORIES260K, assert_pool_full, drive, require_shared_models

from trtbuild.builder.build import build_engine
from trtbuild.cli import main
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.draft_model import DraftModelProposer, adaptive_num_drafts
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.speculative import SpeculativeConfig

PROMPTS = ["Tom had a big red ball. Tom had a big red ball. Tom", 'Mom said, "Yes, yes, yes', "Lily and Ben",
           "Once upon a time, there was a little dog"]


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory):
    """stories260K cut to 2 of its 5 layers by `trtbuild convert --num-layers` (from its GGUF), built with other
    limits than the target (smaller blocks, batches and steps) so the draft packs and splits its own calls."""
    require_shared_models()
    work = tmp_path_factory.mktemp("draft")
    result = CliRunner().invoke(main, ["convert", "--model", str(STORIES260K / "stories260K-f32.gguf"),
                                       "--output", str(work / "ckpt"), "--num-layers", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads((work / "ckpt" / "config.json").read_text())["num_hidden_layers"] == 2
    return build_engine(work / "ckpt", work / "engine", max_batch_size=3, max_num_tokens=40, max_seq_len=256,
                        tokens_per_block=4)


def draft_config(draft_dir, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(k, method="draft_model", draft_engine_dir=str(draft_dir))


def run(engine, prompts, params, spec: SpeculativeConfig | None, **options):
    core = EngineCore(engine, RuntimeConfig(num_threads=1, speculative=spec, **options))
    tokens, finals, stats = drive(core, prompts, params)
    assert_pool_full(core)
    if isinstance(core.proposer, DraftModelProposer):  # the draft's pool is free too, every block
        pool = core.proposer.kv.pool
        assert pool.num_free == pool.num_blocks and not core.proposer.kv.blocks and not core.proposer.seqs
    return tokens, finals, stats, core


def test_adaptive_rule():
    assert [adaptive_num_drafts(4, a) for a in (1.0, 0.76, 0.5, 0.37, 0.2, 0.12, 0.0)] == [4, 4, 3, 2, 2, 1, 1]
    assert adaptive_num_drafts(1, 0.0) == 1


def test_greedy_tokens_equal_plain_decoding_in_a_mixed_batch(stories_engine, draft_engine):
    """Requests with drafts beside one that never drafts (max_tokens 1) and one whose room ends drafting early."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (60, 40, 1, 3)]
    plain, _, plain_stats, _ = run(stories_engine, PROMPTS, params, None)
    spec, finals, spec_stats, core = run(stories_engine, PROMPTS, params, draft_config(draft_engine))
    assert spec == plain and [len(t) for t in spec] == [60, 40, 1, 3]
    drafted = sum(f.metrics.num_draft_tokens for f in finals)
    accepted = sum(f.metrics.num_accepted_draft_tokens for f in finals)
    assert 0 < accepted < drafted and finals[2].metrics.num_draft_tokens == 0
    assert len(spec_stats) < len(plain_stats) and core.proposer.num_steps > 0
    print(f"2-layer draft: {accepted} of {drafted} accepted, {len(spec_stats)} vs {len(plain_stats)} steps")


def test_a_model_drafting_for_itself_is_always_accepted(stories_engine):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain, _, _, _ = run(stories_engine, PROMPTS[:3], params, None)
    spec, finals, stats, _ = run(stories_engine, PROMPTS[:3], params, draft_config(stories_engine, k=3))
    assert spec == plain
    assert all(f.metrics.num_accepted_draft_tokens == f.metrics.num_draft_tokens > 0 for f in finals)
    assert len(stats) <= 40 // 4 + 2  # 4 tokens a step after the prefill


def test_under_preemption_with_a_tiny_pool(stories_engine, draft_engine):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain, _, _, _ = run(stories_engine, PROMPTS, params, None)
    spec, finals, stats, _ = run(stories_engine, PROMPTS, params, draft_config(draft_engine), kv_cache_blocks=12)
    assert spec == plain and sum(s.num_preempted for s in stats) > 0


def test_prefix_reuse_in_both_pools(stories_engine, draft_engine):
    """The second request shares the first's prompt: the target and the draft both take its blocks from cache."""
    core = EngineCore(stories_engine, RuntimeConfig(num_threads=1, speculative=draft_config(draft_engine)))
    prompt = PROMPTS[0] + " and a small blue boat"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    (first,), _, _ = drive(core, [prompt], params)
    assert core.proposer.num_prefix_cached_tokens == 0
    (second,), (final,), _ = drive(core, [prompt], params)
    assert second == first and final.metrics is not None
    pool = core.proposer.kv.pool
    assert core.proposer.num_prefix_cached_tokens >= 8 and pool.num_free == pool.num_blocks
    plain, _, _, _ = run(stories_engine, [prompt], params, None)
    assert first == plain[0]


def test_rolled_back_drafts_leave_the_draft_cache_as_a_fresh_prefill(stories_engine, draft_engine):
    """Mid-run, every token the draft counts as computed has exactly the K/V a fresh prefill of the draft writes."""
    core = EngineCore(stories_engine, RuntimeConfig(num_threads=1, speculative=draft_config(draft_engine)))
    for prompt in PROMPTS[:3]:
        core.add_request(core.make_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
    fresh = CpuEngine(draft_engine, num_threads=1, num_blocks=64)
    rejected = 0
    for _ in range(12):
        core.step()
        proposer = core.proposer
        for request in core.scheduler.running:
            seq = proposer.seqs.get(request.request_id)
            if seq is None:
                continue
            rejected += request.metrics.num_draft_tokens - request.metrics.num_accepted_draft_tokens
            n, bs = seq.num_computed_tokens, 4
            assert 0 < n <= len(request.token_ids)
            blocks = list(range(-(-n // bs)))
            for start in range(0, n, 40):  # the draft engine's max_num_tokens
                piece = request.token_ids[start : min(start + 40, n)]
                fresh.step([SequenceChunk(0, piece, start, 1, blocks)])
            table = proposer.kv.block_table(seq)
            got = np.stack([proposer.engine.kv.pool[table[p // bs], :, :, :, p % bs] for p in range(n)])
            want = np.stack([fresh.kv.pool[blocks[p // bs], :, :, :, p % bs] for p in range(n)])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert rejected > 0


def test_tokenizers_must_match(stories_engine, llama_engine):
    with pytest.raises(ValueError, match=rf"{llama_engine} cannot draft for {stories_engine}: their tokenizers "
                                         r"differ \(vocab size 320 vs 512"):
        EngineCore(stories_engine, RuntimeConfig(num_threads=1, speculative=draft_config(llama_engine)))


def test_config_needs_the_draft_engine_with_draft_model_only():
    for kwargs in (dict(method="draft_model"), dict(draft_engine_dir="/d")):
        with pytest.raises(ValueError, match="draft_engine_dir is needed by method draft_model and by no other"):
            SpeculativeConfig(2, **kwargs)


def test_convert_num_layers_out_of_range(tmp_path):
    require_shared_models()
    result = CliRunner().invoke(main, ["convert", "--model", str(STORIES260K), "--output", str(tmp_path / "c"),
                                       "--num-layers", "6"])
    assert result.exit_code == 2 and "--num-layers must be between 1 and the model's 5 layers, got 6" in result.output
    assert not (tmp_path / "c" / "config.json").exists()


def test_hf_self_draft_converts_builds_and_runs(random_hf_model, tmp_path):
    """An HF folder cut to 1 layer: the checkpoint has that layer only, and the engine built from it runs."""
    result = CliRunner().invoke(main, ["convert", "--model", str(random_hf_model("qwen3")),
                                       "--output", str(tmp_path / "c"), "--num-layers", "1"])
    assert result.exit_code == 0 and "1 layers" in result.output, result.output
    engine = build_engine(tmp_path / "c", tmp_path / "e", max_seq_len=64, tokens_per_block=8,
                          **RUNTIME_ENGINE_OPTIONS)
    (tokens,), _, _, _ = run(engine, [[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), None)
    assert len(tokens) == 4


def test_cli_run_with_a_draft_engine(stories_engine, llama_engine):
    def cli(*args):
        return CliRunner().invoke(main, ["run", "--engine", str(stories_engine), "--prompt", "Once", "--max-tokens",
                                         "12", "--threads", "1", *map(str, args)])

    plain = cli()
    drafted = cli("--speculative-tokens", 3, "--draft-engine", stories_engine)
    assert plain.exit_code == drafted.exit_code == 0 and drafted.output == plain.output
    alone = cli("--draft-engine", stories_engine)
    assert alone.exit_code == 2 and "add --speculative-tokens K" in alone.output
    wrong = cli("--speculative-tokens", 3, "--draft-engine", llama_engine)
    assert wrong.exit_code == 2 and f"Error: --draft-engine {llama_engine} cannot draft for" in wrong.output
