"""The quantized checkpoint's tensor formats (docs/quantization.md) as plain torch: packing, dequantization and the
activation / KV-cache fake quantization an engine must reproduce. No modelopt here: engines and tests import it.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest float8_e4m3fn value
INT8_MAX = 127.0
INT4_MAX = 7.0
PER_TOKEN_MIN_AMAX = 1e-30  # per-token int8: floor of a token's amax, so that an all-zero token has a scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values q in [-8, 7], [out, in] -> uint8 [out, in/2]: q + 8, even input index in the low nibble.

    This is ONNX Runtime MatMulNBits' B layout once reshaped to [out, in/group, group/2].
    """
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of input features, got {q.shape[-1]}")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> int8 [out, in] with values in [-8, 7] (the inverse of `pack_int4`)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_weight(algo: str, weight: torch.Tensor, scale: torch.Tensor, group_size: int | None = None
                      ) -> torch.Tensor:
    """The fp32 [out, in] weight a quantized linear multiplies by (before any prequant scale of its input)."""
    if algo == "fp8":
        return weight.float() * scale.float()
    if algo in ("int8_sq", "int8_wo"):
        return weight.float() * scale.float()[:, None]
    if algo == "int4_awq":
        q = unpack_int4(weight).float()
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
        q = xf.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
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
    return {"fp8": "fp8", "int8_sq": "int8"}.get(algo)


def kv_max(kind: str) -> float:
    """The bound that `kv_cache_scaling_factor = amax / bound` uses for a KV cache dtype."""
    return FP8_MAX if kind == "fp8" else INT8_MAX
