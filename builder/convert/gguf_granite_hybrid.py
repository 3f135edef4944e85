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
