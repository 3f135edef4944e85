"""Arcee (AFM-4.5B): Llama whose MLP has no gate, down(relu(up(x))^2) (`gated_mlp: false`, `hidden_act: relu2`),
from its released config and llama.cpp's `arcee` GGUF keys, and quantized. End-to-end parity with transformers is in
test_hf_parity.py (arcee), the GGUF round trip in test_gguf_convert.py, the CUDA plan in test_cuda_target.py."""

from __future__ import annotations

import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.checkpoint import expected_tensors
from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.configs.model_config import ModelConfig
from trtbuild.errors import CheckpointError

# arcee-ai/AFM-4.5B's config.json
AFM_4_5B = {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "relu2", "hidden_size": 2560,
            "intermediate_size": 18432, "num_attention_heads": 20, "num_hidden_layers": 36, "num_key_value_heads": 4,
            "head_dim": 128, "vocab_size": 128004, "max_position_embeddings": 65536, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 20.0,
                                                    "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128003}


def test_the_released_config_has_an_mlp_without_a_gate():
    c = model_config_from_hf(AFM_4_5B)
    assert (c.family, c.hidden_act, c.gated_mlp, c.head_size) == ("arcee", "relu2", False, 128)
    assert c.rotary_scaling["rope_type"] == "yarn" and c.rotary_scaling["factor"] == 20.0
    names = expected_tensors(c, [0], first_stage=False, last_stage=False)
    assert "transformer.layers.0.mlp.fc.weight" in names and "transformer.layers.0.mlp.gate.weight" not in names


def test_gguf_keys_give_the_same_model():
    """llama.cpp's ArceeModel is its LlamaModel (q / k rows permuted, YaRN keys) with ffn_up and ffn_down only."""
    meta = {f"arcee.{k}": v for k, v in {
        "embedding_length": 2560, "attention.head_count": 20, "attention.head_count_kv": 4, "block_count": 36,
        "feed_forward_length": 18432, "rope.freq_base": 10000.0, "context_length": 65536,
        "rope.dimension_count": 128, "attention.layer_norm_rms_epsilon": 1e-5, "rope.scaling.type": "yarn",
        "rope.scaling.factor": 20.0, "rope.scaling.original_context_length": 4096}.items()}
    arch = GGUF_ARCHITECTURES["arcee"]
    assert arch.permute_qk and "ffn_gate.weight" not in arch.layer_tensors
    c = model_config_from_hf(hf_config(meta, "arcee", arch, {"token_embd.weight": (128004, 2560)}, {}))
    want = model_config_from_hf(AFM_4_5B)
    assert (c.gated_mlp, c.hidden_act, c.intermediate_size, c.rotary_scaling["factor"]) == (
        want.gated_mlp, want.hidden_act, want.intermediate_size, want.rotary_scaling["factor"])


def test_a_gate_free_mlp_is_checked_against_what_needs_a_gate():
    base = model_config_from_hf(AFM_4_5B).to_dict()
    with pytest.raises(CheckpointError, match="relu2 is the activation of an MLP without a gate"):
        ModelConfig.from_dict({**base, "gated_mlp": True})
    with pytest.raises(CheckpointError, match="does not go with hidden_act swiglu_oai"):
        ModelConfig.from_dict({**base, "hidden_act": "swiglu_oai", "swiglu_alpha": 1.7, "swiglu_limit": 7.0})


@pytest.mark.parametrize("qformat", ["int4_awq", "int8_sq", "fp8"])
def test_quantized_arcee_computes_modelopts_simulation(tmp_path, qformat):
    assert_computes_simulation(*quantize_random("arcee", tmp_path, qformat, None))
