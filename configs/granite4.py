"""Granite 4.0's HF configs (`GraniteMoeHybridForCausalLM`; `GraniteMoeSharedForCausalLM`) as the Granite ones they
compute, where they have no Mamba2 layers.

Granite 4.0 Micro, 1B and 350M (and the H- models' attention-only relatives) save as GraniteMoeHybrid with every
layer of type "attention": Granite 3's multipliers, and an MLP named `shared_mlp` (gate and up rows in one
`input_linear`, `output_linear` down) that every token takes, beside experts where the config has them (added to
their output without a gate). So such a config is Granite's (no experts: the shared MLP is the MLP, of
shared_intermediate_size features) or Granite MoE's with an ungated shared expert, and RoPE unless
position_embedding_type says otherwise (then every layer is NoPE). llama.cpp's converter makes the same files of them
(`granite` / `granitemoe` GGUFs). builder/convert/fused.py splits `shared_mlp.input_linear` by rows.
"""

from __future__ import annotations

from typing import Any

from trtbuild.errors import CheckpointError

GRANITE4_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM")
_ATTENTION = ("attention", "full_attention")  # a layer type as released, and as transformers 5 saves it


def granite4_as_granite(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` as the Granite / Granite MoE config it computes (GRANITE4_ARCHITECTURES); any other config as it is.
    Mamba2 layers are refused with what builds instead."""
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    if not isinstance(archs, list) or not archs or archs[0] not in GRANITE4_ARCHITECTURES:
        return hf
    layers = int(hf["num_hidden_layers"])
    kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or ["attention"] * layers)
    mamba = sum(k not in _ATTENTION for k in kinds)  # "mamba" as released, "linear_attention" in transformers 5
    if archs[0] == "GraniteMoeHybridForCausalLM" and mamba:
        raise CheckpointError(f"this Granite 4.0 model is a hybrid: {mamba} of its {layers} layers are Mamba2 "
                              "layers, which trtbuild does not build; Granite 4.0's attention-only models (Micro, "
                              "1B, 350M) build.")
    out = {k: v for k, v in hf.items() if k not in ("layer_types", "layers_block_type")}
    shared = int(hf.get("shared_intermediate_size") or 0)
    if not shared:
        raise CheckpointError(f"{archs[0]} without shared_intermediate_size: the config is incomplete.")
    if archs[0] == "GraniteMoeHybridForCausalLM" and hf.get("position_embedding_type") != "rope":
        out["no_rope_layers"] = [0] * layers  # NOTE: transformers builds no rotary embedding for these
    if int(hf.get("num_local_experts") or 0):
        return {**out, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                "shared_expert_intermediate_size": shared, "shared_expert_gated": False}
    return {**out, "architectures": ["GraniteForCausalLM"], "model_type": "granite", "intermediate_size": shared}
