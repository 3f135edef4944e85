"""The numpy references of `trtbuild::BlockQuantMatMul` and `BlockQuantGather` (plugins/README.md) over unpacked
codes: what the kernels compute, as tests and the expert tables' reference (plugins/moe_route.py) check them."""

from __future__ import annotations

import numpy as np

from trtbuild.plugins.block_quant_matmul import BLOCK, CODEBOOK_ZERO_POINT, ZERO_POINT


def _weight_codes(codes: np.ndarray, bits: int, mins: np.ndarray | None,
                  codebook: tuple[int, ...] | None) -> tuple[np.ndarray, int]:
    """The codes the dot products see (a codebook's entries where there is one) and their zero point."""
    if codebook is not None:
        return np.asarray(codebook, dtype=np.uint8)[codes], CODEBOOK_ZERO_POINT
    return codes, 0 if mins is not None else ZERO_POINT[bits]


def reference_block_quant_gather(ids: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int,
                                  mins: np.ndarray | None = None,
                                  codebook: tuple[int, ...] | None = None) -> np.ndarray:
    """Rows `ids` [T] of the table with codes [N, K], scales [N * K / block] and optional minimums (like the
    scales) or codebook, dequantized as the kernel does in float32: [T, K]."""
    n, k = codes.shape
    block = k // (scales.size // n)
    per_row = np.repeat(scales.reshape(n, -1).astype(np.float32), block, axis=1)[ids]
    codes, zp = _weight_codes(codes, bits, mins, codebook)
    if mins is None:
        return (codes[ids].astype(np.float32) - zp) * per_row
    return codes[ids].astype(np.float32) * per_row - np.repeat(mins.reshape(n, -1).astype(np.float32), block,
                                                               axis=1)[ids]


def reference_block_quant_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int,
                                  mins: np.ndarray | None = None,
                                  codebook: tuple[int, ...] | None = None) -> np.ndarray:
    """y [M, N] in float64 from x [M, K], the unpacked codes [N, K] (0 .. 2^bits - 1), scales [N * K / block] and
    optional minimums (like the scales; the codes then have zero point 0) or codebook."""
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
    codes, zp = _weight_codes(codes, bits, mins, codebook)
    w = codes.reshape(n, per_block, -1).astype(np.float64) - zp
    dots = np.einsum("mbi,nbi->mnb", q, w)  # exact integers times the activation scale
    y = np.einsum("mnb,nb->mn", dots, scales.reshape(n, per_block).astype(np.float64))
    if mins is not None:  # a minimum times the block's sum of x as quantized
        sums = np.rint(blocks * inv).reshape(m, per_block, -1).sum(axis=2)
        per_weight_block = np.repeat(amax[:, :, 0] / np.float32(127), per_block * BLOCK // k, axis=1)
        y -= (sums * per_weight_block).astype(np.float64) @ mins.reshape(n, per_block).astype(np.float64).T
    return y

