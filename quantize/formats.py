"""The quantized checkpoint's tensor formats (docs/quantization.md) as plain torch: dequantization and the
activation / KV-cache fake quantization an engine must reproduce. No modelopt here: engines and tests import it.
Format names, limits and int4 packing are trtbuild.quantization's.
"""

from __future__ import annotations

import torch

from trtbuild.quantization import (
    FP8_E4M3_MAX,
    INT8_MAX,
    PER_TOKEN_MIN_AMAX,
    KVCacheQuantAlgo,
    QuantAlgo,
    unpack_int4_torch,
)


def dequantize_weight(algo: str, weight: torch.Tensor, scale: torch.Tensor, group_size: int | None = None
                      ) -> torch.Tensor:
    """The fp32 [out, in] weight a quantized linear multiplies by (before any prequant scale of its input)."""
    if algo == QuantAlgo.FP8:
        return weight.float() * scale.float()
    if algo in (QuantAlgo.INT8_SQ, QuantAlgo.INT8_WO):
        return weight.float() * scale.float()[:, None]
    if algo == QuantAlgo.INT4_AWQ:
        q = unpack_int4_torch(weight).float()
        out, in_features = q.shape
        group = group_size or 128
        w = q.view(out, in_features // group, group) * scale.float()[:, :, None]
        return w.view(out, in_features)
    raise ValueError(f"unknown quantization {algo!r}")


def fake_quant(x: torch.Tensor, scale: torch.Tensor, kind: str, narrow: bool = False) -> torch.Tensor:
    """Quantize `x` with a per-tensor `scale` to `kind` ("fp8" or "int8") and back, in x's dtype.

    fp8: cast(x / scale) to e4m3 (saturating at ±448); int8: round-half-even(x / scale) clipped to [-128, 127], or
    [-127, 127] when `narrow` (the KV cache).
    """
    s = scale.float()
    xf = x.float() / s
    if kind == "fp8":
        q = xf.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    elif kind == "int8":
        q = xf.round().clamp(-INT8_MAX if narrow else -INT8_MAX - 1, INT8_MAX)
    else:
        raise ValueError(f"unknown activation quantization {kind!r}")
    return (q * s).to(x.dtype)


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """The dynamic int8 scale of each token (last axis): max |x| / 127 in float32, [..., 1]; an all-zero token gets
    a tiny positive scale (it quantizes to zeros)."""
    return x.float().abs().amax(dim=-1, keepdim=True).clamp_min(PER_TOKEN_MIN_AMAX) / INT8_MAX


def activation_kind(algo: str) -> str | None:
    """How a linear's input is quantized: fp8 (fp8), int8 (int8_sq), None (int4_awq and int8_wo are weight-only)."""
    return {QuantAlgo.FP8: "fp8", QuantAlgo.INT8_SQ: "int8"}.get(algo)


def kv_max(kind: str) -> float:
    """The bound that `kv_cache_scaling_factor = amax / bound` uses for a KV cache dtype."""
    return float(FP8_E4M3_MAX if kind == KVCacheQuantAlgo.FP8 else INT8_MAX)
