"""Granite 4.0 (configs/granite4.py): GraniteMoeHybrid / GraniteMoeShared configs as the
Granite ones they compute, their shared MLP split by rows, GGUF files as llama.cpp writes them, and the hybrids
refused. Logits against transformers: tests/test_hf_parity.py (granite4, granite4_nope, granite4_moe,
granitemoeshared)."""

from __future__ import annotations

import pytest
from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import require_shared_models
from test_gguf_convert import assert_same_checkpoint

from trtbuild.builder.convert.convert import convert
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# in the shape of ibm-granite/granite-4.0-micro's config.json (attention-only, RoPE, no experts)
MICRO = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 2560,
         "intermediate_size": 8192, "shared_intermediate_size": 8192, "num_hidden_layers": 40,
         "num_attention_heads": 40, "num_key_value_heads": 8, "layer_types": ["attention"] * 40,
         "num_local_experts": 0, "num_experts_per_tok": 0, "position_embedding_type": "rope",
         "rope_theta": 10000000, "max_position_embeddings": 131072, "vocab_size": 100352, "rms_norm_eps": 1e-5,
         "attention_multiplier": 0.015625, "embedding_multiplier": 12, "residual_multiplier": 0.22,
         "logits_scaling": 10, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
         "mamba_n_heads": 128, "mamba_d_state": 256}


def test_an_attention_only_config_is_granite_with_its_shared_mlp():
    c = model_config_from_hf(MICRO)
    assert (c.architecture, c.family, c.intermediate_size, c.num_experts, c.no_rope_layers) == (
        "GraniteForCausalLM", "granite", 8192, 0, ())
    assert (c.attention_scale, c.embedding_multiplier, c.residual_multiplier, c.logits_scaling) == (
        0.015625, 12.0, 0.22, 10.0)
    nope = model_config_from_hf({**MICRO, "position_embedding_type": "nope"})
    assert nope.no_rope_layers == tuple(range(40))
    moe = model_config_from_hf({**MICRO, "num_local_experts": 64, "num_experts_per_tok": 6, "intermediate_size": 512,
                                "shared_intermediate_size": 1024})
    assert (moe.family, moe.num_experts, moe.moe_intermediate_size, moe.shared_expert_intermediate_size,
            moe.shared_expert_gated) == ("granitemoe", 64, 512, 1024, False)


def test_mamba_layers_read_as_mamba_layers():
    """The H- models: Mamba2 layers ("mamba" as released, "linear_attention" as transformers 5 saves them) with
    GraniteMoeHybridConfig's defaults (128 heads of (2 x hidden) / 128, state 256, one group, kernel 4, a conv bias)."""
    for mamba in ("mamba", "linear_attention"):
        hybrid = {**MICRO, "layer_types": [mamba] * 36 + ["attention"] * 4, "position_embedding_type": "nope"}
        c = model_config_from_hf(hybrid)
        assert c.family == "granite" and c.recurrent_layers == tuple(range(36)) and c.no_rope_layers == tuple(range(40))
        assert (c.recurrent_state_shape, c.mamba_num_groups, c.conv_kernel, c.mamba_conv_bias, c.mamba_proj_bias) == (
            (128, 40, 256), 1, 4, True, False)
        assert c.conv_channels(0) == 5120 + 2 * 256
    with pytest.raises(CheckpointError, match="time_step_limit"):
        model_config_from_hf({**hybrid, "time_step_limit": [0.0, 1.0]})
    with pytest.raises(CheckpointError, match="without shared_intermediate_size"):
        model_config_from_hf({k: v for k, v in MICRO.items() if k != "shared_intermediate_size"})


@pytest.mark.parametrize("family", ["granite4", "granite4_moe", "granite4_h", "granite4_h_moe"])
def test_a_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, family, monkeypatch):
    """llama.cpp writes these as `granite` (the shared MLP as ffn_gate / ffn_up / ffn_down) or `granitemoe` (it as
    the _shexp tensors, with no gate of its own); with Mamba2 layers as `granitehybrid` (its ssm_* tensors, no KV
    heads in the Mamba2 layers, and a context of 2^20, which the HF folder is given here too)."""
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    overrides = {"max_position_embeddings": 2**20} if family.startswith("granite4_h") else None
    hf = make_hf_folder(family, tmp_path / family, overrides)
    hf_config = convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family), tmp_path / "from_gguf")
    assert config.family == hf_config.family == ("granitemoe" if family.endswith("moe") else "granite")
    assert config.shared_expert_gated == hf_config.shared_expert_gated
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


def test_quantized_granite4_computes_modelopts_simulation(tmp_path):
    """`trtbuild quantize` of the HF folder calibrates it as the Granite model it computes (its shared MLP split)."""
    from quant_helpers import assert_computes_simulation, quantize_random

    result, ckpt, hf = quantize_random("granite4", tmp_path, "int8_sq", "int8")
    assert result.config.family == "granite" and "transformer.layers.1.mlp.gate" in result.quantized
    assert_computes_simulation(result, ckpt, hf)
