"""Sliding windows (Mistral, Phi-3): an engine longer than its model's window applies it in the attention, and what
cannot apply it says so. Logits against transformers are in test_hf_parity.py (mistral_window, phi3), the native op
in test_cpu_ops.py, the Triton kernel in test_kernels.py, the CUDA plan in test_cuda_target.py."""

from __future__ import annotations

import dataclasses

import onnx
import pytest

from trtbuild.builder import build as build_module
from trtbuild.builder.build import build_engine, check_buildable, default_build_config
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.tensorrt.plan import check_tensorrt_buildable
from trtbuild.configs import ModelConfig
from trtbuild.errors import ConfigError
from trtbuild.plugins import paged_attention as pa


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


def test_what_cannot_apply_a_window_refuses_the_engine_with_what_to_do(checkpoint):
    config = ModelConfig.load(checkpoint / "config.json")
    long = default_build_config(config, max_seq_len=64, attention="split")
    with pytest.raises(ConfigError, match="sliding window \\(6\\), which only the native attention implements; use "
                                          "--attention native \\(or auto\\), or pass --max-seq-len 6 or less"):
        check_buildable(config, long)
    with pytest.raises(ConfigError, match="tensorrt plugins do not apply yet; pass 6 or less"):
        check_tensorrt_buildable(config, dataclasses.replace(long, attention="auto"))


def test_the_default_length_stays_within_the_window_only_where_nothing_applies_it(checkpoint, monkeypatch):
    config = ModelConfig.load(checkpoint / "config.json")
    assert default_build_config(config).max_seq_len == 256
    assert default_build_config(config, target="tensorrt").max_seq_len == 6
    monkeypatch.setattr(build_module, "_native_attention_unavailable", lambda: "no compiler")
    assert default_build_config(config).max_seq_len == 6
    assert default_build_config(config, max_seq_len=32).max_seq_len == 32  # what is asked for is kept
