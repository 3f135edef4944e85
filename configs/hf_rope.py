"""The RoPE of a Hugging Face config (configs/from_hf.py): the rotated dimensions, the scaling (linear, llama3,
LongRoPE, YaRN), Gemma 3's per-layer-type parameters and Ministral 3's attention temperature, as ModelConfig reads
them, refusing what the engine cannot run faithfully."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trtbuild.errors import CheckpointError

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rotary_dim(hf: dict[str, Any], rope_params: dict[str, Any], head_size: int) -> int | None:
    """Dimensions RoPE rotates per head when fewer than all (HF: int(head_dim * partial_rotary_factor))."""
    scaling = hf.get("rope_scaling") or rope_params
    factor = float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    dim = int(round(head_size * factor, 6))  # HF: int(head_dim * factor), which 0.1-style factors can round down
    if dim == head_size:
        return None
    if not 0 < dim < head_size or dim % 2:
        raise CheckpointError(f"partial_rotary_factor {factor} rotates {dim} of {head_size} head dimensions; it "
                              "must rotate an even number of them.")
    return dim


def rope_scaling(hf: dict[str, Any], rope_params: dict[str, Any], rotary_dim: int, family: str
                 ) -> dict[str, Any] | None:
    """The checkpoint's `rotary_scaling`: None for plain RoPE, else the HF scaling parameters and their rope_type
    (LongRoPE's: short_factor, long_factor, original_max_position_embeddings, and factor or attention_factor where
    the model gives them; YaRN's: `_yarn_scaling`)."""
    scaling = hf.get("rope_scaling") or rope_params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    # "su": Phi-3's first name for LongRoPE; transformers' Phi3Config reads "yarn" as LongRoPE too
    rope_type = "longrope" if rope_type == "su" or (rope_type == "yarn" and family == "phi3") else rope_type
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are).")
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        return _yarn_scaling(hf, scaling)
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    out["rope_type"] = rope_type
    if rope_type == "longrope":
        out["original_max_position_embeddings"] = int(
            scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
            or hf["max_position_embeddings"])
        for key in ("short_factor", "long_factor"):
            if len(out[key]) != rotary_dim // 2:
                raise CheckpointError(f"rope scaling {key} has {len(out[key])} values; LongRoPE needs one per "
                                      f"rotated pair of the head ({rotary_dim // 2}).")
    return out


def _yarn_scaling(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters as transformers' `_compute_yarn_parameters` reads them, resolved where it resolves them:
    `factor` (required; null: max_position_embeddings over the original context, DeepSeek-V3's form), the original
    context (a top-level `original_max_position_embeddings` wins, as it does in transformers, then the rope dict's,
    then max_position_embeddings), and whichever of beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim
    and truncate the config gives (builder/rope.py applies transformers' defaults to the others)."""
    if "factor" not in scaling:
        raise CheckpointError("rope scaling yarn gives no factor (how many times its original context the model "
                              "runs); transformers requires one too.")
    original = next((d["original_max_position_embeddings"] for d in (hf, scaling)
                     if d.get("original_max_position_embeddings") is not None), hf["max_position_embeddings"])
    if not _is_number(original) or original <= 0 or original != int(original):
        raise CheckpointError(f"rope scaling yarn original_max_position_embeddings must be a positive whole number "
                              f"of positions, got {original!r}.")
    factor = hf["max_position_embeddings"] / original if scaling["factor"] is None else scaling["factor"]
    out = {"rope_type": "yarn", "factor": _yarn_parameter("factor", factor, minimum=0.0),
           "original_max_position_embeddings": int(original)}
    # beta 0 is transformers' default (it reads `beta or default`); a negative one has no correction range
    limits = {"beta_fast": 0.0, "beta_slow": 0.0, "attention_factor": 0.0}
    for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            out[key] = _yarn_parameter(key, scaling[key], limits.get(key), inclusive=key.startswith("beta"))
    if "truncate" in scaling:
        truncate = scaling["truncate"]
        if truncate is not None and not isinstance(truncate, bool):
            raise CheckpointError(f"rope scaling yarn truncate must be true or false, got {truncate!r}.")
        out["truncate"] = bool(truncate)  # transformers reads an explicit null as false: no rounding of the range
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _yarn_parameter(key: str, value: Any, minimum: float | None = None, inclusive: bool = False) -> float:
    """A YaRN parameter as a float, refused unless it is a finite number above `minimum` (or equal, `inclusive`)."""
    if not _is_number(value):
        raise CheckpointError(f"rope scaling yarn {key} must be a number, got {value!r}.")
    if minimum is not None and (value < minimum or (value == minimum and not inclusive)):
        bound = "at least" if inclusive else "above"
        raise CheckpointError(f"rope scaling yarn {key} must be {bound} {minimum:g}, got {value!r}.")
    return float(value)


def rope_parameters(hf: dict[str, Any], family: str) -> tuple[dict[str, Any], float | None]:
    """(the RoPE parameters of the full-attention layers, the sliding layers' base where it differs: Gemma 3's).
    Per-layer-type `rope_parameters` (transformers' current form) or Gemma 3's older `rope_local_base_freq`."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" not in params and family != "gemma3":
        return params, None
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"sliding-attention RoPE of type {local['rope_type']!r} is not supported.")
    full = params.get("full_attention") or {"rope_theta": hf.get("rope_theta") or 1_000_000.0}
    base = local.get("rope_theta") or hf.get("rope_local_base_freq") or (10000.0 if family == "gemma3" else None)
    same = base is None or (base == full.get("rope_theta") and full.get("rope_type", "default") == "default")
    return full, None if same else float(base)


def temperature_fields(rope_params: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3's attention temperature (Llama 4's): its beta, over YaRN's original context."""
    beta = rope_params.get("llama_4_scaling_beta")
    if not beta:
        return {}
    length = rope_params.get("original_max_position_embeddings")
    if not length:
        raise CheckpointError("llama_4_scaling_beta is set but rope_parameters gives no "
                              "original_max_position_embeddings, the length its temperature steps over.")
    return {"attn_temperature_scale": float(beta), "attn_temperature_length": int(length)}


def with_ntk_alpha(hf: dict[str, Any], head_size: int) -> dict[str, Any]:
    """Hunyuan's "dynamic" RoPE with a fixed `alpha` (NTK-aware, as transformers and llama.cpp run it): the base
    theta * alpha ** (d / (d - 2)) with no other scaling; a config without alpha as it is."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not params.get("alpha"):
        return hf
    if params.get("rope_type", params.get("type")) != "dynamic":
        raise CheckpointError(f"rope scaling {params.get('rope_type')!r} with an alpha is not supported.")
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    # NOTE: in float32, as transformers' inverse frequencies and llama.cpp's rope.freq_base hold it
    base = float(np.float32(theta * float(params["alpha"]) ** (head_size / (head_size - 2))))
    return {**hf, "rope_theta": base, "rope_scaling": None, "rope_parameters": {"rope_theta": base}}
