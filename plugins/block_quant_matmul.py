"""The contract of `trtbuild::BlockQuantMatMul` (documented in plugins/README.md): its weight layout, the packing
into it, and its numpy reference.

A 4/5/8-bit linear with a scale per block of 32 or 16 weights and the default zero point (8, 16 or 128),
computed as llama.cpp does: activations rounded to int8 per block of 32, exact integer dot products, each weight
block scaled by its scale and the activation's. The weights are packed at build time, 16 rows interleaved
(cpu_ops/block_matmul.cc says why):

  B uint8 [G, K / 32, 16 * 32 * bits / 8], G = ceil(N / 16): in chunk c of group g, 64-byte vector j, bytes
    4r .. 4r + 3 hold row 16g + r's codes 32c + 4j .. +3; 4-bit: vectors j < 4 hold those of j in their low nibbles
    and those of j + 4 in their high ones. 5-bit: the 4-bit layout of each code's low 4 bits (256 bytes), then a
    64-byte plane of their fifth bits: bit 64j + 4r + i is that of row 16g + r's element 32c + 4j + i.
  S float16 or float32 [G, K / block, 16]: S[g, b, r] is the scale of row 16g + r in block b; `pack` stores float16
    when every scale is exact in it (GGUF's Q4_0 / Q8_0 ones are: 11% fewer bytes per 4-bit weight), else float32.
Rows past N (padding) have code zp and scale 0. 5-bit codes are not a checkpoint format (MatMulNBits has 4 and 8):
`narrow` finds them among 8-bit ones, as GGUF's Q5_0 tensors are converted (code q - 16 + 128, q of 5 bits), and
packs them in 5.5 bits a weight instead of 8.5, exactly.
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "BlockQuantMatMul"
GATHER_OP_TYPE = "BlockQuantGather"  # rows of a packed table, dequantized (a tied embedding reads its lm_head's)
BLOCK = 32  # activation blocks, and the weights' chunks
WEIGHT_BLOCKS = (16, 32)
ROWS = 16  # rows per group: one per int32 lane of a 512-bit vector
ZERO_POINT = {4: 8, 5: 16, 8: 128}


def unpack_nbits(b: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """MatMulNBits' B (uint8 [N, K / block, block * bits / 8]; 4-bit: element 2j in the low nibble of byte j) as
    codes [N, K]."""
    flat = b.reshape(n, -1)
    if bits == 8:
        return flat
    codes = np.empty((n, k), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = flat & 0x0F, flat >> 4
    return codes


def narrow(codes: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """8-bit codes [N, K] that all lie within 16 of the zero point as the same values in 5 bits (code - 112,
    zero point 16), with 5; any other codes as they are, with `bits`."""
    if bits == 8 and codes.size and int(codes.min()) >= 112 and int(codes.max()) <= 143:
        return codes - np.uint8(112), 5
    return codes, bits


def pack(codes: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """B and S of the contract from codes [N, K] (0..15, 0..31 or 0..255) and per-block scales [N, K / block]."""
    n, k = codes.shape
    groups, chunks = -(-n // ROWS), k // BLOCK
    blocks = scales.size // n
    padded = np.full((groups * ROWS, k), ZERO_POINT[bits], dtype=np.uint8)
    padded[:n] = codes
    s = np.zeros((groups * ROWS, blocks), dtype=np.float32)
    s[:n] = scales.reshape(n, blocks)
    # [G, r, c, j, i]: element 32c + 4j + i of row 16g + r
    c = padded.reshape(groups, ROWS, chunks, 8, 4)
    if bits == 5:  # [G, c, j, r, i] fifth bits, 64 per j, little-endian
        plane = np.packbits((c >> 4).transpose(0, 2, 3, 1, 4).reshape(groups, chunks, 8, 64), axis=-1,
                            bitorder="little").reshape(groups, chunks, 64)
        c = c & np.uint8(0x0F)
    if bits in (4, 5):
        c = c[:, :, :, :4] | (c[:, :, :, 4:] << 4)
    b = np.ascontiguousarray(c.transpose(0, 2, 3, 1, 4)).reshape(groups, chunks, -1)
    if bits == 5:
        b = np.concatenate([b, plane], axis=2)
    s = np.ascontiguousarray(s.reshape(groups, ROWS, blocks).transpose(0, 2, 1))
    half = s.astype(np.float16)
    return b, half if np.array_equal(half.astype(np.float32), s) else s


def reference_block_quant_gather(ids: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Rows `ids` [T] of the table with codes [N, K] and scales [N * K / block], dequantized: [T, K] float32."""
    n, k = codes.shape
    per_row = np.repeat(scales.reshape(n, -1), k // (scales.size // n), axis=1)
    return ((codes[ids].astype(np.float32) - ZERO_POINT[bits]) * per_row[ids]).astype(np.float32)


def reference_block_quant_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """y [M, N] in float64 from x [M, K], the unpacked codes [N, K] (0..15, 0..31 or 0..255) and scales
    [N * K / block]."""
    m, k = x.shape
    n = codes.shape[0]
    # x's int8 codes as the kernel rounds them, in float32: rint(x * (127 / amax)), half to even
    blocks = x.reshape(m, k // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.rint(blocks * inv).astype(np.float64)
    d = (amax / np.float32(127)).astype(np.float64)
    per_block = scales.size // n  # weight blocks per row; activation blocks of 32 hold 32 / block of them
    q = q.reshape(m, per_block, -1) * np.repeat(d[:, :, 0], per_block * BLOCK // k, axis=1)[:, :, None]
    w = codes.reshape(n, per_block, -1).astype(np.float64) - ZERO_POINT[bits]
    dots = np.einsum("mbi,nbi->mnb", q, w)  # exact integers times the activation scale
    return np.einsum("mnb,nb->mn", dots, scales.reshape(n, per_block).astype(np.float64))
