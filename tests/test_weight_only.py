"""Weight-only quantization (`trtbuild convert --weight-only int8|int4`): the round-to-nearest format, the engine's
MatMulNBits kernels, and engines that compute exactly what the dequantized weights would."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import CONFIG_FILE, load_checkpoint, save_rank
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.convert.weight_only import NBitsWeight
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.cli import main
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.errors import ConfigError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

# NOTE: a float32 KV pool (the default is float16 for quantized weights): the formats' arithmetic is compared
# exactly, against float32 references
OPTIONS = dict(max_seq_len=64, tokens_per_block=8, max_batch_size=4, max_num_tokens=64, int4_accuracy_level=1,
               kv_pool_dtype="float32")
PROMPTS = [[3, 17, 250, 9, 41, 77, 5], [8, 8, 120]]


# ---- engines ----------------------------------------------------------------------------------------------------
def dequantized_checkpoint(src, dst):
    """The weight_only checkpoint at `src` with every linear dequantized back to float: the engine's reference."""
    config, tensors = load_checkpoint(src)
    out = {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix + ".weights_scaling_factor" in tensors:
            zp = tensors.get(prefix + ".weights_zero_point")
            scales = tensors[prefix + ".weights_scaling_factor"].numpy()
            bits = _bits(config, prefix, t)
            k = t.shape[1] * 8 // bits
            w = NBitsWeight(bits, k // scales.shape[1], t.numpy(), scales, None if zp is None else zp.numpy())
            out[name] = torch.from_numpy(w.dequantize())
        elif not name.endswith((".weights_scaling_factor", ".weights_zero_point")):
            out[name] = t.to(torch.float32)
    dst.mkdir()
    save_rank(dst, 0, out)
    dataclasses.replace(config, dtype="float32", quantization=QuantConfig()).save(dst / CONFIG_FILE)
    return dst


def _bits(config, prefix: str, codes: torch.Tensor) -> int:
    from trtbuild.builder.convert.checkpoint import expected_shape

    return codes.shape[1] * 8 // expected_shape(prefix + ".weight", config)[1]


def run(engine_dir, prompts=PROMPTS) -> np.ndarray:
    """Logits of every prompt token, prefilled in one step, then two decode steps."""
    e = CpuEngine(engine_dir, num_threads=1, num_blocks=8)
    blocks = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    out = [e.step([SequenceChunk(i, p, 0, len(p), blocks[i]) for i, p in enumerate(prompts)])]
    for step, token in enumerate((11, 200)):
        out.append(e.step([SequenceChunk(i, [token], len(p) + step, 1, blocks[i]) for i, p in enumerate(prompts)]))
    return np.concatenate(out)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("bits", "group"), [(8, None), (8, 32), (4, None), (4, 16)])
def test_engine_equals_its_dequantized_weights(family, bits, group, random_hf_model, tmp_path):
    """The MatMulNBits engine (accuracy level 1: fp32 compute) computes what fp32 MatMuls over the dequantized
    weights compute, to fp32 rounding; q/k/v and gate/up run as one kernel each; the embedding table is quantized
    too and gathered by GatherBlockQuantized."""
    ckpt = tmp_path / "wo"
    config = convert(random_hf_model(family), ckpt, weight_only=WeightOnly(bits, group))
    want_group = group or (32 if bits == 4 else None)  # int4's default: the largest of 128/64/32 dividing 64 and 96
    assert config.quantization == QuantConfig(quant_algo="weight_only", group_size=want_group,
                                              embedding_weight_only=True)
    engine = build_engine(ckpt, tmp_path / "engine", **OPTIONS)
    reference = build_engine(dequantized_checkpoint(ckpt, tmp_path / "deq"), tmp_path / "ref", **OPTIONS)
    got, want = run(engine), run(reference)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    model = onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False)
    kernels = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    layers = config.num_hidden_layers
    assert len(kernels) == 4 * layers + 1  # qkv, dense, gate_up, proj per layer, and lm_head
    assert {onnx.helper.get_attribute_value(a) for n in kernels for a in n.attribute if a.name == "bits"} == {bits}
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMul"] <= 2 * layers  # attention only
    assert ops["GatherBlockQuantized"] == 1  # the embedding, with no float copy of its table:
    assert not [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                and list(t.dims) == [config.vocab_size, config.hidden_size]]
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    c = config
    linear_params = layers * (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                              + 3 * c.hidden_size * c.intermediate_size) + c.vocab_size * c.hidden_size
    assert sum(np.prod(dims[n.input[1]]) for n in kernels) == linear_params * bits // 8  # bytes of codes


def test_group_size_must_divide_every_linear(random_hf_model, tmp_path):
    with pytest.raises(ConfigError, match=r"group_size 64 does not divide the 96 input features of "
                                              r"transformer\.layers\.0\.mlp\.proj"):
        convert(random_hf_model("llama"), tmp_path / "c", weight_only=WeightOnly(4, 64))
    assert not (tmp_path / "c").exists()


def test_cli(random_hf_model, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["convert", "--model", str(random_hf_model("llama")), "--output",
                                  str(tmp_path / "c"), "--weight-only", "int4"])
    assert result.exit_code == 0, result.output
    assert "weight_only (group size 32, 0 linears left in float)" in result.output
    result = runner.invoke(main, ["convert", "--model", str(random_hf_model("llama")), "--output",
                                  str(tmp_path / "d"), "--group-size", "32"])
    assert result.exit_code == 2 and "--group-size applies to --weight-only" in result.output
