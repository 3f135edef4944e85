"""NVIDIA's Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 4B / 8B, Nemotron Nano 9B v2) as trtbuild's layers.

Its layers each hold one block behind one norm: a Mamba2 mixer ("M", `linear_attention` in transformers 5), an
attention without RoPE ("*", `full_attention`), or an MLP without a gate, relu(x)^2 ("-", `mlp`). trtbuild's layers
are a mixer (attention or Mamba2) then an MLP, so each mixer starts a layer and the MLP right after it (if any)
completes it: the mixer's norm is the layer's input_layernorm, the MLP's its post_layernorm, and a mixer with no MLP
after it makes a layer without one (`mlp_free_layers`). builder/convert/nemotron_h.py renames the tensors to match.
Mixtures of experts (Nemotron 3's "E" layers) are refused.

A Mamba2 model (`Mamba2ForCausalLM`: Codestral Mamba, mamba2-130m ... 2.7b) has the same tensors and is built as a
Nemotron-H of Mamba2 layers only, none with an MLP (`mamba2_as_nemotron_h`).
"""

from __future__ import annotations

from typing import Any

from trtbuild.configs.granite4 import MAMBA_FIELDS, check_time_step_limit
from trtbuild.errors import CheckpointError

ARCHITECTURE = "NemotronHForCausalLM"
MAMBA2_ARCHITECTURE = "Mamba2ForCausalLM"
_MIXERS = {"M": "mamba", "mamba": "mamba", "linear_attention": "mamba", "*": "full_attention",
           "attention": "full_attention", "full_attention": "full_attention"}
_MLPS = ("-", "mlp")


def hf_layer_types(hf: dict[str, Any]) -> list[str]:
    """The HF layers' kinds: `layers_block_type` / `layer_types`, or the characters of `hybrid_override_pattern`."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types") or list(hf.get("hybrid_override_pattern") or "")
    if not kinds:
        raise CheckpointError(f"{ARCHITECTURE} without layers_block_type or hybrid_override_pattern: the config is "
                              "incomplete.")
    return list(kinds)


def mamba2_as_nemotron_h(hf: dict[str, Any]) -> dict[str, Any]:
    """A Mamba2Config's fields under NemotronHConfig's names: every layer a Mamba2 mixer. NOTE: the model has no
    attention and no MLP: its (unused) attention fields only shape the pool's rows, which its convolutions' rows fill,
    and its MLP width is a placeholder."""
    heads = int(hf.get("num_heads", 128))
    head_dim = int(hf.get("head_dim") or int(hf.get("expand", 2)) * int(hf["hidden_size"]) // heads)
    return {**hf, "layers_block_type": ["mamba"] * int(hf["num_hidden_layers"]), "mamba_num_heads": heads,
            "mamba_head_dim": head_dim, "ssm_state_size": int(hf.get("state_size", 128)),
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": head_dim, "intermediate_size": 1}


def nemotron_h_as_hybrid(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` as trtbuild's layers (see the module's docstring) with its Mamba2 fields; any other config as it is."""
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    if not isinstance(archs, list) or not archs or archs[0] not in (ARCHITECTURE, MAMBA2_ARCHITECTURE):
        return hf
    if archs[0] == MAMBA2_ARCHITECTURE:
        hf = mamba2_as_nemotron_h(hf)
    types, mlp_free = [], []
    for kind in hf_layer_types(hf):
        if kind in _MIXERS:
            types.append(_MIXERS[kind])
            mlp_free.append(len(types) - 1)
        elif kind in _MLPS and mlp_free and mlp_free[-1] == len(types) - 1:
            mlp_free.pop()
        elif kind in _MLPS:
            raise CheckpointError(f"this {ARCHITECTURE} has an MLP layer that follows no mixer; trtbuild builds "
                                  "patterns whose MLP layers each follow a Mamba2 or attention layer.")
        else:
            raise CheckpointError(f"this {ARCHITECTURE} has {kind!r} layers (experts: Nemotron 3), which trtbuild "
                                  "does not build; the dense Nemotron-H models build.")
    check_time_step_limit(hf)
    heads = int(hf["mamba_num_heads"])
    head_dim = int(hf.get("mamba_head_dim") or int(hf.get("expand", 2)) * int(hf["hidden_size"]) // heads)
    mamba = {"mamba_num_heads": heads, "mamba_head_dim": head_dim,
             "mamba_state_size": int(hf.get("ssm_state_size", 128)), "mamba_num_groups": int(hf.get("n_groups", 8)),
             "conv_kernel": int(hf.get("conv_kernel", 4)), "mamba_conv_bias": bool(hf.get("use_conv_bias", True)),
             "mamba_proj_bias": bool(hf.get("use_bias", False))}
    out = {k: v for k, v in hf.items() if k not in ("layers_block_type", "layer_types", "hybrid_override_pattern")}
    return {**out, "num_hidden_layers": len(types), "layer_types": types, "mlp_free_layers": mlp_free,
            "no_rope_layers": [0] * len(types), "hidden_act": hf.get("mlp_hidden_act", "relu2"),
            "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)), MAMBA_FIELDS: mamba}
