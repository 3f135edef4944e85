"""OLMo 2 / 3: norms after the attention and the MLP only, q / k norms over the whole projections, and OLMo 3's
sliding-window layers (every fourth one full). Read from HF configs as released and from llama.cpp's GGUF files,
refused where a split cannot compute them, quantized through transformers' model. End-to-end parity with transformers
is in test_hf_parity.py (olmo2, olmo3), GGUF round trips in test_gguf_convert.py."""

from __future__ import annotations

import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.configs.from_hf import model_config_from_hf

# allenai/OLMo-2-0425-1B's config.json as released
OLMO2_1B = {"architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "bos_token_id": None,
            "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
            "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 16,
            "num_hidden_layers": 16, "num_key_value_heads": 16, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
            "vocab_size": 100352}


def test_released_config_reads_as_post_norms_and_whole_projection_qk_norms():
    c = model_config_from_hf(OLMO2_1B)
    assert (c.family, c.input_norms, c.output_norms, c.qk_norm, c.qk_norm_full) == ("olmo2", False, True, True, True)
    assert c.sliding_window is None and set(c.layer_types) == {"full_attention"}


def test_olmo3_slides_but_every_fourth_layer():
    c = model_config_from_hf({**OLMO2_1B, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
                              "sliding_window": 4096})
    assert [i for i in range(16) if not c.is_sliding(i)] == [3, 7, 11, 15] and c.local_rotary_base is None


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_quantized_olmo_computes_modelopts_simulation(family, tmp_path):
    assert_computes_simulation(*quantize_random(family, tmp_path, "fp8", "fp8"))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
