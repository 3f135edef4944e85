"""GLM-4 and ERNIE 4.5: RoPE on interleaved pairs (2i, 2i + 1), GLM-4's over half of each head, run on the engine's
whole-head RoPE by reordering q / k rows at build time; their configs as released; their GGUF files kept quantized;
`trtbuild quantize`. End-to-end parity with transformers is in test_hf_parity.py (ernie4_5, glm4), GGUF round trips
in test_gguf_convert.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.rope import rope_tables, rotary_row_order
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

# zai-org/GLM-4-9B-0414's and baidu/ERNIE-4.5-0.3B-PT's config.json fields that matter here
GLM4_9B = {"architectures": ["Glm4ForCausalLM"], "attention_bias": True, "head_dim": 128, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
           "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
           "eos_token_id": [151329, 151336, 151338], "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151552}
ERNIE_03B = {"architectures": ["Ernie4_5ForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
             "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 131072,
             "model_type": "ernie4_5", "num_attention_heads": 16, "num_hidden_layers": 18, "num_key_value_heads": 2,
             "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 500000, "use_bias": False,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 103424}


def _whole_head_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The engine's RoPE: pairs (i, i + head / 2), cos / sin [positions, head / 2]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


@pytest.mark.parametrize(("head", "rotary"), [(32, 16), (128, 64), (64, 64)])
def test_reordered_rows_on_whole_head_rope_give_interleaved_rope_scores(head, rotary):
    """q . k after the engine's RoPE on reordered q / k rows equals q . k after transformers' GLM RoPE (interleaved
    pairs over the first `rotary` dimensions) on the model's rows, for every pair of positions."""
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb

    config = model_config_from_hf({**GLM4_9B, "hidden_size": 4 * head, "head_dim": head,
                                   "partial_rotary_factor": rotary / head})
    assert config.rotary_interleaved and (config.rotary_dim or head) == rotary
    order = rotary_row_order(head, rotary, interleaved=True)
    assert sorted(order) == list(range(head))
    positions = 64
    cos, sin = (torch.from_numpy(t).double() for t in rope_tables(config, positions))
    assert torch.equal(cos[:, rotary // 2:], torch.ones(positions, (head - rotary) // 2))
    # transformers' tables of the rotated pairs (cat(freqs, freqs), before its repeat_interleave)
    hf_cos, hf_sin = (torch.cat([t[:, : rotary // 2]] * 2, dim=-1)[None] for t in (cos, sin))
    q, k = torch.randn(1, 1, positions, head, dtype=torch.float64), torch.randn(1, 1, positions, head,
                                                                                dtype=torch.float64)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    want = q_hf[0, 0] @ k_hf[0, 0].T
    got = _whole_head_rope(q[0, 0][:, order], cos, sin) @ _whole_head_rope(k[0, 0][:, order], cos, sin).T
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_released_glm4_config():
    c = model_config_from_hf(GLM4_9B)
    assert (c.family, c.rotary_dim, c.rotary_interleaved, c.qkv_bias, c.dense_bias) == ("glm4", 64, True, True, False)
    assert c.output_norms and c.input_norms and not c.tie_word_embeddings and not c.qk_norm
    assert c.eos_token_ids == (151329, 151336, 151338)
    # Glm4Config's defaults where a config leaves them out: half of each head rotated, q / k / v biases
    assert model_config_from_hf({k: v for k, v in GLM4_9B.items() if k not in ("partial_rotary_factor",
                                                                               "attention_bias")}).rotary_dim == 64
    assert model_config_from_hf({**GLM4_9B, "attention_bias": False}).qkv_bias is False


def test_released_ernie_config():
    c = model_config_from_hf(ERNIE_03B)
    assert (c.family, c.head_size, c.q_size, c.rotary_dim, c.rotary_interleaved) == ("ernie4_5", 128, 2048, None,
                                                                                     True)
    assert c.tie_word_embeddings and not c.qkv_bias and not c.output_norms
    assert model_config_from_hf({k: v for k, v in ERNIE_03B.items() if k != "tie_word_embeddings"}
                                ).tie_word_embeddings  # Ernie4_5Config's default
    with pytest.raises(CheckpointError, match="ERNIE 4.5 with use_bias"):
        model_config_from_hf({**ERNIE_03B, "use_bias": True})


@pytest.mark.parametrize("family", ["glm4", "ernie4_5"])
def test_a_quantized_gguf_keeps_its_rows_and_gives_the_dequantized_engine(tmp_path, monkeypatch, family):
    """q / k kept as 4- and 8-bit blocks have their codes, scales and zero points reordered with their rows; GLM-4's
    fused gate + up ffn_up (Q6_K) splits by rows of blocks. The engine gives the dequantized checkpoint's logits."""
    from gguf import GGMLQuantizationType as Q
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
    from helpers import require_shared_models
    from safetensors.torch import load_file
    from test_weight_only import OPTIONS, run

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 64}
    hf = make_hf_folder(family, tmp_path / "hf", overrides=shape)
    up = ("ffn_up", Q.Q6_K) if family == "glm4" else ("ffn_gate", Q.Q6_K)
    qtypes = {f"blk.{i}.{n}.weight": t for i in range(2) for n, t in (("attn_q", Q.Q4_K), ("attn_k", Q.Q4_1),
                                                                         ("attn_v", Q.Q8_0), up)}
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family, qtypes)
    convert(gguf_path, tmp_path / "as_is")
    tensors = load_file(str(tmp_path / "as_is" / "rank0.safetensors"))
    for part in ("attention.q", "attention.k", "mlp.gate"):
        assert tensors[f"transformer.layers.1.{part}.weight"].dtype == torch.uint8, part
    convert(gguf_path, tmp_path / "float", dtype="float32", dequantize=True)
    got = run(build_engine(tmp_path / "as_is", tmp_path / "e_as_is", **OPTIONS))
    want = run(build_engine(tmp_path / "float", tmp_path / "e_float", **OPTIONS))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize(("family", "qformat", "kv", "from_checkpoint"), [
    ("glm4", "int8_sq", "int8", False), ("glm4", "int4_awq", None, True), ("ernie4_5", "fp8", "fp8", True)])
def test_quantized_model_computes_modelopts_simulation(tmp_path, family, qformat, kv, from_checkpoint):
    """GLM-4 calibrates with its fused gate + up MLPs as separate linears (quantize/source.py: SeparateGateUpMLP);
    the engine reorders the exported per-row scales with their q / k rows."""
    assert_computes_simulation(*quantize_random(family, tmp_path, qformat, kv, from_checkpoint=from_checkpoint))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
