"""Sliding windows (Mistral, Phi-3): an engine longer than its model's window applies it in the attention, and what
cannot apply it (the tensorrt target) says so. Logits against transformers are in test_hf_parity.py (mistral_window,
phi3), the native op in test_cpu_ops.py, the lowering in test_paged_attention.py, the Triton kernel in
test_kernels_attention.py, the CUDA plan in test_cuda_target.py."""

from __future__ import annotations

import onnx
import pytest

from trtbuild.builder.build import build_engine, default_build_config
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.tensorrt.plan import check_tensorrt_buildable
from trtbuild.configs import ModelConfig
from trtbuild.errors import ConfigError
from trtbuild.plugins import paged_attention as pa
from trtbuild.runtime.kv_cache_manager import NO_PREFIX, RELEASED


@pytest.fixture(scope="module")
def checkpoint(random_hf_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("window") / "ckpt"
    convert(random_hf_model("mistral_window"), out)  # window 6, max_position_embeddings 256
    return out


def _windows(engine) -> set[int]:
    model = onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False)
    return {next((a.i for a in n.attribute if a.name == "window"), 0) for n in model.graph.node
            if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE}


def test_the_window_is_applied_only_where_a_sequence_can_outgrow_it(checkpoint, tmp_path):
    assert _windows(build_engine(checkpoint, tmp_path / "long", max_seq_len=64, tokens_per_block=4)) == {6}
    assert _windows(build_engine(checkpoint, tmp_path / "short", max_seq_len=6, tokens_per_block=4)) == {0}


def test_the_standard_op_lowering_applies_the_window_as_the_native_op(checkpoint, tmp_path):
    """--attention split (ONNX Runtime's own ops, where the native library cannot be built) gives the native op's
    logits on steps past the window: a 9-token prefill, then decode tokens beside a continuing chunk."""
    import numpy as np

    from trtbuild.runtime.engine import CpuEngine, SequenceChunk

    engines = [CpuEngine(build_engine(checkpoint, tmp_path / a, max_seq_len=64, tokens_per_block=4, attention=a),
                         num_threads=1, num_blocks=16) for a in ("native", "split")]
    steps = [[SequenceChunk(0, list(range(3, 12)), 0, 9, [0, 1, 2])],
             [SequenceChunk(0, [20], 9, 1, [0, 1, 2]), SequenceChunk(1, list(range(30, 38)), 0, 8, [3, 4])],
             [SequenceChunk(0, [21], 10, 1, [0, 1, 2]), SequenceChunk(1, [40, 41, 42], 8, 3, [3, 4, 5])]]
    for chunks in steps:
        native, split = (e.step(chunks) for e in engines)
        np.testing.assert_allclose(split, native, rtol=1e-5, atol=1e-5 * np.abs(native).max())


def test_the_tensorrt_target_refuses_a_window_and_stays_within_it_by_default(checkpoint):
    config = ModelConfig.load(checkpoint / "config.json")
    long = default_build_config(config, max_seq_len=64)
    with pytest.raises(ConfigError, match="tensorrt plugins do not apply yet; pass 6 or less"):
        check_tensorrt_buildable(config, long)
    assert default_build_config(config).max_seq_len == 256
    assert default_build_config(config, target="tensorrt").max_seq_len == 6
    assert default_build_config(config, target="tensorrt", max_seq_len=32).max_seq_len == 32  # asked for: kept


# ---- blocks outside the window go back to the pool (every layer windowed) ----------------------------------------
def test_blocks_before_the_next_querys_window_are_released_and_stay_revivable():
    """Window 6, blocks of 4: with 13 tokens computed, the next query (position 13) sees keys 8..13, so blocks 0 and
    1 (positions 0..7) go back to the pool, still cached; the engine is given block 0 in their places."""
    from trtbuild.runtime.kv_cache_manager import RELEASED, KVCacheManager
    from trtbuild.runtime.request import Request
    from trtbuild.runtime.sampling import SamplingParams

    kv = KVCacheManager(8, 4, enable_prefix_caching=True, windows=(6,))
    r = Request("a", list(range(100, 113)), SamplingParams())
    assert kv.allocate(r, 16)
    r.num_computed_tokens = 13
    kv.cache_full_blocks(r)
    kv.release_outside_window(r)
    assert kv.blocks["a"] == [[RELEASED, RELEASED, 2, 3]] and kv.block_table(r) == [0, 0, 2, 3]
    assert kv.pool.num_free == 6 and kv.pool.lookup(r.block_hashes[0]) == 0  # back in the pool, still cached
    kv.release_outside_window(r)  # idempotent
    assert kv.pool.num_free == 6
    twin = Request("b", list(range(100, 113)), SamplingParams())
    # a later request with the same prefix revives those its first query (position 12, keys 7..12) reads
    assert kv.computed_prefix(twin).tables == ((RELEASED, 1, 2),)
    kv.free(r)
    assert kv.pool.num_free == 8 and not kv.blocks


def _record_held(core) -> list[tuple[int, ...]]:
    """Per request and step, the blocks each KV cache group holds (released entries not counted)."""
    from trtbuild.runtime.kv_cache_manager import RELEASED

    held, step = [], core.scheduler.update

    def recording(output, sampled):
        out = step(output, sampled)
        held.extend(tuple(sum(b != RELEASED for b in t) for t in tables) for tables in core.kv.blocks.values())
        return out

    core.scheduler.update = recording
    return held


def test_an_engine_windowed_in_every_layer_holds_about_a_window_of_blocks(random_hf_model, engine_from_hf):
    """Mistral (window 6, every layer): a 100-token sequence keeps at most ceil(6 / 8) + 1 blocks besides released
    ones, and decodes what an engine that keeps every block decodes."""
    from conftest import RUNTIME_ENGINE_OPTIONS
    from helpers import assert_pool_full, drive

    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams

    engine = engine_from_hf(random_hf_model("mistral_window"), **RUNTIME_ENGINE_OPTIONS)
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=64, ignore_eos=True)
    core = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    assert core.kv.windows == (6,)
    held = _record_held(core)
    tokens = drive(core, [prompt], params)[0]
    assert_pool_full(core)
    assert max(n for (n,) in held) <= 2 and len(held) > 60
    keep_all = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    keep_all.kv.windows = (None,)
    assert drive(keep_all, [prompt], params)[0] == tokens


@pytest.mark.parametrize("family, windows", [("gemma3", (None, 6, 6, 6)), ("gemma2", (None, 6, 6)),
                                             ("olmo3", (None, 6, 6, 6))])
def test_sliding_layers_of_a_hybrid_model_hold_a_window_of_blocks(random_hf_model, engine_from_hf, family, windows):
    """Gemma 3 (layer 2 of 4 full), Gemma 2 (every 2nd of 3), OLMo 3 (every 4th of 4): a KV cache group per full and
    per sliding layer (groups of min(#full, #sliding) = 1 layer, blocks of 1 slot). Over a 100-token sequence, the
    full group keeps every block, each sliding group at most 2 beside released ones, and the tokens are those of the
    same engine keeping every block of every group; prefix reuse then revives only blocks inside the windows."""
    from conftest import RUNTIME_ENGINE_OPTIONS
    from helpers import assert_pool_full, drive

    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams

    engine = engine_from_hf(random_hf_model(family), **RUNTIME_ENGINE_OPTIONS)
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=64, ignore_eos=True)
    core = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    assert core.kv.windows == windows and core.engine.kv.pool.shape[1] == 1
    held = _record_held(core)
    tokens = drive(core, [prompt], params)[0]
    assert_pool_full(core)
    assert [max(h[g] for h in held) for g in range(len(windows))] == [13] + [2] * (len(windows) - 1)
    keep_all = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    keep_all.kv.windows = (None,) * len(windows)
    assert drive(keep_all, [prompt], params)[0] == tokens
    # the same prompt again: its first 4 blocks (32 of 37 tokens) come from the cache: all 4 of the full group, and
    # of each sliding group only block 3, which the first query after them (position 32, keys 27..32) reads
    taken = []
    allocate = core.kv.allocate
    core.kv.allocate = lambda r, n, prefix=NO_PREFIX: taken.append(prefix) or allocate(r, n, prefix)
    again, finals, _ = drive(core, [prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert again[0] == tokens[0][:4] and finals[0].metrics.num_prefix_cached_tokens == 32
    assert [[b != RELEASED for b in t] for t in taken[0].tables] == [[True] * 4] + [[False] * 3 + [True]] * (
        len(windows) - 1)


def test_tools_that_lay_out_their_own_blocks_run_hybrid_engines(random_hf_model, tmp_path):
    """verify, eval (perplexity) and the autotuner give every KV cache group its own blocks (in_every_group): on a
    Gemma 3 engine of 4 groups each ran into "has 1 block tables" before."""
    from trtbuild.bench.autotune import time_graph
    from trtbuild.bench.perplexity import evaluate
    from trtbuild.bench.verify import verify_engine
    from trtbuild.builder.engine_dir import read_engine_config

    convert(random_hf_model("gemma3"), tmp_path / "ckpt")
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", timer=time_graph, max_seq_len=64, max_batch_size=2,
                          max_num_tokens=64, autotune="fast")
    info = read_engine_config(engine)
    assert len(info.kv_cache_groups) == 4 and "attention" in info.tactics  # the autotuner timed its candidates
    report = verify_engine(engine, tmp_path / "ckpt", num_threads=1)
    assert report.passed, report.table()
    result = evaluate(engine, [(7 * i + 3) % 300 + 5 for i in range(150)], max_seq_len=64, num_threads=1)
    assert result.num_windows == 5 and result.num_tokens == 149 and result.perplexity > 1
