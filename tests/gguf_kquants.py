"""Round-to-nearest encoders for GGUF's Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS blocks, which the `gguf`
package can read but not write, and random valid blocks of its lattice types (IQ1-IQ3).

They make valid files for tests and benchmarks (not llama.cpp's error-minimising search): `gguf.quants.dequantize`
of their output is the reference any reader must reproduce. Input: float32 [rows, cols], cols a multiple of 256 (of
32 for IQ4_NL).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL

QK_K = 256


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(little-endian float16 bytes [..., 2], the float32 value they hold)."""
    h = np.asarray(x, dtype=np.float16)
    return h[..., None].view(np.uint8).reshape(*h.shape, 2), h.astype(np.float32)


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK_K:
        raise ValueError(f"K-quants need [rows, cols] with cols a multiple of {QK_K}, got {x.shape}")
    return x.reshape(-1, QK_K)


def _scale_min(b: np.ndarray, levels: int, sub_levels: int) -> tuple:
    """Per sub-block b [n, subs, size]: x ~ d * sc_j * q - dmin * m_j, q in [0, levels], sc and m in [0, sub_levels].
    Returns (d bytes, dmin bytes, sc uint8 [n, subs], m uint8 [n, subs], q uint8 [n, subs, size])."""
    lo, hi = np.minimum(b.min(-1), 0.0), np.maximum(b.max(-1), 0.0)
    scale, minimum = (hi - lo) / levels, -lo
    d_raw, d = _f16(scale.max(-1) / sub_levels)
    dmin_raw, dmin = _f16(minimum.max(-1) / sub_levels)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0,
                 sub_levels)
    m = np.clip(np.rint(np.divide(minimum, dmin[:, None], out=np.zeros_like(minimum), where=dmin[:, None] > 0)),
                0, sub_levels)
    eff_scale, eff_min = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.divide(b + eff_min, eff_scale, out=np.zeros_like(b), where=eff_scale > 0)
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8)
    return d_raw, dmin_raw, sc.astype(np.uint8), m.astype(np.uint8), q


def _scale_min_blocks(x: np.ndarray, levels: int) -> tuple:
    """Q4_K / Q5_K's common part: per 32-value block x ~ d * sc_j * q - dmin * m_j, q in [0, levels]. Returns
    (d bytes, dmin bytes, the 12 packed 6-bit scale / minimum bytes, q uint8 [n, 8, 32])."""
    d_raw, dmin_raw, sc, m, q = _scale_min(_blocks(x).reshape(-1, 8, 32), levels, 63)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)
    return d_raw, dmin_raw, scales, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] -> qs [n, 128]: chunk c holds block 2c in its low nibbles and block 2c + 1 in its high ones."""
    return ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(-1, 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 144]: x ~ d * sc_j * q - dmin * m_j per 32-value block."""
    d_raw, dmin_raw, scales, q = _scale_min_blocks(x, 15)
    return np.concatenate([d_raw, dmin_raw, scales, _low_nibbles(q)], axis=1).reshape(np.asarray(x).shape[0], -1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 176]: as Q4_K with 5-bit q, whose fifth bits are qh[32]:
    bit j of byte l is that of value l of block j."""
    d_raw, dmin_raw, scales, q = _scale_min_blocks(x, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # [n, 32]
    return np.concatenate([d_raw, dmin_raw, scales, qh, _low_nibbles(q)], axis=1).reshape(np.asarray(x).shape[0],
                                                                                         -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 210]: x ~ d * sc_j * (q - 32) per 16-value block."""
    rows = np.asarray(x).shape[0]
    b = _blocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31.0
    d_raw, d = _f16(scale.max(-1) / 127.0)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [block, half, group in half, value]
    low, high = u & 0x0F, u >> 4
    # ql byte h*64 + s*32 + l holds value l of group h*4 + s in its low nibble and of group h*4 + 2 + s in its high
    # one; qh byte h*32 + l holds the top 2 bits of value l of groups h*4 + k at bits 2k
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d_raw], axis=1).reshape(rows, -1)


def _two_bit_runs(q: np.ndarray) -> np.ndarray:
    """q [n, 256] (values < 4) -> qs [n, 64]: half h, byte l holds values 128h + 32s + l at bits 2s."""
    runs = q.reshape(-1, 2, 4, 32)
    return (runs[:, :, 0] | (runs[:, :, 1] << 2) | (runs[:, :, 2] << 4) | (runs[:, :, 3] << 6)).reshape(-1, 64)


def encode_q3_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 110]: x ~ d * (sc_j - 32) * (q - 4) per 16-value block,
    q in [0, 7]: hmask[32] (bit i of byte l: q's third bit, of value 32i + l), qs[64] (the low 2 bits, as Q2_K's),
    12 bytes of 6-bit scales, d."""
    rows = np.asarray(x).shape[0]
    sub = _blocks(x).reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 4.0
    d_raw, d = _f16(scale.max(-1) / 31.0)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -32, 31)
    eff = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(np.divide(sub, eff, out=np.zeros_like(sub), where=eff != 0)), -4, 3) + 4).astype(np.uint8)
    q = q.reshape(-1, 256)
    hmask = ((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    u = (sc + 32).astype(np.uint8)  # [n, 16], 6 bits
    low = (u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4)
    high = u >> 4  # scale j's top 2 bits at bits 2 (j // 4) of byte j % 4
    top = (high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)).astype(np.uint8)
    return np.concatenate([hmask, _two_bit_runs(q & 0x03), low, top, d_raw], axis=1).reshape(rows, -1)


def encode_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 84]: x ~ d * sc_j * q - dmin * m_j per 16-value block,
    q in [0, 3]: 16 bytes of 4-bit scales (low nibbles) and minimums, qs[64], d, dmin."""
    rows = np.asarray(x).shape[0]
    d_raw, dmin_raw, sc, m, q = _scale_min(_blocks(x).reshape(-1, 16, 16), 3, 15)
    return np.concatenate([sc | (m << 4), _two_bit_runs(q.reshape(-1, 256)), d_raw, dmin_raw],
                          axis=1).reshape(rows, -1)


IQ4_VALUES = np.array(IQ4_NL.kvalues, dtype=np.float32)


def _iq4_indices(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest of the 16 IQ4 values to x / scale, as 4-bit indices (x [..., 32], scale [..., 1])."""
    v = np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)
    return np.abs(v[..., None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """indices [..., 32] -> [..., 16]: value j in the low nibble of byte j, j + 16 in the high one (as Q4_0)."""
    return q[..., :16] | (q[..., 16:] << 4)


def encode_iq4_nl(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 32 * 18]: x ~ d * v[q] per 32-value block."""
    x = np.asarray(x, dtype=np.float32)
    rows = x.shape[0]
    b = x.reshape(-1, 32)
    d_raw, d = _f16(np.abs(b).max(-1) / 127.0)
    return np.concatenate([d_raw, _iq4_nibbles(_iq4_indices(b, d[:, None]))], axis=1).reshape(rows, -1)


def encode_iq4_xs(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> uint8 [rows, cols / 256 * 136]: x ~ d * (sc_j - 32) * v[q] per 32-value block: d,
    scales_h (uint16: sub-block j's top 2 bits at bits 2j), scales_l[4] (low 4 bits, j's in nibble j % 2 of byte
    j // 2), qs: 8 runs of 16 bytes as IQ4_NL's."""
    rows = np.asarray(x).shape[0]
    sub = _blocks(x).reshape(-1, 8, 32)
    scale = np.abs(sub).max(-1) / 127.0
    d_raw, d = _f16(scale.max(-1) / 31.0)
    sc = np.clip(np.rint(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), -32, 31)
    q = _iq4_indices(sub, (d[:, None] * sc)[..., None])
    u = (sc + 32).astype(np.uint16)  # [n, 8], 6 bits
    high = ((u >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)
    low = (u & 0x0F).astype(np.uint8)
    return np.concatenate([d_raw, high[:, None].view(np.uint8), low[:, 0::2] | (low[:, 1::2] << 4),
                           _iq4_nibbles(q).reshape(-1, 128)], axis=1).reshape(rows, -1)


# The lattice types (IQ1-IQ3): the largest |weight| / d a block can hold (d: the block's first two bytes, but IQ1_M's)
_LATTICE_REACH = {"IQ2_XXS": 43 * 15.5 / 4, "IQ2_XS": 43 * 15.5 / 4, "IQ2_S": 43 * 15.5 / 4, "IQ3_XXS": 62 * 15.5 / 2,
                  "IQ3_S": 15 * 31, "IQ1_S": 1.125 * 15, "IQ1_M": 1.125 * 15}


def random_lattice_blocks(x: np.ndarray, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """float32 [rows, cols] -> valid IQ1_S / IQ1_M / IQ2_XXS / IQ2_XS / IQ2_S / IQ3_XXS / IQ3_S blocks whose weights
    span what x's do per 256 values, but are not x's: random grid entries, signs and sub-scales (llama.cpp's
    lattice search is beyond a test helper). `gguf.quants.dequantize` of them is the reference."""
    rows = np.asarray(x).shape[0]
    b = _blocks(x)
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(seed).integers(0, 256, (len(b), type_size), dtype=np.uint8)
    d_raw, _ = _f16(np.abs(b).max(-1) / _LATTICE_REACH[qtype.name])
    if qtype.name == "IQ1_M":
        set_iq1_m_d(blocks, d_raw)
    else:
        blocks[:, :2] = d_raw
    return blocks.reshape(rows, -1)


def set_iq1_m_d(blocks: np.ndarray, d_raw: np.ndarray) -> None:
    """Write float16 bytes d_raw [n, 2] into IQ1_M blocks [n, 56]: d's four nibbles are the top nibbles of the four
    scale words (the block's last 8 bytes), low nibble first."""
    words = blocks[:, -8:].copy().view("<u2")
    d_bits = np.ascontiguousarray(d_raw).view("<u2")[:, 0]
    for j in range(4):
        words[:, j] = (words[:, j] & 0x0FFF) | (((d_bits >> (4 * j)) & 0x0F) << 12)
    blocks[:, -8:] = words.view(np.uint8)
