"""Granite 4.0's HF configs (`GraniteMoeHybridForCausalLM`; `GraniteMoeSharedForCausalLM`) as the Granite ones they
compute, with their Mamba2 layers (the H- models) as trtbuild's "mamba" layers.

Granite 4.0 Micro, 1B and 350M (and the H- models' attention-only relatives) save as GraniteMoeHybrid with every
layer of type "attention": Granite 3's multipliers, and an MLP named `shared_mlp` (gate and up rows in one
`input_linear`, `output_linear` down) that every token takes, beside experts where the config has them (added to
their output without a gate). So such a config is Granite's (no experts: the shared MLP is the MLP, of
shared_intermediate_size features) or Granite MoE's with an ungated shared expert, and RoPE unless
position_embedding_type says otherwise (then every layer is NoPE). llama.cpp's converter makes the same files of them
(`granite` / `granitemoe` GGUFs). builder/convert/fused.py splits `shared_mlp.input_linear` by rows. The hybrid H-
models' Mamba2 layers become layer type "mamba" with the config's mamba_* fields (plugins/mamba2.py).
"""

from __future__ import annotations

from typing import Any

from trtbuild.errors import CheckpointError

GRANITE4_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM")
_ATTENTION = ("attention", "full_attention")  # a layer type as released, and as transformers 5 saves it
# the mapped config's key holding the Mamba2 layers' ModelConfig fields (some share HF's names, which every
# GraniteMoeHybrid config.json has, Mamba2 layers or not)
MAMBA_FIELDS = "trtbuild_mamba_fields"


def granite4_as_granite(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` as the Granite / Granite MoE config it computes (GRANITE4_ARCHITECTURES), its Mamba2 layers as "mamba"
    layers; any other config as it is."""
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    if not isinstance(archs, list) or not archs or archs[0] not in GRANITE4_ARCHITECTURES:
        return hf
    layers = int(hf["num_hidden_layers"])
    kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or ["attention"] * layers)
    # NOTE: a Mamba2 layer is "mamba" as released, "linear_attention" as transformers 5 saves it
    out = {k: v for k, v in hf.items() if k not in ("layer_types", "layers_block_type")}
    if any(k not in _ATTENTION for k in kinds):
        out.update({MAMBA_FIELDS: _mamba_fields(hf)}, layer_types=["full_attention" if k in _ATTENTION else "mamba"
                                                                   for k in kinds[:layers]])
    shared = int(hf.get("shared_intermediate_size") or 0)
    if not shared:
        raise CheckpointError(f"{archs[0]} without shared_intermediate_size: the config is incomplete.")
    if archs[0] == "GraniteMoeHybridForCausalLM" and hf.get("position_embedding_type") != "rope":
        out["no_rope_layers"] = [0] * layers  # NOTE: transformers builds no rotary embedding for these
    if int(hf.get("num_local_experts") or 0):
        return {**out, "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe",
                "shared_expert_intermediate_size": shared, "shared_expert_gated": False}
    return {**out, "architectures": ["GraniteForCausalLM"], "model_type": "granite", "intermediate_size": shared}


def check_time_step_limit(hf: dict[str, Any]) -> None:
    """Refuse a Mamba2 config whose dt is clamped (time_step_limit other than (0, inf)), which the scan does not do.
    NOTE: transformers saves infinity as {"__float__": "Infinity"}."""
    limit = [float(v["__float__"] if isinstance(v, dict) else v) for v in hf.get("time_step_limit") or (0, "inf")]
    if limit != [0.0, float("inf")]:
        raise CheckpointError(f"time_step_limit {limit} (dt clamped) is not supported; (0, inf) is.")


def _mamba_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The Mamba2 layers' ModelConfig fields (GraniteMoeHybridConfig's defaults where a config leaves them out)."""
    check_time_step_limit(hf)
    heads, inner = int(hf.get("mamba_n_heads") or 128), int(hf.get("mamba_expand") or 2) * int(hf["hidden_size"])
    head_dim = hf.get("mamba_d_head")
    return {"mamba_num_heads": heads, "mamba_head_dim": int(head_dim) if head_dim not in (None, "auto")
            else inner // heads, "mamba_state_size": int(hf.get("mamba_d_state") or 256),
            "mamba_num_groups": int(hf.get("mamba_n_groups") or 1), "conv_kernel": int(hf.get("mamba_d_conv") or 4),
            "mamba_conv_bias": bool(hf.get("mamba_conv_bias", True)),
            "mamba_proj_bias": bool(hf.get("mamba_proj_bias", False))}
