"""RoPE cos/sin tables, computed exactly as Hugging Face computes them (fp32), for positions 0..max_positions-1."""

from __future__ import annotations

import math

import numpy as np
import torch

from trtbuild.configs import ModelConfig


def inverse_frequencies(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """The rotation speed of each pair of head dimensions, for an engine of `max_positions` positions."""
    dim = config.head_size
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rotary_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        # NOTE: HF picks the long factors per forward, once the sequence passes the original context; an engine's
        # cache must hold one rotation, so the engine's length picks them, as llama.cpp's context size does.
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rotary_base**exponents)
    inv_freq = 1.0 / (config.rotary_base**exponents)
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (LongRoPE's attention scaling; 1 for the other kinds)."""
    scaling = config.rotary_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    return longrope_attention_factor(float(scaling.get("factor") or config.max_position_embeddings / original),
                                     original)


def longrope_attention_factor(factor: float, original_context: int) -> float:
    """LongRoPE's default attention scaling for a context `factor` times the one the model was trained for."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_context))


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each [max_positions, head_size / 2], float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inverse_frequencies(config, max_positions)[None, :]
    scale = attention_factor(config)
    return (angles.cos() * scale).numpy(), (angles.sin() * scale).numpy()
