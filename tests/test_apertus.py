"""Apertus (swiss-ai): Llama with per-head q / k norms, its norms named attention_layernorm / feedforward_layernorm,
and an MLP without a gate whose activation is xIELU with learned scalars per layer (builder/mlp_activation.py).
Logits against transformers: tests/test_hf_parity.py (apertus); GGUF round trip (xIELU's scalars as llama.cpp's
`xielu.*` metadata): tests/test_gguf_convert.py; the cuda plan: tests/test_cuda_target.py."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import require_shared_models
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.convert.convert import convert
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# in the shape of swiss-ai/Apertus-8B-Instruct-2509's config.json
APERTUS_8B = {"architectures": ["ApertusForCausalLM"], "model_type": "apertus", "hidden_size": 4096,
              "intermediate_size": 21504, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "hidden_act": "xielu", "max_position_embeddings": 65536,
              "rms_norm_eps": 1e-5, "vocab_size": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "rope_theta": 12000000, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192}}


def test_the_config_is_llama_with_qk_norms_and_an_ungated_xielu_mlp():
    c = model_config_from_hf(APERTUS_8B)
    assert (c.family, c.hidden_act, c.gated_mlp, c.qk_norm, c.qk_norm_full) == ("apertus", "xielu", False, True, False)
    assert c.rotary_scaling["rope_type"] == "llama3" and c.intermediate_size == 21504


def test_the_checkpoint_holds_each_layer_s_xielu_scalars(tmp_path):
    from trtbuild.builder.convert.checkpoint import load_checkpoint

    hf = make_hf_folder("apertus", tmp_path / "hf")
    convert(hf, tmp_path / "ckpt")
    config, tensors = load_checkpoint(tmp_path / "ckpt")
    from safetensors.numpy import load_file

    source = load_file(str(hf / "model.safetensors"))
    for p in ("alpha_p", "alpha_n", "beta", "eps"):
        got = tensors[f"transformer.layers.1.mlp.act.{p}"]
        assert got.shape == (1,) and str(got.dtype) == "torch.float32"
        np.testing.assert_array_equal(got.numpy(), source[f"model.layers.1.mlp.act_fn.{p}"].reshape(1))


def test_a_gguf_without_its_xielu_scalars_is_refused(tmp_path, monkeypatch):
    import gguf

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("apertus", tmp_path / "hf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_xielu_beta", lambda self, values: None)  # a converter that drops it
    path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "apertus")
    with pytest.raises(CheckpointError, match="lacks xielu.beta \\(a value per layer\\) for its xIELU activation"):
        convert(path, tmp_path / "ckpt")


def test_quantized_apertus_computes_modelopts_simulation(tmp_path):
    """`trtbuild quantize` through transformers' Apertus model: int8_sq linears and an int8 KV cache."""
    assert_computes_simulation(*quantize_random("apertus", tmp_path, "int8_sq", "int8"))
