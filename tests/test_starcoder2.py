"""StarCoder 2 (3B / 7B / 15B): LayerNorms with biases (`norm_bias`), biases on every projection (`use_bias`: q / k
/ v / o and the MLP's, `mlp_bias`), a tanh-GELU MLP without a gate, sliding windows; from its released config and
llama.cpp's `starcoder2` GGUF keys, and quantized. End-to-end parity with transformers is in test_hf_parity.py
(starcoder2), the GGUF round trip in test_gguf_convert.py, the CUDA plan in test_cuda_target.py; test_fim.py serves
fill-in-the-middle, which it was trained for."""

from __future__ import annotations

import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.checkpoint import expected_tensors
from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.configs.model_config import ModelConfig
from trtbuild.errors import CheckpointError

# bigcode/starcoder2-3b's config.json
STARCODER2_3B = {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "hidden_size": 3072,
                 "intermediate_size": 12288, "num_attention_heads": 24, "num_hidden_layers": 30,
                 "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 16384,
                 "norm_epsilon": 1e-05, "rope_theta": 999999.4420358813, "sliding_window": 4096, "use_bias": True,
                 "vocab_size": 49152, "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}


def test_the_released_config():
    c = model_config_from_hf(STARCODER2_3B)
    assert (c.family, c.norm_type, c.norm_bias, c.mlp_bias, c.qkv_bias, c.dense_bias) == (
        "starcoder2", "layer", True, True, True, True)
    assert (c.gated_mlp, c.hidden_act, c.sliding_window, c.norm_epsilon) == (False, "gelu_pytorch_tanh", 4096, 1e-5)
    assert c.tie_word_embeddings and not c.rotary_interleaved
    names = expected_tensors(c, [0], first_stage=False, last_stage=True)
    for name in ("input_layernorm.bias", "post_layernorm.bias", "mlp.fc.bias", "mlp.proj.bias",
                 "attention.dense.bias"):
        assert f"transformer.layers.0.{name}" in names
    assert "transformer.ln_f.bias" in names and "transformer.layers.0.mlp.gate.weight" not in names


def test_gguf_keys_give_the_same_model_without_the_window():
    """llama.cpp's StarCoder2Model writes LayerNorm's epsilon; its graph has no sliding window, so neither has the
    model read from its GGUF."""
    meta = {f"starcoder2.{k}": v for k, v in {
        "embedding_length": 3072, "attention.head_count": 24, "attention.head_count_kv": 2, "block_count": 30,
        "feed_forward_length": 12288, "rope.freq_base": 999999.4420358813, "context_length": 16384,
        "attention.layer_norm_epsilon": 1e-5}.items()}
    arch = GGUF_ARCHITECTURES["starcoder2"]
    c = model_config_from_hf(hf_config(meta, "starcoder2", arch, {"token_embd.weight": (49152, 3072)}, {}))
    want = model_config_from_hf(STARCODER2_3B)
    assert c.sliding_window is None and not arch.permute_qk
    for field in ("norm_type", "norm_bias", "mlp_bias", "qkv_bias", "dense_bias", "gated_mlp", "hidden_act",
                  "norm_epsilon", "tie_word_embeddings", "head_size"):
        assert getattr(c, field) == getattr(want, field), field


def test_biases_only_where_they_go():
    base = model_config_from_hf(STARCODER2_3B).to_dict()
    with pytest.raises(CheckpointError, match="norm_bias is for LayerNorms"):
        ModelConfig.from_dict({**base, "norm_type": "rms"})
    with pytest.raises(CheckpointError, match=r"mlp_bias\) are not supported for qwen2"):
        model_config_from_hf({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **{
            k: STARCODER2_3B[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_hidden_layers", "num_key_value_heads", "vocab_size")}, "mlp_bias": True})


@pytest.mark.parametrize("qformat", ["int4_awq", "int8_sq", "fp8"])
def test_quantized_starcoder2_computes_modelopts_simulation(tmp_path, qformat):
    assert_computes_simulation(*quantize_random("starcoder2", tmp_path, qformat, None))
