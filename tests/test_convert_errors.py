"""`trtbuild convert` and `trtbuild build` refusals: broken models, taken outputs, bad options and checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from convert_helpers import hf_config

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.configs.from_hf import SUPPORTED_ARCHITECTURES
from trtbuild.errors import CheckpointError, ConfigError, TrtbuildError


# ---- errors -----------------------------------------------------------------------------------------------------
def broken_copy(src: Path, dst: Path, config_edit: dict | None = None, edit_files=None) -> Path:
    """A copy of the HF folder `src` with config.json fields replaced (or deleted) and then `edit_files(dst)` run."""
    shutil.copytree(src, dst)
    if config_edit:
        hf = {**hf_config(dst), **config_edit}
        (dst / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != "<delete>"}))
    if edit_files:
        edit_files(dst)
    return dst


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _garble_header(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 16 + data[16:])


WEIGHTS = "model.safetensors"
BROKEN_MODELS = {  # case -> (config.json edit, file edit, error pattern)
    "unsupported_arch": ({"architectures": ["GPT2LMHeadModel"]}, None,
                         r"unsupported architecture 'GPT2LMHeadModel'; trtbuild converts .*"
                         + ".*".join(re.escape(a) for a in SUPPORTED_ARCHITECTURES)),
    "no_architectures": ({"architectures": "<delete>"}, None, r"unsupported architecture None"),
    "truncated_weights": (None, lambda d: _truncate(d / WEIGHTS), r"model\.safetensors is corrupt or truncated"),
    "garbled_weights": (None, lambda d: _garble_header(d / WEIGHTS), r"model\.safetensors is corrupt or truncated"),
    "empty_weights": (None, lambda d: (d / WEIGHTS).write_bytes(b""), r"model\.safetensors is corrupt or truncated"),
    "shape_mismatch": ({"intermediate_size": 128}, None,
                       r"mlp\.gate\.weight has shape \(96, 64\) but config\.json implies \(128, 64\)"),
    "missing_layers": ({"num_hidden_layers": 3}, None, r"lacks 9 tensors .*transformer\.layers\.2\..*incomplete"),
    "config_lacks_field": ({"hidden_size": "<delete>"}, None, r"lacks the field 'hidden_size'"),
    "config_bad_value": ({"num_attention_heads": "four"}, None, r"config\.json has an invalid value"),
    "config_not_json": (None, lambda d: (d / "config.json").write_text("{"), r"config\.json is not valid JSON"),
    "config_not_object": (None, lambda d: (d / "config.json").write_text("[]"), r"config\.json is not a JSON object"),
    "unsupported_rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}, None,
                         r"rope scaling type 'dynamic' is not supported \(default, linear, llama3, longrope, yarn "
                         r"are\)"),
    "yarn_without_factor": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, None,
                            r"rope scaling yarn gives no factor"),
    "yarn_factor_not_positive": ({"rope_parameters": {"rope_type": "yarn", "factor": 0, "rope_theta": 10000.0}},
                                 None, r"rope scaling yarn factor must be above 0, got 0"),
    "unsupported_act": ({"hidden_act": "gelu"}, None, r"hidden_act 'gelu' is not supported"),
    "no_config": (None, lambda d: (d / "config.json").unlink(), r"has no config\.json"),
    "no_safetensors": (None, lambda d: (d / WEIGHTS).rename(d / "pytorch_model.bin"),
                       r"has no \*\.safetensors weights.*safe_serialization=True"),
}


@pytest.mark.parametrize("case", list(BROKEN_MODELS))
def test_broken_model_gives_a_clear_error_and_no_output(case, hf_dir, tmp_path):
    config_edit, edit_files, pattern = BROKEN_MODELS[case]
    model = broken_copy(hf_dir("llama"), tmp_path / "model", config_edit, edit_files)
    with pytest.raises(CheckpointError, match=pattern):
        convert(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_model_path_and_non_gguf_file(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model .*nowhere does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"is a file but not a \.gguf"):
        convert(hf_dir("llama") / "config.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_never_touched(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty; choose a new folder"):
        convert(hf_dir("llama"), out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty"):
        convert(hf_dir("llama"), a_file)
    assert a_file.read_text() == "mine"


def test_failure_while_writing_shards_removes_the_half_written_folder(hf_dir, tmp_path, monkeypatch):
    from trtbuild.builder.convert.safetensors_io import SafetensorsWriter

    real_write = SafetensorsWriter.write
    written = []

    def failing_write(self, name, tensor):
        if len(written) == 40:
            raise OSError("No space left on device")
        real_write(self, name, tensor)
        written.append(self.path.name)

    monkeypatch.setattr(SafetensorsWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        convert(hf_dir("qwen2"), tmp_path / "out", tp_size=2, pp_size=2)
    assert len(set(written)) >= 2  # the failure came after real tensors were written to several ranks
    assert not (tmp_path / "out").exists()


# ---- build refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "pp", "target", "what"), [(1, 2, "cpu", "pipeline-parallel ranks"),
                                                      (2, 1, "cuda", "ranks for the cuda target")])
def test_build_refuses_the_ranks_it_cannot_build(tp, pp, target, what, converted, tmp_path):
    """Tensor-parallel ranks build for the cpu target only (tests/test_tensor_parallel.py)."""
    with pytest.raises(TrtbuildError, match=rf"2 ranks \(tp={tp}, pp={pp}\).*no {what}.*trtbuild convert.*"
                                            r"--tp-size 1 --pp-size 1"):
        build_engine(converted("llama3_rope", tp, pp), tmp_path / "engine", target=target)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize(("options", "pattern"), [
    (dict(max_seq_len=257), r"max_seq_len 257 exceeds the model's max_position_embeddings \(256\); pass 256 or "
                            r"less"),
    (dict(target="tensorrt"), r"target tensorrt needs NVIDIA TensorRT's Python package.*pip install tensorrt"),
    (dict(target="gpu"), r"target must be one of cpu, cuda, tensorrt, got 'gpu'"),
    (dict(target="cpu", dtype="bfloat16"), r"dtype must be one of float32, float16, bfloat16 for the cuda target"),
    (dict(max_batch_size=32, max_num_tokens=16), r"max_num_tokens 16 is below max_batch_size 32"),
    (dict(tokens_per_block=0), r"^tokens_per_block must be at least 1, got 0"),
])
def test_build_refuses_impossible_options(options, pattern, converted, tmp_path):
    with pytest.raises(TrtbuildError, match=pattern):
        build_engine(converted("llama"), tmp_path / "engine", **options)
    assert not (tmp_path / "engine").exists()


def test_build_refuses_bad_checkpoints(converted, hf_dir, tmp_path):
    with pytest.raises(TrtbuildError, match=r"checkpoint folder .* does not exist.*trtbuild convert"):
        build_engine(tmp_path / "nowhere", tmp_path / "e1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json not found.*trtbuild convert"):
        build_engine(tmp_path / "empty", tmp_path / "e2")
    with pytest.raises(CheckpointError, match=r"unknown fields in checkpoint config\.json.*trtbuild convert"):
        build_engine(hf_dir("llama"), tmp_path / "e3")  # an HF folder is not a checkpoint
    corrupt = tmp_path / "corrupt"
    shutil.copytree(converted("llama"), corrupt)
    _truncate(corrupt / "rank0.safetensors")
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors is corrupt.*trtbuild convert"):
        build_engine(corrupt, tmp_path / "e4")
    (corrupt / "rank0.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors is missing"):
        build_engine(corrupt, tmp_path / "e5")
    for e in ("e1", "e2", "e3", "e4", "e5"):
        assert not (tmp_path / e).exists(), e
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty"):
        build_engine(converted("llama"), out)
    assert [p.name for p in out.iterdir()] == ["keep"] and (out / "keep").read_text() == "mine"
