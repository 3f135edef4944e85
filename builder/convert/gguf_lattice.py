"""GGUF's lattice types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) as 8-bit codes, exactly.

Each run of 4 or 8 weights is one entry of a fixed grid of small integers (ggml's grids, as `gguf.quants` keeps
them), with signs, times a scale per 16 or 32 weights. So every weight is a float32 scale times an integer, and
these types become 8-bit codes (integer + 128) with float32 scales, bit-exact (the scale is the float32 product
ggml's dequantization computes; d is the block's float16, s a sub-block's 3- or 4-bit scale):

  IQ2_XXS  d * (0.5 + s) * 0.25 * ±{8, 25, 43}           8 sub-blocks of 32
  IQ2_XS   as IQ2_XXS (a 9-bit grid)                      16 sub-blocks of 16
  IQ2_S    as IQ2_XXS (a 10-bit grid, signs as bits)      16 sub-blocks of 16
  IQ3_XXS  d * (0.5 + s) * 0.5 * ±{4, 12, .., 52, 62}     8 sub-blocks of 32
  IQ3_S    d * (1 + 2 s) * ±{1, 3, .., 15}                8 sub-blocks of 32
  IQ1_S    d * (1 + 2 s) * (g ± 1/8), g in {-1, 0, 1}     8 sub-blocks of 32: as d * (1 + 2 s) / 8 * (8 g ± 1)
  IQ1_M    as IQ1_S, the sign of 1/8 per 8 weights        16 sub-blocks of 16

Their codes take 16 values or fewer (IQ1 and IQ2: 6), and the CPU engine holds them as 4- or 3-bit indices into a
codebook of them (plugins/block_quant_matmul.py: compact): more bits a weight than the file's lattice (IQ2_XXS 3.31
against 2.06), a tenth of float32's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS

Q = GGMLQuantizationType
Decoded = tuple[np.ndarray, np.ndarray, None]  # codes uint8 [n, 256], scales float32 [n, sub-blocks], no zero points

# ggml's ksigns_iq2xs: a 7-bit index -> 8 sign bits (the eighth makes their count even), as 0/1 per weight
_KSIGNS = np.unpackbits(np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)[:, None], axis=1, bitorder="little")
_SIGN_INDICES = np.array([0, 7, 14, 21], dtype=np.uint32)  # four 7-bit sign indices in a uint32


@cache
def _grid(kind: type) -> np.ndarray:
    """gguf's grid of a lattice type as int16 [entries, values per entry]."""
    kind.init_grid()
    return kind.grid.reshape(kind.grid_shape).astype(np.int16)


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] (a little-endian float16 per block) -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")


def _nibble_pairs(b: np.ndarray) -> np.ndarray:
    """uint8 [n, k] -> [n, 2k]: byte j's low nibble, then its high one."""
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(len(b), -1)


def _plus_128(values: np.ndarray) -> np.ndarray:
    """Small signed integers [n, ...] as 8-bit codes v + 128 [n, 256]."""
    return (values.reshape(len(values), -1) + 128).astype(np.uint8)


def _codes(magnitudes: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """Signed integers given as |v| and sign bits (of one size) as 8-bit codes v + 128 [n, 256]."""
    return _plus_128(np.where(negative.reshape(magnitudes.shape).astype(bool), -magnitudes, magnitudes))


def _half_step(d: np.ndarray, s: np.ndarray, step: float) -> np.ndarray:
    """ggml's d * (0.5 + s) * step, in float32."""
    return d * (np.float32(0.5) + s.astype(np.float32)) * np.float32(step)


def _iq2_xxs(b: np.ndarray) -> Decoded:  # d | 8 x (uint32: 4 grid indices; uint32: 4 sign indices, scale at 28)
    n = len(b)
    words = _u32(b[:, 2:66]).reshape(n, 8, 2)
    magnitudes = _grid(IQ2_XXS)[np.ascontiguousarray(b[:, 2:66]).reshape(n, 8, 8)[:, :, :4]]  # [n, 8, 4, 8]
    signs = _KSIGNS[(words[:, :, 1:] >> _SIGN_INDICES) & 0x7F]
    return _codes(magnitudes, signs), _half_step(_f16(b[:, :2]), words[:, :, 1] >> 28, 0.25), None


def _iq2_xs(b: np.ndarray) -> Decoded:  # d | uint16[32]: 9-bit grid index, 7-bit sign index | scales[8] nibbles
    q = np.ascontiguousarray(b[:, 2:66]).view("<u2")
    return (_codes(_grid(IQ2_XS)[q & 511], _KSIGNS[q >> 9]),
            _half_step(_f16(b[:, :2]), _nibble_pairs(b[:, 66:74]), 0.25), None)


def _iq2_s(b: np.ndarray) -> Decoded:  # d | qs[32] | sign bits[32] | qh[8]: index bits 8-9 | scales[8] nibbles
    high = (b[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 0x03
    index = b[:, 2:34].astype(np.uint16) | (high.reshape(len(b), 32).astype(np.uint16) << 8)
    signs = np.unpackbits(b[:, 34:66], axis=1, bitorder="little")
    return (_codes(_grid(IQ2_S)[index], signs),
            _half_step(_f16(b[:, :2]), _nibble_pairs(b[:, 74:82]), 0.25), None)


def _iq3_xxs(b: np.ndarray) -> Decoded:  # d | qs[64] grid indices (4 values each) | uint32[8]: signs, scale at 28
    n = len(b)
    words = _u32(b[:, 66:98])
    magnitudes = _grid(IQ3_XXS)[b[:, 2:66]].reshape(n, 8, 4, 8)
    signs = _KSIGNS[(words[:, :, None] >> _SIGN_INDICES) & 0x7F]
    return _codes(magnitudes, signs), _half_step(_f16(b[:, :2]), words >> 28, 0.5), None


def _iq3_s(b: np.ndarray) -> Decoded:  # d | qs[64] | qh[8]: index bit 8 | sign bits[32] | scales[4] nibbles
    high = np.unpackbits(b[:, 66:74], axis=1, bitorder="little").astype(np.uint16)
    index = b[:, 2:66].astype(np.uint16) | (high << 8)
    signs = np.unpackbits(b[:, 74:106], axis=1, bitorder="little")
    scale = _f16(b[:, :2]) * (1 + 2 * _nibble_pairs(b[:, 106:110])).astype(np.float32)
    return _codes(_grid(IQ3_S)[index], signs), scale, None


def _eighths(g: np.ndarray, negative_delta: np.ndarray) -> np.ndarray:
    """IQ1's g ± 1/8 (g in -1, 0, 1), times 8: codes 8 g ± 1 + 128 [n, 256]."""
    return _plus_128(8 * g + np.where(negative_delta, -1, 1).astype(np.int16))


def _iq1_s(b: np.ndarray) -> Decoded:  # d | qs[32] | uint16[8]: 4 x 3 index bits, scale at 12, delta sign at 15
    n = len(b)
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")
    high = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
    g = _grid(IQ1_S)[b[:, 2:34].reshape(n, 8, 4).astype(np.uint16) | (high << 8)]  # [n, 8, 4, 8]
    dl = _f16(b[:, :2]) * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    return _eighths(g, (qh & 0x8000 != 0)[:, :, None, None]), dl * np.float32(0.125), None


def _iq1_m(b: np.ndarray) -> Decoded:  # qs[32] | qh[16]: 2 x (3 index bits, delta sign) | uint16[4]: scales, d
    sc = np.ascontiguousarray(b[:, 48:56]).view("<u2")
    # d: the top nibbles of the four scale words, low to high
    d = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000))
    d = d.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
    s = ((sc[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7).reshape(len(b), 16)
    qh = ((b[:, 32:48, None] >> np.array([0, 4], dtype=np.uint8)) & 0x0F).reshape(len(b), 32)
    g = _grid(IQ1_M)[b[:, :32].astype(np.uint16) | ((qh & 7).astype(np.uint16) << 8)]  # [n, 32, 8]
    dl = d * (2 * s + 1).astype(np.float32)
    return _eighths(g, (qh & 8 != 0)[:, :, None]), dl * np.float32(0.125), None


# qtype -> (weights per scale, decoder)
LATTICE_TYPES: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], Decoded]]] = {
    Q.IQ2_XXS: (32, _iq2_xxs), Q.IQ2_XS: (16, _iq2_xs), Q.IQ2_S: (16, _iq2_s), Q.IQ3_XXS: (32, _iq3_xxs),
    Q.IQ3_S: (32, _iq3_s), Q.IQ1_S: (32, _iq1_s), Q.IQ1_M: (16, _iq1_m),
}
