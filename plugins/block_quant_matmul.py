"""The contract of `trtbuild::BlockQuantMatMul` (documented in plugins/README.md) and its numpy reference.

A 4/8-bit linear in blocks of 32 over MatMulNBits' own initializers, computed as llama.cpp does: activations rounded
to int8 per block, exact integer dot products, each block scaled by the weight's and the activation's scales.
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "BlockQuantMatMul"
BLOCK = 32
K_MULTIPLE = 128  # the CPU kernel reads 4 blocks per step
ZERO_POINT = {4: 8, 8: 128}


def reference_block_quant_matmul(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """y [M, N] in float64 from x [M, K], the unpacked codes [N, K] (0..15 or 0..255) and scales [N * K / 32]."""
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK, BLOCK).astype(np.float64)
    d = np.abs(blocks).max(axis=2, keepdims=True) / 127
    q = np.rint(np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0))
    w = codes.reshape(codes.shape[0], k // BLOCK, BLOCK).astype(np.float64) - ZERO_POINT[bits]
    dots = np.einsum("mbi,nbi->mnb", q, w)  # exact integers
    return np.einsum("mnb,mb,nb->mn", dots, d[:, :, 0], scales.reshape(-1, k // BLOCK).astype(np.float64))
