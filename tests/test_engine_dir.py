"""Engine directories: compatibility refused before loading, damaged or missing files, memory, unreadable configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from trtbuild import ENGINE_FORMAT_VERSION
from trtbuild.builder.engine_dir import _CPU_FLAGS, cpu_features, read_engine_config
from trtbuild.errors import ConfigError, EngineCompatibilityError, TrtbuildError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk


# ---- engine directory compatibility -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_dir(random_hf_model, engine_from_hf):
    return engine_from_hf(random_hf_model("llama"), max_batch_size=4, max_num_tokens=256)  # same as test_hf_parity


@pytest.fixture
def engine_copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def edit_engine_config(engine: Path, edit) -> None:
    doc = json.loads((engine / "config.json").read_text())
    edit(doc)
    (engine / "config.json").write_text(json.dumps(doc))


def _missing_cpu_feature() -> str:
    here = set(cpu_features())
    return next(f for f in _CPU_FLAGS if f not in here)  # no CPU has both the x86 and the Arm flags


def _add_missing_feature(doc: dict) -> None:
    doc["target"]["cpu_features"] = [*doc["target"]["cpu_features"], _missing_cpu_feature()]


INCOMPATIBLE = {
    "tensorrt_target": (lambda d: d["target"].update(name="tensorrt"),
                        r"built for target 'tensorrt'.*rebuild it: `trtbuild build .*--target cpu`"),
    "format_as_text": (lambda d: d.update(engine_format_version=str(ENGINE_FORMAT_VERSION)),
                       rf"engine format '{ENGINE_FORMAT_VERSION}'\); this trtbuild .* reads format "
                       rf"{ENGINE_FORMAT_VERSION}\. Rebuild it"),
    "future_format": (lambda d: d.update(engine_format_version=999),
                      rf"engine format 999\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild it"),
    "format_2_weights_inside": (lambda d: [d.update(engine_format_version=2), d.pop("weight_files")],
                                rf"engine format 2\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild "
                                r"it from its checkpoint"),
    "format_3_kv_cache_dtype": (lambda d: [d.update(engine_format_version=3),
                                           d["build_config"].update(kv_cache_dtype=d["build_config"].pop("kv_pool_dtype"))],
                                rf"engine format 3\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild "
                                r"it from its checkpoint"),
    "format_4_no_speculative_mode": (lambda d: [d.update(engine_format_version=4),
                                                [d["build_config"].pop(f) for f in ("speculative_decoding_mode",
                                                                                    "max_draft_len")]],
                                     rf"engine format 4\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. "
                                     r"Rebuild it from its checkpoint"),
    "missing_cpu_feature": (_add_missing_feature, r"built for a CPU with \w+, which this CPU lacks; rebuild it"),
    "other_machine": (lambda d: d["target"].update(machine="s390x"), r"built on a s390x CPU.*rebuild it"),
    "newer_onnxruntime": (lambda d: d["target"].update(onnxruntime_version="999.0.0"),
                          r"built with onnxruntime 999\.0\.0, newer than the installed.*upgrade onnxruntime"),
}


def test_engine_copy_runs(engine_copy):
    info = read_engine_config(engine_copy)
    assert info.target["name"] == "cpu" and info.target["cpu_features"] == cpu_features()
    assert (info.build.max_seq_len, info.build.tokens_per_block) == (256, 8)
    logits = CpuEngine(engine_copy, num_threads=1).step([SequenceChunk(0, [5, 6, 7], 0, num_logits=1, block_ids=[0])])
    assert logits.shape == (1, 320) and np.isfinite(logits).all()


@pytest.mark.parametrize("case", list(INCOMPATIBLE))
def test_incompatible_engine_fails_before_opening_the_onnx_file(case, engine_copy, monkeypatch):
    import onnxruntime

    edit, pattern = INCOMPATIBLE[case]
    edit_engine_config(engine_copy, edit)
    with pytest.raises(EngineCompatibilityError, match=pattern):
        read_engine_config(engine_copy)
    (engine_copy / "rank0.onnx").write_bytes(b"not an onnx model")
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(EngineCompatibilityError, match=pattern):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_missing_or_corrupt_engine_file(engine_copy):
    onnx_file = engine_copy / "rank0.onnx"
    data = onnx_file.read_bytes()
    onnx_file.write_bytes(data[: len(data) // 3])
    with pytest.raises(EngineCompatibilityError, match=r"rank0\.onnx could not be loaded.*rebuild the engine"):
        CpuEngine(engine_copy, num_threads=1)
    onnx_file.unlink()
    read_engine_config(engine_copy)  # config.json alone is fine
    with pytest.raises(EngineCompatibilityError, match=r"rank0\.onnx is missing; rebuild the engine"):
        CpuEngine(engine_copy, num_threads=1)


def test_weights_outside_the_graph(engine_copy):
    """Every initializer above the inline threshold is in rank0.weights, page-aligned; the graph file is small."""
    from trtbuild.builder.weight_file import ALIGN, INLINE_MAX_BYTES

    model = onnx.load(str(engine_copy / "rank0.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert external and all(len(t.raw_data) < INLINE_MAX_BYTES for t in inline)
    entries = [{e.key: e.value for e in t.external_data} for t in external]
    assert {e["location"] for e in entries} == {"rank0.weights"}
    assert all(int(e["offset"]) % ALIGN == 0 for e in entries)
    weights = (engine_copy / "rank0.weights").stat().st_size
    assert read_engine_config(engine_copy).weight_files == {"rank0.weights": weights}
    assert max(int(e["offset"]) + int(e["length"]) for e in entries) == weights
    assert (engine_copy / "rank0.onnx").stat().st_size < weights / 10
    assert not list(engine_copy.glob("*.staging"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_weight_file_fails_before_loading(engine_copy, damage, monkeypatch):
    import onnxruntime

    weights = engine_copy / "rank0.weights"
    size = weights.stat().st_size
    if damage == "missing":
        weights.unlink()
        pattern = rf"rank0\.weights is missing \({size} bytes expected\); copy the whole engine directory"
    else:
        with open(weights, "r+b") as f:
            f.truncate(size - 4096)
        pattern = rf"rank0\.weights has {size - 4096} bytes but the engine was built with {size}: it is truncated"
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(EngineCompatibilityError, match=pattern):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_engine_that_does_not_fit_in_memory_is_refused_with_the_numbers(engine_copy, monkeypatch):
    import onnxruntime

    from trtbuild.runtime import memory

    weights = (engine_copy / "rank0.weights").stat().st_size
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights)  # less than weights + working memory
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    needed = (weights + (256 << 20)) / 2**30
    with pytest.raises(TrtbuildError, match=rf"engine .* needs about {needed:.2f} GiB of memory but "
                                            rf"{weights / 2**30:.2f} GiB is available \(MemAvailable\); free memory"):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_kv_cache_budget_beyond_available_memory_is_refused(monkeypatch):
    from trtbuild.configs import BuildConfig
    from trtbuild.runtime import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ConfigError, match=r"kv_cache_memory 4294967296 bytes is more than the 1\.00 GiB of memory "
                                          r"available \(MemAvailable\); give less"):
        memory.kv_cache_blocks(1024, BuildConfig(), memory=float(4 << 30))
    assert memory.kv_cache_blocks(1024, BuildConfig(), memory=float(1 << 20)) == 1024
    # a GPU engine's pool is sized from the GPU's free memory, not the host's
    gpu = (1 << 20, "GPU memory free beside the engine's weights")
    assert memory.kv_cache_blocks(1024, BuildConfig(), memory=0.5, available=gpu) == 512
    with pytest.raises(ConfigError, match=r"more than the 0\.00 GiB of GPU memory free beside the engine's weights"):
        memory.kv_cache_blocks(1024, BuildConfig(), memory=float(4 << 20), available=gpu)


def test_not_an_engine_directory(engine_copy, converted, tmp_path):
    for path in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(EngineCompatibilityError, match=r"is not an engine directory \(no config\.json\); build "
                                                           r"one with `trtbuild build`"):
            CpuEngine(path)
    with pytest.raises(EngineCompatibilityError, match=r"trtbuild build"):
        CpuEngine(converted("llama"))  # a checkpoint's config.json is not an engine's
    (engine_copy / "config.json").write_text("{not json")
    with pytest.raises(EngineCompatibilityError, match=r"config\.json is corrupt.*trtbuild build"):
        CpuEngine(engine_copy)


UNREADABLE = {
    "not_utf8": lambda engine: (engine / "config.json").write_bytes(b"\xff\xfe{"),
    "target_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(target="cpu")),
    "model_config_unknown_field": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(c=1)),
    "model_config_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(model_config=[1, 2])),
    "build_config_invalid": lambda engine: edit_engine_config(engine, lambda d: d["build_config"].update(
        max_batch_size=0)),
    "build_config_missing": lambda engine: edit_engine_config(engine, lambda d: d.pop("build_config")),
    "weight_files_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(weight_files=["w"])),
    "weight_size_not_number": lambda engine: edit_engine_config(engine, lambda d: d["weight_files"].update(
        {"rank0.weights": "x"})),
    "io_without_kv_cache": lambda engine: edit_engine_config(engine, lambda d: d["io"].update(inputs=[])),
    "model_field_wrong_type": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(
        num_hidden_layers="five")),
    "model_heads_not_grouped": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(
        num_key_value_heads=d["model_config"]["num_attention_heads"] + 1)),
    "kv_cache_dims_symbolic": lambda engine: edit_engine_config(engine, lambda d: d["io"]["inputs"][-1].update(
        shape=["num_blocks"] * 6)),
    "kv_cache_dtype_unknown": lambda engine: edit_engine_config(engine, lambda d: d["io"]["inputs"][-1].update(
        dtype="float99")),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_engine_config_is_the_rebuild_error(case, engine_copy):
    """Any config.json that cannot be read back is the engine-compatibility error with the rebuild command."""
    UNREADABLE[case](engine_copy)
    with pytest.raises(EngineCompatibilityError, match=r"config\.json .*trtbuild build --checkpoint"):
        read_engine_config(engine_copy)
