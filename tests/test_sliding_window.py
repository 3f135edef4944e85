"""Sliding windows (Mistral, Phi-3): an engine longer than its model's window applies it in the attention, and what
cannot apply it (the tensorrt target) says so. Logits against transformers are in test_hf_parity.py (mistral_window,
phi3), the native op in test_cpu_ops.py, the lowering in test_paged_attention.py, the Triton kernel in
test_kernels.py, the CUDA plan in test_cuda_target.py."""

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
