"""Arcee's AFMoE (Trinity): a sigmoid gate on the attention's output, Gemma 2's four norms, RoPE on the sliding layers
only, leading dense layers, then experts chosen by sigmoid scores plus a selection bias (as LFM2-MoE's) beside
ungated shared experts, and muP's embedding scale. Logits against transformers: tests/test_hf_parity.py (afmoe); the
cuda plan: tests/test_cuda_target.py."""

from __future__ import annotations

from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import require_shared_models
from test_gguf_convert import assert_same_checkpoint

from trtbuild.builder.convert.convert import convert
from trtbuild.configs.from_hf import model_config_from_hf

# a config in the shape of Trinity Nano's (6B total, 1B active: llama.cpp sizes its 56 layers as 6B); the values
# are illustrative
NANO = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "hidden_size": 1024, "intermediate_size": 3072,
        "moe_intermediate_size": 256, "num_hidden_layers": 56, "num_dense_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "route_scale": 2.826, "global_attn_every_n_layers": 4, "sliding_window": 2048,
        "mup_enabled": True, "vocab_size": 200192, "rms_norm_eps": 1e-5, "rope_theta": 10000,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def test_the_config_maps_onto_existing_fields():
    c = model_config_from_hf(NANO)
    assert (c.family, c.attention_output_gate, c.output_norms, c.qk_norm, c.moe_scoring, c.moe_selection_bias) == (
        "afmoe", True, True, True, "sigmoid", True)
    assert (c.moe_dense_layers, c.num_experts, c.moe_intermediate_size, c.moe_routed_scale) == (2, 128, 256, 2.826)
    assert (c.shared_expert_intermediate_size, c.shared_expert_gated, c.embedding_multiplier) == (256, False, 32.0)
    full = tuple(i for i in range(56) if (i + 1) % 4 == 0)
    assert c.no_rope_layers == full and c.sliding_window == 2048
    assert tuple(i for i, kind in enumerate(c.layer_types) if kind == "full_attention") == full


def test_a_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, monkeypatch):
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("afmoe", tmp_path / "hf")
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "afmoe"), tmp_path / "from_gguf")
    assert config.family == "afmoe" and config.attention_output_gate and config.num_experts == 4
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")
