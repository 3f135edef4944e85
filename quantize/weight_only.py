"""The weight_only format of one linear (docs/quantization.md), and round-to-nearest quantization into it.

A weight [out, in] is stored as unsigned codes of `bits` (4 or 8) bits, one float32 scale per group of `group_size`
input features and, optionally, one float32 zero point per group:
    w[o, i] = (code[o, i] - zero_point[o, i // g]) * scale[o, i // g]    (zero point 2^(bits-1) when absent)
Codes are packed as ONNX Runtime's MatMulNBits reads them: 8-bit one per byte; 4-bit two per byte, input 2j in the
low nibble and 2j+1 in the high one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

GROUP_SIZES = (128, 64, 32)  # default group sizes of int4 weights, largest first
_ROWS_PER_CHUNK = 1024  # bounds the float32 temporaries of quantize_rtn to a few of these rows at a time


@dataclass(frozen=True)
class NBitsWeight:
    bits: int
    group_size: int
    codes: np.ndarray  # uint8 [out, in * bits / 8]
    scales: np.ndarray  # float32 [out, in / group_size]
    zero_points: np.ndarray | None = None  # float32 [out, in / group_size]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8 // self.bits

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]."""
        q = unpack_codes(self.codes, self.bits).astype(np.float32)
        zp = np.float32(1 << (self.bits - 1)) if self.zero_points is None else _per_input(self.zero_points, self)
        return (q - zp) * _per_input(self.scales, self)


def _per_input(per_group: np.ndarray, w: NBitsWeight) -> np.ndarray:
    return np.repeat(per_group.astype(np.float32), w.group_size, axis=1)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [out, in] (< 2^bits) -> the packed [out, in * bits / 8]."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return np.ascontiguousarray(codes)
    if bits != 4 or codes.shape[-1] % 2:
        raise ValueError(f"codes pack to 8 bits or to 4 bits with an even number of inputs, not {bits} bits "
                         f"x {codes.shape[-1]} inputs")
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `pack_codes`: uint8 [out, in]."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def default_group_size(in_features: Iterable[int]) -> int | None:
    """The largest of GROUP_SIZES that divides every given input-feature count, or None if none does."""
    sizes = list(in_features)
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in sizes)), None)


def quantize_rtn(w: np.ndarray, bits: int, group_size: int | None) -> NBitsWeight:
    """Symmetric round-to-nearest per group (None: per output channel), as TensorRT-LLM's --use_weight_only:
    scale = max |w| / (2^(bits-1) - 1), code = round(w / scale) + 2^(bits-1). An all-zero group gets scale 1."""
    if bits not in (4, 8):
        raise ValueError(f"weight-only quantization takes 4 or 8 bits, not {bits}")
    out, k = w.shape
    g = k if group_size is None else group_size
    if g < 1 or k % g:
        raise ValueError(f"group size {g} does not divide the {k} input features")
    if bits == 4 and k % 2:
        raise ValueError(f"int4 packs two inputs per byte; {k} input features is odd")
    qmax, zero = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    codes = np.empty((out, k * bits // 8), dtype=np.uint8)
    scales = np.empty((out, k // g), dtype=np.float32)
    for start in range(0, out, _ROWS_PER_CHUNK):
        rows = np.asarray(w[start:start + _ROWS_PER_CHUNK], dtype=np.float32).reshape(-1, k // g, g)
        amax = np.abs(rows).max(axis=-1)
        scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
        q = np.clip(np.rint(rows / scale[..., None]), -qmax, qmax).astype(np.int16) + zero
        codes[start:start + len(rows)] = pack_codes(q.reshape(len(rows), k).astype(np.uint8), bits)
        scales[start:start + len(rows)] = scale
    return NBitsWeight(bits, g, codes, scales)
