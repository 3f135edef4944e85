"""Phi-3's differences from Llama, each against transformers or as a clear refusal: LongRoPE's two factor sets and
attention scaling, the sliding window, fused projections, and partial rotary embeddings (Phi-4-mini), which the
engine does not run. End-to-end parity is in test_hf_parity.py, GGUF files in test_gguf_convert.py."""

from __future__ import annotations

import copy

import pytest
import torch

from trtbuild.builder.convert.fused import split_fused
from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.builder.rope import attention_factor, inverse_frequencies
from trtbuild.configs.model_config import model_config_from_hf
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
    ({"partial_rotary_factor": 0.75}, "partial rotary embeddings"),
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
