"""benchmarks/make_real_size_model.py: the GGUFs it writes convert to the model they were written from (llama q / k
rows permuted as llama.cpp's converter does, llama3 RoPE factors as a rope_freqs tensor, Phi-3's fused projections
and LongRoPE factor tensors), and its random GGUFs without an HF folder are ones `convert` reads."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from trtbuild.builder.convert.convert import convert

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "make_real_size_model.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_real_size_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _tiny(script, name: str):
    # heads of 96 (phi3-mini) and 128 of which 96 rotate (phi4-mini): what their 48 LongRoPE factors rotate
    hidden = {"phi3-mini": 384, "phi4-mini": 512}.get(name, 256)
    layers = 4 if name == "smollm3-3b" else 7 if name.startswith("gemma3") else 2  # SmolLM3's fourth layer: no RoPE;
    head_size = 32 if name.startswith("gemma") else None  # Gemma 3's sixth: full attention; Gemma's heads > hidden
    return replace(script.SHAPES[name], hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=512, vocab_size=4096, head_size=head_size,
                   sliding_window=script.SHAPES[name].sliding_window and 8)


@pytest.mark.parametrize("name", ["llama-8b", "1.5b", "phi3-mini", "phi4-mini", "smollm3-3b", "gemma3-1b", "gemma3-4b",
                                  "gemma2-2b", "granite-2b", "olmo2-1b"])
def test_f32_gguf_converts_to_the_hf_model(script, tmp_path: Path, name: str):
    shape = _tiny(script, name)
    hf = tmp_path / "hf"
    hf.mkdir()
    tok = script.make_tokenizer(hf, shape.family)
    script.make_hf(hf, shape, tok, seed=0, dtype="float32")
    script.make_gguf(tmp_path / "model.gguf", shape, tok, hf, seed=0, form="f32")
    convert(hf, tmp_path / "from_hf")
    convert(tmp_path / "model.gguf", tmp_path / "from_gguf")

    a = load_file(tmp_path / "from_hf" / "rank0.safetensors")
    b = load_file(tmp_path / "from_gguf" / "rank0.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    cfg_hf = json.loads((tmp_path / "from_hf" / "config.json").read_text())
    cfg_gguf = json.loads((tmp_path / "from_gguf" / "config.json").read_text())
    assert cfg_gguf == cfg_hf
    if shape.rope_scaling is not None:
        assert cfg_gguf["rotary_scaling"]["rope_type"] == shape.rope_scaling["rope_type"]
        for key in ("factor", "long_factor", "short_factor"):
            assert cfg_gguf["rotary_scaling"].get(key) == shape.rope_scaling.get(key), key


def test_random_gguf_without_hf_folder(script, tmp_path: Path):
    shape = _tiny(script, "llama-8b")
    tok = script.make_tokenizer(tmp_path, shape.family)
    script.make_gguf(tmp_path / "model.gguf", shape, tok, None, seed=0)
    cfg = convert(tmp_path / "model.gguf", tmp_path / "ckpt")
    assert cfg.num_hidden_layers == 2
    assert cfg.quantization.quant_algo is not None
    again = tmp_path / "again.gguf"
    script.make_gguf(again, shape, tok, None, seed=0)
    assert again.read_bytes() == (tmp_path / "model.gguf").read_bytes()  # seeded: the same file every time


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "granite-moe-3b"])
def test_a_mixture_of_experts_gguf_keeps_its_experts(script, tmp_path: Path, name: str):
    """The MoE shapes are written as GGUFs only: stacked Q4_K / Q6_K experts, which convert keeps as they are."""
    shape = replace(_tiny(script, name), experts=4, experts_per_tok=2)
    tok = script.make_tokenizer(tmp_path, shape.family)
    script.make_gguf(tmp_path / "model.gguf", shape, tok, None, seed=0)
    cfg = convert(tmp_path / "model.gguf", tmp_path / "ckpt")
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        shape.family.arch, 4, 2, 512)
    assert not cfg.quantization.is_excluded("transformer.layers.1.mlp.experts.proj")
    codes = load_file(tmp_path / "ckpt" / "rank0.safetensors")["transformer.layers.1.mlp.experts.gate.weight"]
    assert codes.dtype == np.uint8 and codes.shape == (4 * 512, 256 // 2)  # Q4_K: 4-bit codes of [experts x out, in]


def test_a_qwen35_gguf_converts(script, tmp_path: Path):
    """Qwen3.5 is written as a GGUF only: gated DeltaNet layers (ssm_*) beside every fourth full attention layer."""
    from real_shapes import LinearAttention

    shape = replace(_tiny(script, "qwen3.5-0.8b"), num_hidden_layers=4, head_size=64,
                    linear_attention=LinearAttention(4, 4, 32, 32, 4))
    tok = script.make_tokenizer(tmp_path, shape.family)
    script.make_gguf(tmp_path / "model.gguf", shape, tok, None, seed=0, form="f32")
    cfg = convert(tmp_path / "model.gguf", tmp_path / "ckpt")
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.recurrent_layers) == ("Qwen3_5ForCausalLM", 4, (0, 1, 2))
    assert cfg.recurrent_state_shape == (4, 32, 32) and cfg.rotary_dim == 16


def test_a_granite4_h_gguf_converts(script, tmp_path: Path):
    """Granite 4.0-H is written as a GGUF only: Mamba2 layers (ssm_*, no KV heads) beside attention layers without
    RoPE, a dense shared MLP in each layer, Granite's multipliers."""
    from real_shapes import Mamba2

    shape = replace(_tiny(script, "granite4-h-micro"), num_hidden_layers=4, attention_layers=(1, 3),
                    mamba2=Mamba2(8, 64, 32))  # inner 512: twice the hidden size; vocabulary 4096, a multiple of 8
    tok = script.make_tokenizer(tmp_path, shape.family)
    script.make_gguf(tmp_path / "model.gguf", shape, tok, None, seed=0, form="f32")
    cfg = convert(tmp_path / "model.gguf", tmp_path / "ckpt")
    assert cfg.layer_types == ("mamba", "full_attention", "mamba", "full_attention") and cfg.recurrent_layers == (0, 2)
    assert cfg.recurrent_state_shape == (8, 64, 32) and cfg.no_rope_layers == (0, 1, 2, 3)
    assert (cfg.mamba_num_groups, cfg.mamba_conv_bias, cfg.mamba_proj_bias) == (1, True, False)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (12.0, 0.22, 8.0)
    w = load_file(tmp_path / "ckpt" / "rank0.safetensors")
    assert w["transformer.layers.0.mamba.in_proj.weight"].shape == (512 + 576 + 8, 256)  # z | x B C | dt
    assert (w["transformer.layers.0.mamba.A"] < 0).all()  # ssm_a = -exp(A_log)
