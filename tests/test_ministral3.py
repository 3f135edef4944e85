"""Ministral 3 (3B / 8B / 14B): Mistral with YaRN and Llama 4's attention temperature, q multiplied by
1 + beta log(1 + floor(position / original context)); read as the text model of the released
Mistral3ForConditionalGeneration, from llama.cpp's `mistral3` GGUF keys, and quantized. End-to-end parity with
transformers (past the original context, where the temperature steps up) is in test_hf_parity.py (ministral3), GGUF
round trips in test_gguf_convert.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# mistralai/Ministral-3-3B-Instruct-2512's config.json: the vision-language model and its text model's fields
_TEXT = {"model_type": "ministral3", "head_dim": 128, "hidden_size": 3072, "intermediate_size": 9216,
         "num_attention_heads": 32, "num_hidden_layers": 26, "num_key_value_heads": 8, "vocab_size": 131072,
         "max_position_embeddings": 262144, "rms_norm_eps": 1e-05, "sliding_window": None,
         "tie_word_embeddings": True, "rope_parameters": {
             "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "llama_4_scaling_beta": 0.1}}
MINISTRAL_3B = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                "text_config": _TEXT, "torch_dtype": "bfloat16", "tie_word_embeddings": True}


def test_the_released_vision_model_gives_its_text_model():
    c = model_config_from_hf(MINISTRAL_3B)
    assert (c.architecture, c.family, c.head_size, c.num_hidden_layers) == ("Ministral3ForCausalLM", "ministral3",
                                                                          128, 26)
    assert (c.attn_temperature_scale, c.attn_temperature_length) == (0.1, 16384)
    assert c.rotary_scaling["rope_type"] == "yarn" and c.rotary_scaling["factor"] == 16.0
    assert c.tie_word_embeddings and c.sliding_window is None
    # Mistral Small 3.1 / 3.2's text model is a Mistral; another kind is refused by name
    small = model_config_from_hf({**MINISTRAL_3B, "text_config": {**_TEXT, "model_type": "mistral",
                                                                  "rope_parameters": {"rope_theta": 1e9}}})
    assert small.family == "mistral" and small.attn_temperature_scale is None
    with pytest.raises(CheckpointError, match="text model is a 'mistral4'"):
        model_config_from_hf({**MINISTRAL_3B, "text_config": {**_TEXT, "model_type": "mistral4"}})


def test_gguf_keys_give_the_same_model():
    """llama.cpp's Ministral3Model writes YaRN (with the log multiplier) and the temperature's beta; the length is
    YaRN's original context, as llama.cpp takes it."""
    meta = {f"mistral3.{k}": v for k, v in {
        "embedding_length": 3072, "attention.head_count": 32, "attention.head_count_kv": 8, "block_count": 26,
        "feed_forward_length": 9216, "rope.freq_base": 1e6, "attention.key_length": 128, "context_length": 262144,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 16384,
        "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
        "rope.scaling.yarn_log_multiplier": 1.0, "attention.temperature_scale": 0.1}.items()}
    shapes = {"token_embd.weight": (131072, 3072)}
    got = model_config_from_hf(hf_config(meta, "mistral3", GGUF_ARCHITECTURES["mistral3"], shapes, {}))
    want = model_config_from_hf(MINISTRAL_3B)
    for field in ("family", "rotary_scaling", "attn_temperature_scale", "attn_temperature_length", "head_size"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    no_yarn = {k: v for k, v in meta.items() if ".rope.scaling." not in k}
    with pytest.raises(CheckpointError, match="temperature_scale"):
        hf_config(no_yarn, "mistral3", GGUF_ARCHITECTURES["mistral3"], shapes, {})


def test_the_temperature_is_left_out_of_engines_within_its_length(engine_from_hf, random_hf_model):
    """Below its length the factor is 1: an engine that cannot reach it has no temperature nodes; a longer one
    multiplies q by the table's rows, which step up every `length` positions."""
    import onnx

    from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
    from trtbuild.builder.rope import attn_temperature_table

    hf = random_hf_model("ministral3")  # length 8
    short, long = (engine_from_hf(hf, max_seq_len=n, max_batch_size=2, max_num_tokens=8) for n in (8, 32))
    for engine, temperatures in ((short, 0), (long, 2)):
        model = onnx.load(str(engine / CPU_ENGINE_FILE))
        assert sum(n.name.endswith("q_temperature") for n in model.graph.node) == temperatures
    config = model_config_from_hf(json.loads((hf / "config.json").read_text()))
    assert attn_temperature_table(config, 8) is None
    np.testing.assert_allclose(attn_temperature_table(config, 32).ravel(), 1 + 0.5 * np.log1p(np.arange(32) // 8),
                               rtol=1e-6)


def test_quantized_ministral3_computes_modelopts_simulation(tmp_path):
    assert_computes_simulation(*quantize_random("ministral3", tmp_path, "int4_awq", None))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
