"""RoPE cos/sin tables, computed exactly as Hugging Face computes them (fp32), for positions 0..max_positions-1, and
the q/k row order that lets partial and interleaved rotary embeddings run on the engine's whole-head RoPE.

The engine rotates the pairs (i, i + head_size / 2) of every head (NeoX / HF rotate_half layout). A model that
rotates only its first `rotary_dim` dimensions pairs (i, i + rotary_dim / 2) and passes the rest through; an
interleaved one (GPT-J style: GLM-4, ERNIE 4.5) pairs (2i, 2i + 1). q . k is the same under any one reordering of
both q's and k's dimensions, so the builder reorders each q and k head's rows (`rotary_row_order`) to put the rotated
pairs where the engine rotates and the others on pairs whose cos is 1 and sin 0; v and the attention's output keep
their order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from trtbuild.configs import ModelConfig


def rotary_dim(config: ModelConfig) -> int:
    return config.rotary_dim or config.head_size


def inverse_frequencies(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """The rotation speed of each rotated pair of head dimensions, for an engine of `max_positions` positions."""
    dim = rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rotary_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        # NOTE: HF picks the long factors per forward, once the sequence passes the original context; an engine's
        # cache must hold one rotation, so the engine's length picks them, as llama.cpp's context size does.
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rotary_base**exponents)
    if kind == "yarn":
        return _yarn_inverse_frequencies(config, exponents)
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


def yarn_factor(config: ModelConfig) -> float:
    """How many times its original context a YaRN model runs (transformers: max_position_embeddings over the
    original context where the config's factor is null; configs/from_hf.py resolves it so already)."""
    scaling = config.rotary_scaling or {}
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return config.max_position_embeddings / int(scaling["original_max_position_embeddings"])


def _yarn_inverse_frequencies(config: ModelConfig, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: each pair's speed blended from the original one (fast pairs, which turn beta_fast times or more over the
    original context) and the one interpolated by the factor (slow pairs, beta_slow turns or fewer), with a linear
    ramp between. The operations and their order are transformers', so that the fp32 result is identical."""
    scaling, dim, base = config.rotary_scaling or {}, rotary_dim(config), config.rotary_base
    low, high = _yarn_ramp_bounds(scaling, dim, base)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # each pair's share of its original speed
    speeds = base**exponents
    return 1.0 / (yarn_factor(config) * speeds) * (1 - kept) + 1.0 / speeds * kept


def _yarn_ramp_bounds(scaling: Mapping[str, Any], dim: int, base: float) -> tuple[float, float]:
    """The pair indices where YaRN's ramp starts (beta_fast turns over the original context) and ends (beta_slow
    turns), rounded outwards unless `truncate` is false (gpt-oss), clipped to the head.

    NOTE: llama.cpp (ggml_rope_yarn_corr_dims) always rounds them outwards, so it runs a truncate: false model
    (gpt-oss) slightly differently from transformers; this follows transformers."""
    original = int(scaling["original_max_position_embeddings"])

    def pair_turning(turns: float) -> float:  # the (fractional) pair that turns `turns` times over the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = pair_turning(scaling.get("beta_fast") or 32)
    high = pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_attention_factor(scaling: Mapping[str, Any], factor: float) -> float:
    """YaRN's attention scaling: the config's attention_factor, else mscale(factor) = 0.1 ln(factor) + 1 (1 for a
    factor up to 1), or with both mscale and mscale_all_dim given (DeepSeek) mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), each weighting the log by its value."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    weight, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(weight) / mscale(all_dims) if weight and all_dims else mscale(1)


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (LongRoPE's and YaRN's attention scaling; 1 for the other kinds)."""
    scaling = config.rotary_scaling or {}
    if scaling.get("rope_type") == "yarn":
        return yarn_attention_factor(scaling, yarn_factor(config))
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
    """cos and sin, each [max_positions, head_size / 2], float32; pairs past the rotated ones have cos 1, sin 0."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inverse_frequencies(config, max_positions)[None, :]
    scale = attention_factor(config)
    passed = config.head_size // 2 - angles.shape[1]
    cos = torch.cat([angles.cos() * scale, torch.ones(max_positions, passed)], dim=1)
    sin = torch.cat([angles.sin() * scale, torch.zeros(max_positions, passed)], dim=1)
    return cos.numpy(), sin.numpy()


def attn_temperature_table(config: ModelConfig, max_positions: int) -> np.ndarray | None:
    """[max_positions, 1] float32: what q is multiplied by at each position (Ministral 3's attention temperature,
    1 + scale * log(1 + floor(position / length)), computed in float64), or None where every position lies below
    the length (the factor is 1 there) or the model has none."""
    scale, length = config.attn_temperature_scale, config.attn_temperature_length
    if scale is None or max_positions <= length:
        return None
    steps = np.floor(np.arange(max_positions, dtype=np.float64) / length)
    return (1.0 + scale * np.log1p(steps)).astype(np.float32)[:, None]


def rotary_row_order(head_size: int, rotary: int, interleaved: bool = False) -> np.ndarray:
    """Engine dimension n of a head holds model dimension order[n]: the model's rotated pairs ((i, i + rotary / 2),
    or (2i, 2i + 1) where `interleaved`) on the engine's pairs (i, i + head_size / 2) for i < rotary / 2, the
    passed-through dimensions on the remaining pairs."""
    half, r = head_size // 2, rotary // 2
    firsts, seconds = ((np.arange(0, rotary, 2), np.arange(1, rotary, 2)) if interleaved
                       else (np.arange(r), np.arange(r, rotary)))
    passed = np.arange(rotary, head_size)
    return np.concatenate([firsts, passed[: half - r], seconds, passed[half - r:]])


def reorders_rotary_rows(config: ModelConfig) -> bool:
    """Whether the model's q / k rows need `EngineRotaryRows` (partial or interleaved RoPE)."""
    return config.rotary_dim is not None or config.rotary_interleaved


_ROTATED = re.compile(r"^transformer\.layers\.\d+\.attention\.([qk])(_norm)?\.(weight|bias|weights_scaling_factor|"
                      r"weights_zero_point|lora_b)$")


class EngineRotaryRows(Mapping):
    """A checkpoint's tensors with every q and k head's output rows (and q / k norm weights) in `rotary_row_order`:
    weights, biases and the per-row scales and zero points of quantized linears; their input-side scales keep
    their order. Lazy: a tensor is reordered when it is looked up."""

    def __init__(self, tensors: Mapping[str, Any], config: ModelConfig, inverse: bool = False) -> None:
        """`inverse`: the other way, from the engine's row order back to the model's (tensors computed on
        reordered rows, as the quantizer's)."""
        self.tensors, self.config = tensors, config
        order = rotary_row_order(config.head_size, rotary_dim(config), config.rotary_interleaved)
        self.order = np.argsort(order) if inverse else order

    def __getitem__(self, name: str) -> Any:
        t = self.tensors[name]
        m = _ROTATED.match(name)
        if m is None or t.ndim == 0:
            return t
        heads = self.config.num_attention_heads if m.group(1) == "q" else self.config.num_key_value_heads
        d = self.config.head_size
        if m.group(2):  # a per-head norm weight [head_size]
            return t[torch.from_numpy(self.order)]
        if t.shape[0] != heads * d:
            return t
        rows = (np.arange(heads)[:, None] * d + self.order[None, :]).ravel()
        return t[torch.from_numpy(rows)]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getattr__(self, attr: str) -> Any:  # a lazy file's header lookups (dtype, shape): the order keeps them
        if attr in ("tensors", "config", "order"):  # not yet set (copy, pickle)
            raise AttributeError(attr)
        return getattr(self.tensors, attr)
