"""RoPE cos/sin tables, computed exactly as Hugging Face computes them (fp32), for positions 0..max_positions-1."""

from __future__ import annotations

import math

import numpy as np
import torch

from trtbuild.configs import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_size
    inv_freq = 1.0 / (config.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rotary_scaling or {}
    kind = scaling.get("rope_type", "default")
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


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, each [max_positions, head_size / 2], float32."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inverse_frequencies(config)[None, :]
    return angles.cos().numpy(), angles.sin().numpy()
