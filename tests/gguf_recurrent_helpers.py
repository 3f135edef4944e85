"""What llama.cpp's converter writes for the models with recurrent layers, for tests/gguf_helpers.py's
write_gguf_like_llama_cpp: Qwen3.5 (conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel), Granite 4.0-H (conversion/granite.py: GraniteHybridModel; conversion/mamba.py: Mamba2Model) and
Nemotron-H (conversion/nemotron.py: NemotronHModel, a GraniteHybridModel)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch


def add_qwen35_parameters(w: gguf.GGUFWriter, cfg: dict[str, Any], head_dim: int) -> None:
    """Qwen3NextModel.set_gguf_parameters (+ _Qwen35MRopeMixin's rope sections)."""
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    # NOTE: the gguf package here has no add_recurrent_layers yet (llama.cpp's newer one writes this key)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])


def _tiled(x: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """_reorder_v_heads: value heads grouped by key head -> tiled along `axis`."""
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(key_heads, per_key, head_dim, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(x, 0, axis)


def qwen35_tensor(name: str, data: np.ndarray, cfg: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(HF name as llama.cpp maps it, data as it writes it) of one Qwen3.5 tensor."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk
    if hk != hv and "linear_attn." in name:  # _LinearAttentionVReorderBase.modify_tensors
        if ".in_proj_qkv." in name:
            data = np.concatenate([data[:2 * hk * dk], _tiled(data[2 * hk * dk:], 0, hk, r, dv)])
        elif ".in_proj_z." in name:
            data = _tiled(data, 0, hk, r, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            data = _tiled(data, 0, hk, r, 1)
        elif ".conv1d." in name:
            data = np.concatenate([data[:2 * hk * dk], _tiled(data[2 * hk * dk:], 0, hk, r, dv)])
        elif ".out_proj." in name:
            data = _tiled(data, 1, hk, r, dv)
    if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors (in torch, as it: numpy's exp rounds otherwise)
        data = (-torch.exp(torch.from_numpy(data))).numpy()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    return name, data


def add_granite_hybrid_parameters(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """GraniteHybridModel.set_gguf_parameters' own keys (beside GraniteMoeModel's): the Mamba2 mixer's, KV heads per
    layer (none in a Mamba2 layer), and no RoPE in a hybrid."""
    heads, hidden = cfg["mamba_n_heads"], cfg["hidden_size"]
    w.add_ssm_conv_kernel(cfg["mamba_d_conv"])
    w.add_ssm_state_size(cfg["mamba_d_state"])
    w.add_ssm_group_count(cfg["mamba_n_groups"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * hidden)
    w.add_ssm_time_step_rank(heads)
    w.add_head_count_kv([0 if t != "full_attention" else cfg["num_key_value_heads"] for t in cfg["layer_types"]])
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2**20)


def granite_hybrid_tensor(name: str, data: np.ndarray, cfg: dict[str, Any]) -> tuple[str, np.ndarray]:
    """Mamba2Model.modify_tensors: dt_bias named dt_proj.bias, taps squeezed, A (= -exp(A_log)) and D as [heads, 1],
    the norm [groups, inner / groups]."""
    if ".mamba." not in name and ".mixer." not in name:
        return name, data
    if name.endswith(".dt_bias"):
        return name.removesuffix(".dt_bias") + ".dt_proj.bias", data
    if "conv1d.weight" in name:
        return name, data.squeeze()
    if name.endswith((".A_log", ".D")):
        data = data.reshape(-1, 1)
    if name.endswith(("mamba.norm.weight", "mixer.norm.weight")):
        data = data.reshape(cfg.get("mamba_n_groups") or cfg["n_groups"], -1)
    return name, (-torch.exp(torch.from_numpy(data))).numpy() if name.endswith(".A_log") else data


def nemotron_h_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A saved NemotronHConfig with the keys the common writer reads (its layers, the norms' epsilon, a RoPE base
    its attention does not use: TextModel writes 10000)."""
    return {**cfg, "num_hidden_layers": len(cfg["layers_block_type"]), "rms_norm_eps": cfg["layer_norm_epsilon"],
            "rope_theta": 10000.0}


def add_nemotron_h_parameters(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """NemotronHModel.set_gguf_parameters (after GraniteHybridModel's): the Mamba2 mixer's keys, and per layer its
    KV heads (an attention layer's) and feed-forward features (an MLP layer's)."""
    kinds = cfg["layers_block_type"]
    w.add_ssm_conv_kernel(cfg["conv_kernel"])
    w.add_ssm_state_size(cfg["ssm_state_size"])
    w.add_ssm_group_count(cfg["n_groups"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    w.add_head_count_kv([cfg["num_key_value_heads"] if k == "full_attention" else 0 for k in kinds])
    w.add_feed_forward_length([cfg["intermediate_size"] if k == "mlp" else 0 for k in kinds])
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2**20)


def mamba2_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A saved Mamba2Config as NemotronHConfig's keys (add_nemotron_h_parameters), with the common keys Mamba2Model
    writes: no attention heads, no feed-forward features."""
    return nemotron_h_hf_config({
        **{k: v for k, v in cfg.items() if k != "head_dim"}, "layers_block_type": ["mamba"] * cfg["num_hidden_layers"],
        "mamba_num_heads": cfg["num_heads"], "mamba_head_dim": cfg["head_dim"], "ssm_state_size": cfg["state_size"],
        "num_attention_heads": 0, "num_key_value_heads": 0, "intermediate_size": 0})
