"""Qwen3.5's GGUF files (llama.cpp's `qwen35`): what its converter (Qwen3_5TextModel) wrote, mapped back to
transformers' Qwen3_5ForCausalLM names and config.

Its linear attention layers' hyper-parameters are `ssm.*` keys (state_size: the key head dim, group_count: the key
heads, time_step_rank: the value heads, inner_size: value heads x value head dim), its full attention layers every
`full_attention_interval`-th. Tensors: the decay rates ssm_a = -exp(A_log) as the checkpoint holds them (`A`);
dt_bias as ssm_dt.bias; the
convolution squeezed to [channels, L]; every norm but the gated one (ssm_norm) as 1 + w, which is what the
checkpoint holds. Where there are more value heads than key heads, llama.cpp reorders the value heads from grouped
by key head to tiled ([k0 v0, k1 v0, ..., k0 v1, ...]) in every tensor they index; the checkpoint keeps that order
and says so (`linear_value_heads_tiled`), so quantized blocks stay as they are. Multi-token-prediction blocks (after
the model's layers, `nextn_predict_layers`) are not read.
"""

from __future__ import annotations

from typing import Any

# GGUF layer tensor -> HF name (beside the common ones: norms, attention, MLP)
RENAMES = (("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"), ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
           ("ssm_beta.weight", "linear_attn.in_proj_b.weight"), ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
           ("ssm_conv1d.weight", "linear_attn.conv1d.weight"), ("ssm_a", "linear_attn.A"),
           ("ssm_dt.bias", "linear_attn.dt_bias"), ("ssm_norm.weight", "linear_attn.norm.weight"),
           ("ssm_out.weight", "linear_attn.out_proj.weight"))
LAYER_TENSORS = ("attn_norm.weight", "post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                 "ffn_down.weight")
# Qwen3.5-MoE's: the router and the stacked experts in place of the MLP, a shared expert with its gate beside them
MOE_LAYER_TENSORS = (*LAYER_TENSORS[:2],
                     *(f"ffn_{p}.weight" for p in ("gate_inp", "gate_exps", "up_exps", "down_exps")))
SHARED_EXPERT_TENSORS = tuple(f"ffn_{p}_shexp.weight" for p in ("gate_inp", "gate", "up", "down"))
OPTIONAL_LAYER_TENSORS = (*(f"attn_{p}.weight" for p in ("q", "k", "v", "output", "q_norm", "k_norm")),
                          *(gguf for gguf, _ in RENAMES))


def qwen35_config(meta: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Qwen3_5TextConfig's fields of a qwen35 file, beside the common ones."""
    def key(name: str) -> int:
        return int(meta[f"{prefix}.{name}"])

    layers = key("block_count") - int(meta.get(f"{prefix}.nextn_predict_layers") or 0)
    recurrent = meta.get(f"{prefix}.attention.recurrent_layers")
    interval = int(meta.get(f"{prefix}.full_attention_interval") or 4)
    types = ["linear_attention" if (recurrent[i] if isinstance(recurrent, list) else (i + 1) % interval) else
             "full_attention" for i in range(layers)]
    key_heads, value_heads = key("ssm.group_count"), key("ssm.time_step_rank")
    return {"num_hidden_layers": layers, "layer_types": types, "linear_conv_kernel_dim": key("ssm.conv_kernel"),
            "linear_key_head_dim": key("ssm.state_size"), "linear_num_key_heads": key_heads,
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": key("ssm.inner_size") // value_heads,
            "linear_value_heads_tiled": value_heads != key_heads}
