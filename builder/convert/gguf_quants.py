"""GGUF quantized tensors -> the nbits weight-only format (builder/convert/weight_only.py), exactly: no requantization.

`raw` is what gguf.GGUFReader gives in `ReaderTensor.data` for a quantized 2-D tensor: uint8 [out, in / block *
type_size], each row a run of ggml blocks (layouts: gguf.quants / ggml-common.h). The block layouts are decoded here
with numpy, row chunk by row chunk. What each type becomes (EXACT_NBITS):

  Q8_0  d * q, q int8, blocks of 32                   8-bit, g 32, code q + 128
  Q4_0  d * (q - 8)                                   4-bit, g 32, code q
  Q5_0  d * (q - 16), q 5-bit                         8-bit, g 32, code q - 16 + 128
  Q6_K  d * sc_j * (q - 32), 16 sub-blocks of 16      8-bit, g 16, code q - 32 + 128, scale d * sc_j
  Q4_1  d * q + m                                     4-bit, g 32, code q, scale d, float zero point -m / d
  Q5_1  d * q + m, q 5-bit                            8-bit, g 32, code q, scale d, float zero point -m / d
  Q4_K  d * sc_j * q - dmin * m_j, 8 sub-blocks of 32 4-bit, g 32, code q, scale d * sc_j, zp dmin * m_j / scale
  Q5_K  as Q4_K, q 5-bit                              8-bit, g 32, code q, scale d * sc_j, zp dmin * m_j / scale
  Q3_K  d * (sc_j - 32) * (q - 4), 16 sub-blocks of 16 4-bit, g 16, code q + 4, scale d * (sc_j - 32)
  Q2_K  d * sc_j * q - dmin * m_j, 16 sub-blocks of 16 4-bit, g 16, code q, scale d * sc_j, zp dmin * m_j / scale
  IQ4_NL d * v[q], v: 16 non-uniform int8 values      8-bit, g 32, code v[q] + 128
  IQ4_XS d * (sc_j - 32) * v[q], 8 sub-blocks of 32   8-bit, g 32, code v[q] + 128, scale d * (sc_j - 32)
  TQ1_0, TQ2_0  d * q, q in -1..1, per 256 (TQ1_0: base-3 digits)  4-bit, g 32, code q + 8, scale d
  MXFP4 2^(e - 128) * v[q], e E8M0, v: e2m1 doubled   8-bit, g 32, code v[q] + 128, scale 2^(e - 128)
  IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: a grid's small integers times a scale per 16 or 32
                                                      8-bit, g 16 / 32, code value + 128 (gguf_lattice.py)
Q8_0, Q4_0, Q5_0, Q6_K, Q3_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4 and the lattice types are bit-exact (the scale
is the float32 product ggml's dequantization computes, times an integer; MXFP4's is ggml's e8m0_to_fp32_half(e),
float32 subnormals for e < 2 included). Types with a minimum go through a float zero point, so they equal ggml's
`d * q + m` to float32 rounding; a block whose scale is 0 (every value = the minimum) is stored exactly as scale =
minimum, zero point -1, codes 0. (The CPU engine's native linears take 2/3/5/6-bit codes back from 4 or 8, IQ types'
and MXFP4's 3- or 4-bit indices and values back from 8-bit codes, and the minimums back from the zero points:
plugins/block_quant_matmul.py.) Float types and every other type give None (the caller keeps them as float)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, MXFP4

from trtbuild.builder.convert.gguf_lattice import LATTICE_TYPES
from trtbuild.builder.convert.weight_only import NBitsWeight, pack_codes, row_chunks

Q = GGMLQuantizationType

# qtype -> (bits, group_size) of the exact nbits form.
EXACT_NBITS: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.Q8_0: (8, 32),
    Q.Q4_0: (4, 32),
    Q.Q4_1: (4, 32),
    Q.Q5_0: (8, 32),
    Q.Q5_1: (8, 32),
    Q.Q4_K: (4, 32),
    Q.Q5_K: (8, 32),
    Q.Q6_K: (8, 16),
    Q.Q3_K: (4, 16),
    Q.Q2_K: (4, 16),
    Q.IQ4_NL: (8, 32),
    Q.IQ4_XS: (8, 32),
    Q.TQ1_0: (4, 32),
    Q.TQ2_0: (4, 32),
    Q.MXFP4: (8, 32),
    **{qtype: (8, group) for qtype, (group, _) in LATTICE_TYPES.items()},
}
_HAS_ZERO_POINT = {Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q2_K}


def has_zero_point(qtype: GGMLQuantizationType) -> bool:
    """Whether the exact nbits form of `qtype` carries float zero points (the types with a minimum)."""
    return qtype in _HAS_ZERO_POINT

# A decoder takes blocks uint8 [n, type_size] and gives codes uint8 [n, block elements] (unpacked, in element order),
# scales float32 [n, groups per block] and zero points (same shape) or None.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [n, 2] (a little-endian float16 per block) -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., k] -> [..., 2k]: the k low nibbles, then the k high nibbles (ggml's order within a run)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _with_minimum(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> Decoded:
    """x = scale * code + minimum per group (codes [n, groups, g]) as (code - zp) * scale with zp = -minimum / scale.
    Groups with scale 0 hold `minimum` everywhere: scale = minimum, zp = -1, codes 0 gives it exactly."""
    zero = scale == 0
    zp = np.where(zero, np.float32(-1), -minimum / np.where(zero, np.float32(1), scale))
    codes[zero] = 0
    return codes.reshape(codes.shape[0], -1), np.where(zero, minimum, scale), zp


def _q8_0(b: np.ndarray) -> Decoded:  # d f16 | qs int8[32]
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None  # int8 q + 128 == its byte with the sign bit flipped


def _q4_0(b: np.ndarray) -> Decoded:  # d f16 | qs[16]: element j low nibble of qs[j], j + 16 the high nibble
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None


def _q5_0(b: np.ndarray) -> Decoded:  # d f16 | qh uint32 (bit j = 5th bit of element j) | qs[16] as Q4_0
    high = np.unpackbits(b[:, 2:6], axis=1, bitorder="little")
    return (_nibbles(b[:, 6:]) | (high << 4)) + np.uint8(128 - 16), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Decoded:  # d f16 | m f16 | qs[16] as Q4_0
    return _with_minimum(_nibbles(b[:, 4:])[:, None, :], _f16(b[:, :2]), _f16(b[:, 2:4]))


def _q5_1(b: np.ndarray) -> Decoded:  # d f16 | m f16 | qh uint32 as Q5_0 | qs[16] as Q4_0
    high = np.unpackbits(b[:, 4:8], axis=1, bitorder="little")
    return _with_minimum((_nibbles(b[:, 8:]) | (high << 4))[:, None, :], _f16(b[:, :2]), _f16(b[:, 2:4]))


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> two uint8 [n, 8]. Bytes 0-3 hold scales 0-3 in their
    low 6 bits, 4-7 minimums 0-3; bytes 8-11 the low 4 bits of scales 4-7 (and minimums 4-7 in the high nibble),
    whose top 2 bits are the top bits of bytes 0-3 (4-7 for the minimums)."""
    sc, mn, low = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = np.concatenate([sc & 0x3F, (low & 0x0F) | ((sc >> 2) & 0x30)], axis=1)
    minimum = np.concatenate([mn & 0x3F, (low >> 4) | ((mn >> 2) & 0x30)], axis=1)
    return scale, minimum


def _q4_k(b: np.ndarray) -> Decoded:  # d f16 | dmin f16 | scales[12] | qs[128]
    sc, m = _k_scale_min(b[:, 4:16])
    scale = _f16(b[:, 0:2]) * sc.astype(np.float32)  # float32 products, as ggml computes them
    minimum = -(_f16(b[:, 2:4]) * m.astype(np.float32))
    # qs: 4 runs of 32 bytes; run r holds sub-block 2r in its low nibbles and 2r + 1 in its high nibbles.
    codes = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _with_minimum(codes, scale, minimum)


def _q5_k(b: np.ndarray) -> Decoded:  # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    sc, m = _k_scale_min(b[:, 4:16])
    scale = _f16(b[:, 0:2]) * sc.astype(np.float32)
    minimum = -(_f16(b[:, 2:4]) * m.astype(np.float32))
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)  # as Q4_K's
    # qh byte l: bit j is the fifth bit of element l of sub-block j
    high = (b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)).transpose(0, 2, 1) & 1
    return _with_minimum(low | (high << 4), scale, minimum)


def _q6_k(b: np.ndarray) -> Decoded:  # ql[128] | qh[64] | scales int8[16] | d f16
    n = b.shape[0]
    # ql: 2 halves of 64 bytes, each giving 128 elements (64 low nibbles, then 64 high); qh: 2 halves of 32 bytes,
    # each giving the top 2 bits of 128 elements in 4 runs of 32 (bits 0-1, 2-3, 4-5, 6-7).
    low = _nibbles(b[:, :128].reshape(n, 2, 64))
    high = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = low | ((high & 0x03) << 4).reshape(n, 2, 128)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(n, 256) + np.uint8(128 - 32), scale, None


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 bytes of 2-bit codes -> uint8 [n, 256]: 2 halves of 32 bytes, each giving 128 elements in 4
    runs of 32 (bits 0-1 of each byte, then 2-3, 4-5, 6-7)."""
    runs = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (runs & 0x03).reshape(-1, 256)


def _q3_k(b: np.ndarray) -> Decoded:  # hmask[32] | qs[64] | scales[12] | d f16
    # scales: 16 6-bit values; bytes 0-7 hold the low 4 bits of scales 0-7 (low nibbles) and 8-15 (high nibbles),
    # bytes 8-11 the top 2 bits, scale j in bits 2 (j // 4) of byte 8 + j % 4
    s = b[:, 96:108]
    low = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=1)
    high = (s[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16) & 0x03
    scale = _f16(b[:, 108:110]) * ((low | (high << 4)).astype(np.float32) - 32)
    # hmask byte l: bit i is the third bit of element 32i + l (ggml subtracts 4 where it is 0: q = ql + 4h - 4)
    third = (b[:, :32, None] >> np.arange(8, dtype=np.uint8)).transpose(0, 2, 1).reshape(-1, 256) & 1
    return _two_bit_runs(b[:, 32:96]) + (third << 2) + np.uint8(8 - 4), scale, None


def _q2_k(b: np.ndarray) -> Decoded:  # scales[16] (scale low nibble, minimum high) | qs[64] | d f16 | dmin f16
    scale = _f16(b[:, 80:82]) * (b[:, :16] & 0x0F).astype(np.float32)
    minimum = -(_f16(b[:, 82:84]) * (b[:, :16] >> 4).astype(np.float32))
    return _with_minimum(_two_bit_runs(b[:, 16:80]).reshape(-1, 16, 16), scale, minimum)


# IQ4_NL / IQ4_XS's 16 values (ggml's kvalues_iq4nl, as gguf keeps them) as 8-bit codes: value + 128
IQ4_CODES = (np.array(IQ4_NL.kvalues) + 128).astype(np.uint8)


def _iq4_nl(b: np.ndarray) -> Decoded:  # d f16 | qs[16] as Q4_0's, indices into the values
    return IQ4_CODES[_nibbles(b[:, 2:])], _f16(b[:, :2]), None


def _iq4_xs(b: np.ndarray) -> Decoded:  # d f16 | scales_h uint16 | scales_l[4] | qs[128]: 8 runs of 16 as IQ4_NL's
    # sub-block j's 6-bit scale: low 4 bits in nibble j % 2 of scales_l[j // 2], top 2 at bits 2j of scales_h
    low = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
    high = (np.ascontiguousarray(b[:, 2:4]).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03
    scale = _f16(b[:, :2]) * ((low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32)
    return IQ4_CODES[_nibbles(b[:, 8:].reshape(-1, 8, 16)).reshape(-1, 256)], scale, None


# MXFP4's 16 values (ggml's kvalues_mxfp4: the e2m1 values doubled, 0 twice) as 8-bit codes: value + 128
MXFP4_CODES = (np.array(MXFP4.kvalues) + 128).astype(np.uint8)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's e8m0_to_fp32_half: uint8 exponents [n, 1] -> float32 2^(e - 128) (half of E8M0's 2^(e - 127), which
    the doubled values make up for). ldexp gives the same bits as ggml's construction for every e: the powers of two
    from 2^-128 (e < 2: float32 subnormals) to 2^127, none of them rounded."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def _mxfp4(b: np.ndarray) -> Decoded:  # e uint8 (E8M0) | qs[16] as Q4_0's, indices into the values
    return MXFP4_CODES[_nibbles(b[:, 1:])], _e8m0_half(b[:, :1]), None


def _ternary(q: np.ndarray, d: np.ndarray) -> Decoded:
    """TQ1_0 / TQ2_0's weights d * q, q in -1..1 [n, 256] (TQ2_0's 2-bit field could also say 2: exact too), as
    4-bit codes q + 8 under d in each group of 32."""
    return (q + 8).astype(np.uint8), np.repeat(d, 256 // 32, axis=1), None


def _tq2_0(b: np.ndarray) -> Decoded:  # qs[64]: 2-bit q + 1, in Q2_K's runs | d f16
    return _ternary(_two_bit_runs(b[:, :64]).astype(np.int8) - 1, _f16(b[:, 64:66]))


_POWERS_OF_3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _tq1_0(b: np.ndarray) -> Decoded:  # qs[48] | qh[4] | d f16: base-3 digits held as fractions of 256
    # byte times 3^j (mod 256) brings digit j to the top; (byte * 3) >> 8 reads it. qs[0:32] hold 5 digits of 32
    # values each, qs[32:48] 5 of 16, qh 4 of 4.
    n = len(b)
    parts = [(b[:, :32, None] * _POWERS_OF_3).transpose(0, 2, 1).reshape(n, 160),
             (b[:, 32:48, None] * _POWERS_OF_3).transpose(0, 2, 1).reshape(n, 80),
             (b[:, 48:52, None] * _POWERS_OF_3[:4]).transpose(0, 2, 1).reshape(n, 16)]
    digits = (np.concatenate(parts, axis=1).astype(np.uint16) * 3) >> 8
    return _ternary(digits.astype(np.int8) - 1, _f16(b[:, 52:54]))


_DECODERS: dict[GGMLQuantizationType, Callable[[np.ndarray], Decoded]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k, Q.Q3_K: _q3_k, Q.Q2_K: _q2_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs, Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0, Q.MXFP4: _mxfp4,
    **{qtype: decode for qtype, (_, decode) in LATTICE_TYPES.items()},
}


def gguf_to_nbits(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> NBitsWeight | None:
    """The raw blocks of one GGUF weight matrix of `shape` [out, in] (reversed GGUF ne) in the nbits format, or None
    when `qtype` has no exact form ONNX Runtime's CPU MatMulNBits runs (not in EXACT_NBITS)."""
    decode = _DECODERS.get(qtype)
    if decode is None:
        return None
    if len(shape) != 2:
        raise ValueError(f"shape must be [out, in], got {tuple(shape)}")
    out_features, in_features = (int(d) for d in shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if out_features <= 0 or in_features <= 0 or in_features % block:
        raise ValueError(f"{qtype.name} needs in_features a positive multiple of {block}, got shape {tuple(shape)}")
    raw = np.asarray(raw)
    row_bytes = in_features // block * type_size
    if raw.dtype != np.uint8 or raw.size != out_features * row_bytes:
        raise ValueError(f"{qtype.name} {[out_features, in_features]} needs uint8 raw blocks of {out_features} x "
                         f"{row_bytes} bytes, got {raw.dtype} {list(raw.shape)}")
    raw = raw.reshape(out_features, row_bytes)
    bits, group = EXACT_NBITS[qtype]
    codes = np.empty((out_features, in_features * bits // 8), dtype=np.uint8)
    scales = np.empty((out_features, in_features // group), dtype=np.float32)
    zero_points = np.empty_like(scales) if qtype in _HAS_ZERO_POINT else None
    for rows in row_chunks(out_features, in_features):
        c, s, z = decode(raw[rows].reshape(-1, type_size))
        c = c.reshape(-1, in_features)
        codes[rows] = pack_codes(c, bits)
        scales[rows] = s.reshape(c.shape[0], -1)
        if zero_points is not None:
            zero_points[rows] = z.reshape(c.shape[0], -1)
    return NBitsWeight(bits, group, codes, scales, zero_points)
