"""Phi-3's differences from Llama, each against transformers or as a clear refusal: LongRoPE's two factor sets and
attention scaling, the sliding window, fused projections, and partial rotary embeddings (Phi-4-mini), which run on the
engine's whole-head RoPE with q / k rows reordered. End-to-end parity is in test_hf_parity.py, GGUF files in
test_gguf_convert.py."""

from __future__ import annotations

import copy

import pytest
import torch

from trtbuild.builder.convert.fused import split_fused
from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.builder.rope import (
    EngineRotaryRows,
    attention_factor,
    inverse_frequencies,
    rope_tables,
    rotary_row_order,
)
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 256, "rope_theta": 10000.0,
        "sliding_window": 2047, "rope_scaling": {"type": "longrope", "short_factor": [1 + i / 16 for i in range(8)],
                                                 "long_factor": [1 + 2 * i for i in range(8)]}}


@pytest.mark.parametrize("max_positions", [256, 257, 4096])
def test_longrope_matches_transformers_for_the_engine_length(max_positions):
    """The engine's length picks the factors (long past the original context), as HF does per forward."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = model_config_from_hf(PHI3)
    hf = Phi3Config(**copy.deepcopy(PHI3))  # it fills in the rope dict it is given
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=max_positions)
    assert torch.equal(inverse_frequencies(config, max_positions), want)
    assert attention_factor(config) == pytest.approx(scale, rel=1e-12) and scale > 1
    short, long = (inverse_frequencies(config, n) for n in (256, 257))
    assert not torch.equal(short, long)


def test_an_explicit_attention_factor_wins():
    config = model_config_from_hf({**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "attention_factor": 1.25}})
    assert attention_factor(config) == 1.25


def test_phi3_honours_its_sliding_window_and_phi4_has_none():
    assert model_config_from_hf(PHI3).sliding_window == 2047
    assert model_config_from_hf({**PHI3, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize(("edit", "message"), [
    ({"partial_rotary_factor": 0.3125, "rope_scaling": None},
     "partial_rotary_factor 0.3125 rotates 5 of 16 head dimensions; it must rotate an even number"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 8}},
     "short_factor has 4 values; LongRoPE needs one per rotated pair of the head \\(8\\)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic' is not supported"),
])
def test_what_the_engine_cannot_run_is_refused_with_the_reason(edit, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf({**PHI3, **edit})


def test_fused_projections_split_by_rows_and_a_wrong_shape_is_refused():
    config = model_config_from_hf(PHI3)
    qkv = torch.arange(128 * 64, dtype=torch.float32).reshape(128, 64)  # q 64 rows, k 32, v 32
    gate_up = -torch.arange(192 * 64, dtype=torch.float32).reshape(192, 64)
    sources = {"model.layers.0.self_attn.qkv_proj.weight": SourceTensor((128, 64), lambda: qkv),
               "model.layers.0.mlp.gate_up_proj.weight": SourceTensor((192, 64), lambda: gate_up),
               "model.norm.weight": SourceTensor((64,), lambda: torch.ones(64))}
    split = split_fused(sources, config)
    assert list(split) == [f"model.layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj", "mlp.gate_proj",
                                                                     "mlp.up_proj")] + ["model.norm.weight"]
    assert torch.equal(split["model.layers.0.self_attn.k_proj.weight"].load(), qkv[64:96])
    assert torch.equal(split["model.layers.0.mlp.up_proj.weight"].load(), gate_up[96:])
    assert split["model.layers.0.self_attn.v_proj.weight"].shape == (32, 64)
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight has shape \[120, 64\]; the config makes it \[128"):
        split_fused({"model.layers.0.self_attn.qkv_proj.weight": SourceTensor((120, 64), lambda: qkv)}, config)


def _rotate_half_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int) -> torch.Tensor:
    """HF Phi-3: rotate_half on the first `rotary` dimensions, the rest passed through."""
    rot, rest = x[..., :rotary], x[..., rotary:]
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    turned = torch.cat([-rot[..., rotary // 2:], rot[..., : rotary // 2]], -1)
    return torch.cat([rot * c + turned * s, rest], -1)


@pytest.mark.parametrize(("head", "rotary"), [(16, 8), (128, 96), (96, 64)])
def test_reordered_rows_on_whole_head_rope_give_partial_rope_scores(head, rotary):
    """q . k after the engine's RoPE (pairs (i, i + head / 2), the tables' cos 1 / sin 0 past the rotated pairs) on
    reordered q / k rows equals HF's partial rotary q . k, for every pair of positions."""
    config = model_config_from_hf({**PHI3, "hidden_size": 4 * head, "partial_rotary_factor": rotary / head,
                                   "rope_scaling": None, "sliding_window": None})
    assert config.rotary_dim == rotary
    order = rotary_row_order(head, rotary)
    assert sorted(order) == list(range(head))
    cos, sin = (torch.from_numpy(t) for t in rope_tables(config, 64))
    assert torch.equal(cos[:, rotary // 2:], torch.ones(64, (head - rotary) // 2))
    inv = inverse_frequencies(config, 64)
    angles = torch.arange(64.0)[:, None] * inv[None, :]
    q, k = torch.randn(64, head, dtype=torch.float64), torch.randn(64, head, dtype=torch.float64)
    want = _rotate_half_partial(q, angles.cos(), angles.sin(), rotary) @ \
        _rotate_half_partial(k, angles.cos(), angles.sin(), rotary).T
    got = _rotate_half_partial(q[:, order], cos, sin, head) @ _rotate_half_partial(k[:, order], cos, sin, head).T
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_partial_rotary_rows_reorder_q_k_outputs_only():
    config = model_config_from_hf({**PHI3, "partial_rotary_factor": 0.5, "rope_scaling": None})  # 8 of 16 rotated
    order = torch.from_numpy(rotary_row_order(16, 8))
    t = {"transformer.layers.0.attention.q.weight": torch.arange(64 * 64.0).reshape(64, 64),
         "transformer.layers.0.attention.k.weights_scaling_factor": torch.arange(32.0),
         "transformer.layers.0.attention.k.prequant_scaling_factor": torch.arange(64.0),
         "transformer.layers.0.attention.v.weight": torch.arange(32 * 64.0).reshape(32, 64)}
    rows = EngineRotaryRows(t, config)
    q = rows["transformer.layers.0.attention.q.weight"]
    for h in range(4):
        assert torch.equal(q[16 * h: 16 * h + 16], t["transformer.layers.0.attention.q.weight"][16 * h + order])
    assert torch.equal(rows["transformer.layers.0.attention.k.weights_scaling_factor"][16:], 16 + order.float())
    for same in ("transformer.layers.0.attention.k.prequant_scaling_factor", "transformer.layers.0.attention.v.weight"):
        assert torch.equal(rows[same], t[same])
    assert set(rows) == set(t) and len(rows) == 4


def test_the_quantizers_mistral_form_holds_partial_rotary_q_k_rows_in_the_engines_order():
    """Only q and k rows move, per head, as the builder moves them; the Mistral config gets no partial rotary."""
    from trtbuild.quantize.source import _as_mistral

    hf = {**PHI3, "partial_rotary_factor": 0.5, "rope_scaling": None}  # 4 heads of 16 over 2, 8 dims rotated
    qkv, gate_up = torch.randn(128, 64), torch.randn(192, 64)
    mistral, split = _as_mistral(hf, {"model.layers.0.self_attn.qkv_proj.weight": qkv,
                                      "model.layers.0.mlp.gate_up_proj.weight": gate_up})
    order = torch.from_numpy(rotary_row_order(16, 8))
    assert "partial_rotary_factor" not in mistral and mistral["rope_parameters"]["rope_type"] == "default"
    for h in range(4):
        assert torch.equal(split["model.layers.0.self_attn.q_proj.weight"][16 * h: 16 * h + 16], qkv[16 * h + order])
    for h in range(2):
        assert torch.equal(split["model.layers.0.self_attn.k_proj.weight"][16 * h: 16 * h + 16],
                           qkv[64 + 16 * h + order])
    assert torch.equal(split["model.layers.0.self_attn.v_proj.weight"], qkv[96:])
    assert torch.equal(split["model.layers.0.mlp.gate_proj.weight"], gate_up[:96])


def test_a_gguf_with_one_longrope_factor_set_is_refused():
    import numpy as np

    from trtbuild.builder.convert.gguf_rope import rope_scaling as _rope_scaling

    cfg = {"max_position_embeddings": 4096, "head_dim": 16, "rope_theta": 10000.0}
    with pytest.raises(CheckpointError, match="rope_factors_long.weight and rope_factors_short.weight but not the "
                                              "other; LongRoPE needs both"):
        _rope_scaling({}, "phi3", {"rope_factors_long.weight": np.ones(8, np.float32)}, cfg)
