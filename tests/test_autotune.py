"""Build-time autotuning (builder/autotune.py, bench/autotune.py): the tactics compute the same thing, the choice
and its timings land in config.json, the timing cache spares a rebuild the measurements, and the runtime uses the
chosen thread count."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from helpers import F16C, STORIES260K, require_shared_models

from trtbuild.bench.autotune import time_graph
from trtbuild.builder import engine_dir
from trtbuild.builder.autotune import ShapeClass, TimingCache, best, shape_classes
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, read_engine_config
from trtbuild.cli import main
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

LIMITS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    require_shared_models()
    out = tmp_path_factory.mktemp("autotune") / "ckpt"
    convert(STORIES260K, out)
    return out


def steps(engine_dir) -> list[np.ndarray]:
    """Logits of a prefill, a decode on top of it, and a mixed step, in one engine."""
    e = CpuEngine(engine_dir, num_threads=1, num_blocks=16)
    return [e.step([SequenceChunk(0, list(range(1, 20)), 0, 19, [0, 1])]),
            e.step([SequenceChunk(0, [7], 19, 1, [0, 1])]),
            e.step([SequenceChunk(0, [7, 8, 9], 20, 3, [0, 1]), SequenceChunk(1, [3, 4], 0, 2, [5])])]


def test_attention_variants_compute_the_same_attention(checkpoint, tmp_path):
    engines = {v: build_engine(checkpoint, tmp_path / v, attention=v, **LIMITS) for v in ("native", "split", "concat")}
    for v, engine in engines.items():
        assert read_engine_config(engine).build.attention == v
    split, concat, native = (steps(engines[v]) for v in ("split", "concat", "native"))
    for a, b, c in zip(split, concat, native, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # the same sums, in another order
        np.testing.assert_allclose(c, a, atol=1e-4, rtol=1e-4)
    nodes = {v: len(onnx.load(str(engines[v] / CPU_ENGINE_FILE), load_external_data=False).graph.node)
             for v in engines}
    assert nodes["native"] < nodes["concat"] < nodes["split"]  # concat: fewer nodes per layer, one more copy
    layers = read_engine_config(engines["native"]).model.num_hidden_layers
    graph = onnx.load(str(engines["native"] / CPU_ENGINE_FILE), load_external_data=False).graph
    assert sum(n.op_type == "PagedAttention" and n.domain == "trtbuild" for n in graph.node) == layers


def test_an_unbuilt_build_picks_native_attention_where_the_library_builds(checkpoint, tmp_path, monkeypatch):
    assert read_engine_config(build_engine(checkpoint, tmp_path / "e", **LIMITS)).build.attention == "native"
    fp16_pool = build_engine(checkpoint, tmp_path / "f", kv_pool_dtype="float16", **LIMITS)
    # a float16 pool at head size 8: the generic path reads it where F16C widens the rows
    assert read_engine_config(fp16_pool).build.attention == ("native" if F16C else "split")
    monkeypatch.setattr(engine_dir, "cpu_features", lambda: ["avx2", "fma"])  # a CPU with neither F16C nor AVX-512
    assert read_engine_config(build_engine(checkpoint, tmp_path / "g", kv_pool_dtype="float16", **LIMITS)
                              ).build.attention == "split"
    with pytest.raises(ConfigError, match="native cannot be used: the native op reads a float16 KV pool .* head "
                                          "size 8"):
        build_engine(checkpoint, tmp_path / "h", kv_pool_dtype="float16", attention="native", **LIMITS)


def test_autotune_records_tactics_and_the_cache_spares_a_rebuild(checkpoint, tmp_path):
    cache = tmp_path / "timings.json"
    calls = []

    def counting_timer(*args):
        calls.append(args[3])  # threads
        return time_graph(*args)

    first = build_engine(checkpoint, tmp_path / "a", timer=counting_timer, timing_cache=cache, autotune="fast",
                         **LIMITS)
    tactics = read_engine_config(first).tactics
    assert tactics["mode"] == "fast" and tactics["shape_classes"] == ["decode_b1_ctx64", "prefill_64"]
    attention = tactics["attention"]
    assert attention["source"] == "measured" and set(attention["timings_ms"]) == {"native", "split", "concat"}
    assert attention["chosen"] == best(attention["timings_ms"])
    assert all(ms > 0 for by_class in attention["timings_ms"].values() for ms in by_class.values())
    measured = len(calls)
    assert "float_linears" in tactics  # float32 weights: DenseMatMul against MatMul
    assert measured == sum(len(tactics[family]["timings_ms"]) for family in
                           ("attention", "quant_linears", "float_linears", "num_threads") if family in tactics)
    second = build_engine(checkpoint, tmp_path / "b", timer=counting_timer, timing_cache=cache, autotune="fast",
                          **LIMITS)
    again = read_engine_config(second).tactics
    assert len(calls) == measured and again["attention"]["source"] == "timing cache"
    assert again["attention"]["chosen"] == attention["chosen"]
    assert not list((tmp_path / "a").glob("*tuning*"))  # candidate graphs are removed
    for a, b in zip(steps(first), steps(second), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_best_tactic_is_the_fastest_over_all_shape_classes():
    assert best({"split": {"decode": 1.0, "prefill": 10.0}, "concat": {"decode": 0.8, "prefill": 10.5}}) == "concat"
    assert best({"split": {"decode": 1.0}, "concat": {"decode": 1.0}}) == "split"  # ties keep the first (default)
    # within the margin (3%) the default stays too; past it, the faster one wins
    assert best({"native": {"decode": 12.9, "prefill": 224.4}, "split": {"decode": 13.5, "prefill": 214.3}}) == "native"
    assert best({"native": {"decode": 12.9, "prefill": 224.4}, "split": {"decode": 12.0, "prefill": 214.3}}) == "split"
    full = shape_classes(BuildConfig(max_batch_size=8, max_seq_len=2048, autotune="full"), "full")
    assert full == (ShapeClass("decode_b1_ctx128", 1, 128, 1), ShapeClass("prefill_128", 1, 0, 128),
                    ShapeClass("decode_b8_ctx128", 8, 128, 1), ShapeClass("decode_b1_ctx1024", 1, 1024, 1))


def test_runtime_uses_the_tuned_thread_count(checkpoint, tmp_path, monkeypatch):
    engine = build_engine(checkpoint, tmp_path / "e", **LIMITS)
    config = json.loads((engine / "config.json").read_text())
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("TRTBUILD_NUM_THREADS", raising=False)
    config["tactics"] = {"num_threads": {"chosen": 3, "cores": 8, "timings_ms": {}, "source": "measured"}}
    (engine / "config.json").write_text(json.dumps(config))
    assert read_engine_config(engine).tuned_threads == 3
    assert CpuEngine(engine, num_blocks=2).session.get_session_options().intra_op_num_threads == 3
    assert CpuEngine(engine, num_threads=1, num_blocks=2).session.get_session_options().intra_op_num_threads == 1
    config["tactics"]["num_threads"]["cores"] = 4  # tuned on another machine: not used here
    (engine / "config.json").write_text(json.dumps(config))
    assert read_engine_config(engine).tuned_threads is None


def test_bad_autotune_inputs_are_clear_errors(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="autotune must be one of off, fast, full"):
        BuildConfig(autotune="max")
    with pytest.raises(ConfigError, match="autotune fast needs a timer"):
        build_engine(checkpoint, tmp_path / "e", autotune="fast", **LIMITS)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TrtbuildError, match=r"timing cache .*bad\.json is unreadable"):
        TimingCache(tmp_path / "bad.json")
    result = CliRunner().invoke(main, ["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "c"),
                                       "--autotune", "fast", "--timing-cache", str(tmp_path / "bad.json")])
    assert result.exit_code != 0 and "is unreadable" in result.output and not (tmp_path / "c").exists()


def test_build_autotune_through_the_cli(checkpoint, tmp_path):
    result = CliRunner().invoke(main, ["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"),
                                       "--max-seq-len", "128", "--max-num-tokens", "64", "--autotune", "fast",
                                       "--timing-cache", str(tmp_path / "t.json")])
    assert result.exit_code == 0, result.output
    assert "autotune attention: " in result.output and "(measured; native: decode_b1_ctx64" in result.output
    assert json.loads((tmp_path / "t.json").read_text())["version"] == 1


def test_a_tuned_engine_verifies_against_its_untuned_reference(checkpoint, tmp_path):
    from trtbuild.bench.verify import verify_engine

    engine = build_engine(checkpoint, tmp_path / "e", timer=time_graph, autotune="fast", **LIMITS)
    verify_engine(engine, checkpoint, num_threads=1).check()  # raises VerificationError if an output is off
