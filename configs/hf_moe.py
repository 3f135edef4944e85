"""A mixture of experts' fields of an HF config (configs/from_hf.py), per family."""

from __future__ import annotations

from typing import Any

from trtbuild.errors import CheckpointError

# family -> (the config's field with an expert's features, whether the router's weights are renormalized over the
# chosen experts unless norm_topk_prob says otherwise)
# (Granite MoE takes the softmax of the chosen experts' logits: the renormalized one)
_MOE_FAMILIES = {"qwen3_moe": ("moe_intermediate_size", False), "mixtral": ("intermediate_size", True),
                 "olmoe": ("intermediate_size", False), "granitemoe": ("intermediate_size", True),
                 "qwen2_moe": ("moe_intermediate_size", False), "gpt_oss": ("intermediate_size", True),
                 "lfm2_moe": ("moe_intermediate_size", True), "afmoe": ("moe_intermediate_size", True),
                 "qwen3_5_moe": ("moe_intermediate_size", True)}


def moe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """A mixture of experts' ModelConfig fields, refusing the variants the engine does not build: dense layers among
    the expert ones (Qwen3-MoE's mlp_only_layers / decoder_sparse_step) and OLMoE's clipped q / k / v."""
    if family not in _MOE_FAMILIES:
        return {}
    features_key, normalize = _MOE_FAMILIES[family]
    experts = hf.get("num_experts") or hf["num_local_experts"]  # NOTE: transformers 5 saves Qwen3-MoE's as the latter
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
        raise CheckpointError("this mixture of experts has dense MLP layers among its expert layers "
                              "(mlp_only_layers / decoder_sparse_step); trtbuild builds models whose every layer "
                              "has experts.")
    if hf.get("clip_qkv"):
        raise CheckpointError(f"clip_qkv={hf['clip_qkv']} (q / k / v clipped) is not supported.")
    return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf[features_key]),
            "moe_normalize_topk": bool(hf.get("norm_topk_prob", normalize)),
            "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
            "shared_expert_gated": bool(hf.get("shared_expert_gated", True)),
            "moe_bias": family == "gpt_oss", **_sigmoid_routing(hf, family)}


def _sigmoid_routing(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """LFM2-MoE's and AFMoE's experts: chosen by sigmoid scores plus a selection bias after leading dense layers,
    weighted by the renormalized sigmoids times a scale; AFMoE's shared experts beside them, added ungated."""
    if family == "lfm2_moe":
        return {"moe_dense_layers": int(hf.get("num_dense_layers", 2)), "moe_scoring": "sigmoid",
                "moe_selection_bias": bool(hf.get("use_expert_bias", True)),
                "moe_routed_scale": float(hf.get("routed_scaling_factor") or 1.0)}
    if family == "afmoe":
        shared = int(hf.get("num_shared_experts") or 0) * int(hf["moe_intermediate_size"])
        return {"moe_dense_layers": int(hf.get("num_dense_layers", 1)), "moe_scoring": "sigmoid",
                "moe_selection_bias": True, "moe_routed_scale": float(hf.get("route_scale") or 1.0),
                "shared_expert_intermediate_size": shared, "shared_expert_gated": False}
    return {}
