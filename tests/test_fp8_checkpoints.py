"""FP8 Hugging Face checkpoints (Qwen3 / DeepSeek / Mistral "fp8", LLM Compressor's compressed-tensors, ModelOpt,
FBGEMM) convert with their weights dequantized: the engine equals transformers loading the same folder (which
dequantizes without a GPU), each scale form gives W * S exactly, and the formats trtbuild does not read are refused
by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_random_hf_model, prefill_logits
from safetensors.torch import load_file, save_file

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.fp8_weights import dequantize_fp8
from trtbuild.builder.convert.hf_reader import read_hf
from trtbuild.configs.from_hf import model_config_from_hf, text_model_config
from trtbuild.errors import CheckpointError

FP8_MAX = 448.0
LINEARS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
           "down_proj.weight")


def scale_grid(w: torch.Tensor, granularity: str, block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """Absmax / 448 per tensor ([]), per row ([rows, 1]) or per block ([ceil(rows / br), ceil(cols / bc)])."""
    if granularity == "tensor":
        return w.abs().max() / FP8_MAX
    if granularity == "channel":
        return w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    rows, cols = w.shape
    br, bc = block
    grid = torch.zeros(math.ceil(rows / br), math.ceil(cols / bc))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max() / FP8_MAX
    return grid


def broadcast(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """The scale of every weight element, element by element (the reference for fp8_weights.py's expansion)."""
    rows, cols = shape
    if scale.numel() == 1:
        return torch.full(shape, float(scale.reshape(-1)[0]))
    if scale.shape[-1] == 1 and scale.shape[0] == rows:
        return scale.float().expand(rows, cols).clone()
    br, bc = block
    return torch.tensor([[float(scale[i // br, j // bc]) for j in range(cols)] for i in range(rows)])


def make_fp8_release(src: Path, out: Path, quantization_config: dict, granularity: str, scale_suffix: str,
                     block: tuple[int, int] = (32, 32), extra_scales: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """`src`'s model with every decoder linear as e4m3 + its scale (named weight + scale_suffix), its run-time
    scales (`extra_scales`, e.g. input_scale) beside it, as a release stores them; returns the weights it stands
    for (W * S)."""
    tensors, meant = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if ".layers." not in name or not name.endswith(LINEARS):
            tensors[name] = t
            continue
        scale = scale_grid(t, granularity, block)
        q = (t / broadcast(scale, tuple(t.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + scale_suffix] = q, scale
        for extra in extra_scales:
            tensors[name.removesuffix("weight") + extra] = torch.tensor(0.02)
        meant[name] = q.float() * broadcast(scale, tuple(t.shape), block)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return meant


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return make_random_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def test_a_block_fp8_release_builds_the_model_transformers_loads(qwen3, tmp_path):
    """Qwen3-FP8's form (quant_method fp8, weight_scale_inv per 128x128 block, here 32x32): the engine's logits
    equal transformers' on the same folder, which dequantizes the weights itself on a CPU."""
    fp8 = tmp_path / "fp8"
    make_fp8_release(qwen3, fp8, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [32, 32]}, "block", "_scale_inv")
    convert(fp8, tmp_path / "ckpt")
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, tokens_per_block=8)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, 320, size=11).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    actual = prefill_logits(engine, ids)
    assert np.abs(actual - expected).max() / np.abs(expected).max() <= 1e-4
    original = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    with torch.no_grad():  # and it is the FP8 model, not the float one it came from
        assert not np.allclose(original(torch.tensor([ids])).logits[0].numpy(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["fp8_tensor_static", "compressed_channel", "compressed_block", "compressed_tensor",
                                  "modelopt", "fbgemm"])
def test_each_scale_form_gives_the_weights_it_stands_for(form, qwen3, tmp_path):
    """Per tensor (Ministral 3 / Mistral's static fp8, ModelOpt), per channel (LLM Compressor's FP8-dynamic,
    FBGEMM) and per block (LLM Compressor's FP8-block, with blocks cut at the edges: 48 x 40 over 96- and 64-wide
    weights): the checkpoint holds W * S in the model's dtype, and the run-time scales are gone."""
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True}}}
    block = (48, 40) if form == "compressed_block" else (32, 32)
    configs = {
        "fp8_tensor_static": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
                              "tensor", "_scale_inv", ("activation_scale",)),
        "compressed_channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                "config_groups": groups, "ignore": ["lm_head"]}, "channel", "_scale", ()),
        "compressed_block": ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
            "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                    "block_structure": list(block)}}}}, "block", "_scale", ("input_scale",)),
        "compressed_tensor": ({"quant_method": "compressed-tensors", "format": "naive-quantized",
                               "config_groups": groups}, "tensor", "_scale", ("input_scale",)),
        "modelopt": ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "tensor",
                     "_scale", ("input_scale", "k_scale", "v_scale")),
        "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "channel", "_scale",
                   ("input_scale_ub",)),
    }
    quantization_config, granularity, suffix, extras = configs[form]
    meant = make_fp8_release(qwen3, tmp_path / "fp8", quantization_config, granularity, suffix, block, extras)
    _, hf = read_hf(tmp_path / "fp8")
    assert not [n for n in hf if n.endswith(("_scale", "_scale_inv", "_scale_ub"))]
    for name, weight in meant.items():
        assert hf[name].dtype == torch.float32 and torch.equal(hf[name], weight), name
    config = convert(tmp_path / "fp8", tmp_path / "ckpt")
    assert config.quantization.quant_algo is None and config.dtype == "float32"
    _, tensors = load_checkpoint(tmp_path / "ckpt")
    for layer in (0, 1):
        for hf_name, name in (("self_attn.q_proj", "attention.q"), ("mlp.down_proj", "mlp.proj")):
            assert torch.equal(tensors[f"transformer.layers.{layer}.{name}.weight"],
                               meant[f"model.layers.{layer}.{hf_name}.weight"])


def test_scales_in_bfloat16_and_ue8m0():
    """DeepSeek V3.1-style UE8M0 block scales (float8_e8m0fnu, or their exponent bytes as uint8) and bfloat16
    scales multiply in float32."""
    w = torch.randn(64, 64).to(torch.float8_e4m3fn)
    exponents = torch.tensor([[-3.0, 2.0], [0.0, -7.0]])
    expected = w.float() * broadcast(exponents.exp2(), (64, 64))
    assert torch.equal(dequantize_fp8(w, exponents.exp2().to(torch.float8_e8m0fnu), (32, 32), "w"), expected)
    assert torch.equal(dequantize_fp8(w, (exponents + 127).to(torch.uint8), None, "w"), expected)
    s = torch.tensor([[0.013]], dtype=torch.bfloat16)
    assert torch.equal(dequantize_fp8(w, s, None, "w"), w.float() * s.float())


def test_a_scale_that_does_not_cover_its_weight_is_refused():
    w = torch.zeros(64, 96).to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"scale grid \[2, 2\] does not cover its weight \[64, 96\]"):
        dequantize_fp8(w, torch.ones(2, 2), (32, 32), "layers.0.q_proj.weight")
    with pytest.raises(CheckpointError, match="does not cover the weight"):
        dequantize_fp8(w, torch.ones(3), None, "layers.0.q_proj.weight")
    with pytest.raises(CheckpointError, match="not float8"):
        dequantize_fp8(torch.zeros(64, 96), torch.ones(()), None, "layers.0.q_proj.weight")


@pytest.mark.parametrize(("quantization_config", "named"), [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, "'pack-quantized' with int4"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "int"}}}}, "'int-quantized' with int8"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt 'NVFP4'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "fp8", "expert_dtype": "fp4"}, "fp8 with 'fp4' experts"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size is \\[128\\]"),
])
def test_formats_it_does_not_read_are_refused_by_name(quantization_config, named):
    from helpers import RANDOM_CONFIGS

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **RANDOM_CONFIGS["llama"][1],
          "quantization_config": quantization_config}
    with pytest.raises(CheckpointError, match=named):
        model_config_from_hf(hf)


def test_a_vision_language_release_keeps_its_quantization_config():
    """Ministral 3's FP8 releases are Mistral3ForConditionalGeneration folders: the text model's config keeps the
    top-level quantization_config, so its weights are dequantized (and an unread form refused), never read raw."""
    from test_ministral3 import MINISTRAL_3B

    fp8 = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
           "modules_to_not_convert": ["vision_tower", "multi_modal_projector", "lm_head"]}
    assert text_model_config({**MINISTRAL_3B, "quantization_config": fp8})["quantization_config"] == fp8
    assert model_config_from_hf({**MINISTRAL_3B, "quantization_config": fp8}).family == "ministral3"
    with pytest.raises(CheckpointError, match="'awq'"):
        model_config_from_hf({**MINISTRAL_3B, "quantization_config": {"quant_method": "awq"}})


def test_an_fp8_release_quantizes_from_its_dequantized_weights(tmp_path):
    """`trtbuild quantize` calibrates the dequantized model (INT8-SmoothQuant here), as it would the BF16 release;
    the checkpoint computes modelopt's simulation of it."""
    import shutil

    from helpers import STORIES260K, require_shared_models
    from quant_helpers import assert_computes_simulation

    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    require_shared_models()
    src = make_random_hf_model("qwen3", tmp_path / "hf", overrides={"vocab_size": 512})
    make_fp8_release(src, tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [32, 32]}, "block",
                     "_scale_inv")
    shutil.copy(STORIES260K / "tokenizer.json", tmp_path / "fp8" / "tokenizer.json")
    result = quantize(QuantizeOptions(tmp_path / "fp8", tmp_path / "ckpt", "int8_sq", calib_size=8,
                                      calib_max_seq_len=64))
    assert_computes_simulation(result, tmp_path / "ckpt", tmp_path / "fp8")
