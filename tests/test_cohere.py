"""Cohere (Command R, Aya) and Cohere 2 (Command R7B): LayerNorms without bias, attention and MLP in parallel off one
norm, interleaved RoPE, logits times logit_scale; Cohere 2's windowed layers with RoPE and full ones without. Their
configs, llama.cpp's GGUF keys, the engine's graph, the CUDA plan's LayerNorm and `trtbuild quantize`. End-to-end
parity with transformers is in test_hf_parity.py (cohere, cohere2), GGUF round trips in test_gguf_convert.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# CohereLabs/c4ai-command-r7b-12-2024's config.json fields that matter here
COMMAND_R7B = {"architectures": ["Cohere2ForCausalLM"], "attention_bias": False, "bos_token_id": 5,
               "eos_token_id": 255001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
               "intermediate_size": 14336, "layer_norm_eps": 1e-05, "logit_scale": 0.25,
               "max_position_embeddings": 132096, "model_type": "cohere2", "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 50000, "sliding_window": 4096,
               "sliding_window_pattern": 4, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "vocab_size": 256000}
# CohereLabs/aya-expanse-8b's
AYA_EXPANSE_8B = {"architectures": ["CohereForCausalLM"], "attention_bias": False, "bos_token_id": 5,
                  "eos_token_id": 255001, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                  "layer_norm_eps": 1e-05, "logit_scale": 0.125, "max_position_embeddings": 8192,
                  "model_type": "cohere", "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "rope_theta": 10000, "tie_word_embeddings": True, "use_qk_norm": False,
                  "torch_dtype": "float16", "vocab_size": 256000}


def test_released_configs():
    aya = model_config_from_hf(AYA_EXPANSE_8B)
    assert (aya.family, aya.norm_type, aya.parallel_residual, aya.rotary_interleaved) == ("cohere", "layer", True,
                                                                                         True)
    assert aya.logits_scaling == 8.0 and aya.norm_epsilon == 1e-5 and aya.tie_word_embeddings
    assert aya.sliding_window is None and aya.no_rope_layers == ()
    r7b = model_config_from_hf(COMMAND_R7B)
    assert r7b.logits_scaling == 4.0 and r7b.sliding_window == 4096
    assert r7b.layer_types[:4] == ("sliding_attention",) * 3 + ("full_attention",)
    assert r7b.no_rope_layers == tuple(range(3, 32, 4))
    with pytest.raises(CheckpointError, match="use_qk_norm"):
        model_config_from_hf({**AYA_EXPANSE_8B, "use_qk_norm": True})


def test_gguf_keys_give_the_same_model():
    """llama.cpp's Cohere2Model writes the logit scale, the LayerNorm epsilon and the window (its pattern fixed)."""
    meta = {f"cohere2.{k}": v for k, v in {
        "embedding_length": 4096, "attention.head_count": 32, "attention.head_count_kv": 8, "block_count": 32,
        "feed_forward_length": 14336, "rope.freq_base": 50000.0, "attention.layer_norm_epsilon": 1e-5,
        "logit_scale": 0.25, "attention.sliding_window": 4096, "context_length": 132096}.items()}
    cfg = hf_config(meta, "cohere2", GGUF_ARCHITECTURES["cohere2"], {"token_embd.weight": (256000, 4096)}, {})
    got, want = model_config_from_hf(cfg), model_config_from_hf(COMMAND_R7B)
    for field in ("norm_type", "parallel_residual", "logits_scaling", "norm_epsilon", "layer_types", "no_rope_layers",
                  "rotary_interleaved", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field


def test_the_engine_graph_has_one_layer_norm_per_layer_and_no_second_residual_add(tmp_path, engine_from_hf,
                                                                                  random_hf_model):
    import onnx

    from trtbuild.builder.engine_dir import CPU_ENGINE_FILE

    engine = engine_from_hf(random_hf_model("cohere"), max_batch_size=2, max_num_tokens=64)
    nodes = onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False).graph.node
    assert sum(n.op_type == "LayerNormalization" for n in nodes) == 2 + 1  # a norm per layer, the final one
    assert not any(n.op_type in ("RMSNormalization", "SkipSimplifiedLayerNormalization") for n in nodes)


def test_the_cuda_plans_layer_norm_is_torchs():
    from trtbuild.runtime.cuda_plan_ops import layernorm

    x, w = torch.randn(5, 64), torch.randn(64)
    (got,) = layernorm({}, {"eps": 1e-5}, x, w)
    centred = x - x.mean(-1, keepdim=True)
    want = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("family", "qformat", "kv", "from_checkpoint"), [
    ("cohere", "int8_sq", "int8", False), ("cohere2", "int4_awq", None, True)])
def test_quantized_model_computes_modelopts_simulation(tmp_path, family, qformat, kv, from_checkpoint):
    assert_computes_simulation(*quantize_random(family, tmp_path, qformat, kv, from_checkpoint=from_checkpoint))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
