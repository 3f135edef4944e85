"""The blockwise weight-only format ("nbits") that ONNX Runtime's com.microsoft::MatMulNBits runs, and symmetric
round-to-nearest quantization into it (TensorRT-LLM's `--use_weight_only`). numpy only: no torch, no modelopt.

One linear's weight [out, in] with `bits` in {4, 8} and `group_size` g (dividing in; g == in is per output channel):
  codes        uint8 [out, in * bits / 8]: unsigned codes; 4-bit packs input 2j in the low nibble, 2j+1 in the high
               nibble (MatMulNBits' B once reshaped to [out, in/g, g*bits/8]); 8-bit one code per byte
  scales       float32 [out, in / g]
  zero_points  float32 [out, in / g] or None (the default zero point 2^(bits-1))
  w[o, i] = (code[o, i] - zp[o, i // g]) * scale[o, i // g]   in float32

MatMulNBits wants g a power of two >= 16 (`with_group_size` re-blocks a per-channel weight); on CPU it takes float
zero points for 4 bits only (8-bit float zero points are refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtbuild.quantization import INT4_ZERO_POINT, pack_int4, unpack_int4

NBITS = (4, 8)
GROUP_SIZES = (128, 64, 32)  # default group sizes of int4 weights, largest first
CHUNK_ELEMENTS = 1 << 22  # weights per row chunk: bounds the float32 intermediates to ~16 MiB each


def row_chunks(rows: int, row_elements: int) -> Iterator[slice]:
    """Slices over `rows` rows of `row_elements` values each, about CHUNK_ELEMENTS values per slice."""
    step = max(1, CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _check_bits(bits: int) -> None:
    if bits not in NBITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [out, in] (< 2^bits) -> uint8 [out, in * bits / 8] (4-bit: input 2j in the low nibble)."""
    _check_bits(bits)
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [out, in], got shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"{bits}-bit codes must lie in [0, {(1 << bits) - 1}]")
    codes = codes.astype(np.uint8, copy=False)
    if bits == 8:
        return np.ascontiguousarray(codes)
    if codes.shape[1] % 2:
        raise ValueError(f"4-bit packing needs an even number of input features, got {codes.shape[1]}")
    return _pack4(codes)


def _pack4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, in] already in [0, 15] -> [rows, in / 2], no checks: the int4 packing of code - 8."""
    return pack_int4(codes.view(np.int8) - INT4_ZERO_POINT)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [out, in * bits / 8] -> uint8 codes [out, in] (the inverse of `pack_codes`)."""
    _check_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim != 2:
        raise ValueError(f"packed codes must be uint8 [out, in*bits/8], got {packed.dtype} {packed.shape}")
    if bits == 8:
        return packed
    return (unpack_int4(packed) + INT4_ZERO_POINT).view(np.uint8)


@dataclass(frozen=True, eq=False)  # eq=False: == on numpy fields would be ambiguous
class NBitsWeight:
    """One linear's weight in the nbits format (module docstring). Shapes and dtypes are checked on creation."""

    bits: int
    group_size: int
    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if self.codes.dtype != np.uint8 or self.codes.ndim != 2:
            raise ValueError(f"codes must be uint8 [out, in*bits/8], got {self.codes.dtype} {self.codes.shape}")
        g = self.group_size
        if not isinstance(g, int | np.integer) or g <= 0 or self.in_features % g:
            raise ValueError(f"group_size {g!r} does not divide in_features {self.in_features}")
        want = (self.out_features, self.in_features // g)
        if self.scales.dtype != np.float32 or self.scales.shape != want:
            raise ValueError(f"scales must be float32 {list(want)}, got {self.scales.dtype} {list(self.scales.shape)}")
        zp = self.zero_points
        if zp is not None and (zp.dtype != np.float32 or zp.shape != want):
            raise ValueError(f"zero_points must be float32 {list(want)} or None, got {zp.dtype} {list(zp.shape)}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 8 // self.bits

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]: (code - zero point) * scale, per group."""
        out = np.empty((self.out_features, self.in_features), dtype=np.float32)
        groups, g = self.in_features // self.group_size, self.group_size
        for rows in row_chunks(self.out_features, self.in_features):
            q = unpack_codes(self.codes[rows], self.bits).astype(np.float32).reshape(-1, groups, g)
            zp = np.float32(1 << (self.bits - 1)) if self.zero_points is None else self.zero_points[rows, :, None]
            q -= zp
            q *= self.scales[rows, :, None]
            out[rows] = q.reshape(-1, self.in_features)
        return out

    def with_group_size(self, group_size: int) -> NBitsWeight:
        """The same weight with smaller groups (group_size must divide the current one): scales and zero points
        repeated, codes unchanged - e.g. a per-channel weight re-blocked for MatMulNBits (powers of two >= 16)."""
        if group_size <= 0 or self.group_size % group_size:
            raise ValueError(f"group_size {group_size} does not divide the current group size {self.group_size}")
        reps = self.group_size // group_size
        zp = None if self.zero_points is None else np.repeat(self.zero_points, reps, axis=1)
        return NBitsWeight(self.bits, group_size, self.codes, np.repeat(self.scales, reps, axis=1), zp)


def default_group_size(in_features: Iterable[int]) -> int | None:
    """The largest of GROUP_SIZES that divides every given input-feature count, or None if none does."""
    sizes = list(in_features)
    return next((g for g in GROUP_SIZES if all(k % g == 0 for k in sizes)), None)


def _float32_rows(w: Any, rows: slice) -> np.ndarray:
    """Rows of a numpy array or a torch tensor (any float dtype, bfloat16 included) as float32 numpy."""
    part = w[rows]
    return part.float().numpy() if hasattr(part, "float") else part.astype(np.float32)


def quantize_rtn(w: Any, bits: int, group_size: int | None = None) -> NBitsWeight:
    """Symmetric round-to-nearest weight-only quantization of w [out, in] (TensorRT-LLM `--use_weight_only`); w is a
    numpy array or a torch tensor, converted to float32 a chunk of rows at a time.

    Per group of `group_size` inputs (None: one group per output channel): scale = amax / (2^(bits-1) - 1) (1 for
    an all-zero group), code = clip(rint(w / scale), -qmax, qmax) + 2^(bits-1) (round half to even), no zero point.
    """
    _check_bits(bits)
    if not hasattr(w, "float"):
        w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    floating = w.is_floating_point() if hasattr(w, "float") else np.issubdtype(w.dtype, np.floating)
    if not floating:
        raise ValueError(f"w must be a floating-point array, got {w.dtype}")
    out_features, in_features = tuple(w.shape)
    g = in_features if group_size is None else group_size
    if not isinstance(g, int | np.integer) or g <= 0 or in_features % g:
        raise ValueError(f"group_size {group_size!r} must be a positive divisor of in_features {in_features}")
    if bits == 4 and in_features % 2:
        raise ValueError(f"4-bit packing needs an even number of input features, got {in_features}")
    qmax, zero = np.float32((1 << (bits - 1)) - 1), np.float32(1 << (bits - 1))
    groups = in_features // g
    codes = np.empty((out_features, in_features * bits // 8), dtype=np.uint8)
    scales = np.empty((out_features, groups), dtype=np.float32)
    for rows in row_chunks(out_features, in_features):
        x = _float32_rows(w, rows).reshape(-1, groups, g)
        if not np.isfinite(x).all():
            raise ValueError(f"w has non-finite values in rows {rows.start}..{rows.stop - 1}")
        scale = np.abs(x).max(axis=-1) / qmax
        scale[scale == 0] = 1  # an all-zero group (or a subnormal amax whose scale underflows)
        x /= scale[..., None]
        np.rint(x, out=x)
        np.clip(x, -qmax, qmax, out=x)
        x += zero
        q = x.astype(np.uint8).reshape(-1, in_features)
        codes[rows] = q if bits == 8 else _pack4(q)
        scales[rows] = scale
    return NBitsWeight(bits, g, codes, scales, None)
