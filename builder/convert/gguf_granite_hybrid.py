"""Granite 4.0-H's GGUF files (llama.cpp's `granitehybrid`): what its converter (GraniteHybridModel, with Mamba2Model's
tensors) wrote, mapped back to transformers' GraniteMoeHybrid names and config, which configs/granite4.py reads.

Its Mamba2 layers are the layers with no KV heads (`attention.head_count_kv`, one value a layer); their
hyper-parameters are `ssm.*` keys (time_step_rank: the heads, inner_size: heads x head dim, state_size, group_count,
conv_kernel). Tensors: ssm_in (z, x | B | C, dt), ssm_conv1d (squeezed, with its bias), ssm_dt.bias, the decay rates
ssm_a = -exp(A_log) and the skip ssm_d (each [heads, 1]), the gated norm ssm_norm ([groups, inner / groups]), ssm_out.
The shared MLP is ffn_gate / up / down, or the _shexp tensors beside experts. A file without RoPE
(`rope.scaling.finetuned` false: every H- model) attends without positions (NoPE).
"""

from __future__ import annotations

from typing import Any

from trtbuild.builder.convert.gguf_rope import f32

RENAMES = (("ssm_in.weight", "mamba.in_proj.weight"), ("ssm_conv1d.weight", "mamba.conv1d.weight"),
           ("ssm_conv1d.bias", "mamba.conv1d.bias"), ("ssm_dt.bias", "mamba.dt_bias"), ("ssm_a", "mamba.A"),
           ("ssm_d", "mamba.D"), ("ssm_norm.weight", "mamba.norm.weight"), ("ssm_out.weight", "mamba.out_proj.weight"))
LAYER_TENSORS = ("attn_norm.weight", "ffn_norm.weight")
OPTIONAL_LAYER_TENSORS = (*(f"attn_{p}.weight" for p in ("q", "k", "v", "output")), *(g for g, _ in RENAMES),
                          *(f"ffn_{p}.weight" for p in ("gate", "up", "down", "gate_inp", "gate_exps", "up_exps",
                                                        "down_exps", "gate_shexp", "up_shexp", "down_shexp")))


def granite_hybrid_config(meta: dict[str, Any], prefix: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """GraniteMoeHybridConfig's fields of a granitehybrid file, beside the common ones."""
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{prefix}.{name}", default)

    layers = int(key("block_count"))
    kv = key("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    experts = int(key("expert_count") or 0)
    # NOTE: the MLPs' features from the tensors: the keys llama.cpp writes differ between dense and expert files
    first = {name.split(".", 2)[2]: shape for name, shape in shapes.items() if name.startswith("blk.")}
    shared = first.get("ffn_gate_shexp.weight" if experts else "ffn_gate.weight", (0,))[0]
    return {"layer_types": ["mamba" if not n else "attention" for n in kv], "shared_intermediate_size": shared,
            "intermediate_size": first["ffn_gate_exps.weight"][1] if experts else shared,
            "num_local_experts": experts, "num_experts_per_tok": int(key("expert_used_count") or 0),
            "position_embedding_type": "rope" if key("rope.scaling.finetuned") else "nope",
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_d_state": int(key("ssm.state_size")),
            "mamba_n_groups": int(key("ssm.group_count")), "mamba_d_conv": int(key("ssm.conv_kernel")),
            "mamba_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in shapes), "mamba_proj_bias": False}


# Nemotron-H (llama.cpp's `nemotron_h`, written by a GraniteHybridModel): one block per GGUF layer as in the HF
# checkpoint, named back to its `mixer.*` (builder/convert/nemotron_h.py pairs them into trtbuild's layers); the
# layers' kinds from the KV heads (attention) and feed-forward features (MLP) each layer has
NEMOTRON_H_RENAMES = (("attn_norm.weight", "norm.weight"),
                      *((g, "mixer." + hf.removeprefix("mamba.")) for g, hf in RENAMES),
                      *((f"attn_{p}.weight", f"mixer.{p}_proj.weight") for p in "qkv"),
                      ("attn_output.weight", "mixer.o_proj.weight"),
                      ("ffn_up.weight", "mixer.up_proj.weight"), ("ffn_down.weight", "mixer.down_proj.weight"))
NEMOTRON_H_TENSORS = tuple(g for g, _ in NEMOTRON_H_RENAMES)


def nemotron_h_config(meta: dict[str, Any], prefix: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """NemotronHConfig's fields of a nemotron_h file (its layer pattern as hybrid_override_pattern)."""
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{prefix}.{name}", default)

    layers = int(key("block_count"))
    kv, ff = key("attention.head_count_kv"), key("feed_forward_length")
    kv, ff = (v if isinstance(v, list) else [v] * layers for v in (kv, ff))
    experts = bool(key("expert_count"))
    pattern = "".join("*" if kv[j] else ("E" if experts else "-") if ff[j] else "M" for j in range(layers))
    ssm = mamba2_config(meta, prefix, shapes)
    return {"hybrid_override_pattern": pattern, "intermediate_size": max(ff), "mamba_num_heads": ssm["num_heads"],
            "mamba_head_dim": ssm["head_dim"], "ssm_state_size": ssm["state_size"], "mlp_hidden_act": "relu2",
            **{k: ssm[k] for k in ("n_groups", "conv_kernel", "use_conv_bias", "layer_norm_epsilon")}}


def mamba2_config(meta: dict[str, Any], prefix: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Mamba2Config's fields of a file's ssm.* keys: a `mamba2` file's config (Mamba2 layers only, named as
    Nemotron-H's: NEMOTRON_H_RENAMES)."""
    heads, inner = int(meta[f"{prefix}.ssm.time_step_rank"]), int(meta[f"{prefix}.ssm.inner_size"])
    return {"num_heads": heads, "head_dim": inner // heads, "state_size": int(meta[f"{prefix}.ssm.state_size"]),
            "n_groups": int(meta[f"{prefix}.ssm.group_count"]), "conv_kernel": int(meta[f"{prefix}.ssm.conv_kernel"]),
            "use_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in shapes),
            "layer_norm_epsilon": f32(meta.get(f"{prefix}.attention.layer_norm_rms_epsilon") or 1e-5)}
