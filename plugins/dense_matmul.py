"""The contract of `trtbuild::DenseMatMul` and `trtbuild::DenseGather` (documented in plugins/README.md): the
packed layout of a float16, bfloat16 or float32 weight, the packing into it, and the numpy references.

    DenseMatMul(x float [..., K], B) -> y float [..., N] = x @ W^T, accumulated in float32
    DenseGather(ids int64 [...], B) -> y float [..., K] = W[ids]  (a tied embedding reads its lm_head's table)
  B float16 | bfloat16 | float [G, K, 16], G = ceil(N / 16): B[g, k, r] = W[16g + r, k]; rows past N are zero.
  Attributes K, N.

Each 16-element vector is one k of 16 rows (one per float32 lane), so the kernel needs no horizontal sums
(cpu_ops/dense_matmul.cc). Converting a 16-bit weight to float32 is exact, so the engine computes what ONNX
Runtime's MatMul does on the upcast float32 weights, from half the bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "DenseMatMul"
GATHER_OP_TYPE = "DenseGather"
ROWS = 16
WEIGHT_TYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float32": np.dtype(np.float32)}


def exact_type(w: np.ndarray) -> str:
    """The smallest weight type that holds float32 `w` exactly: float16, bfloat16 (what a checkpoint or GGUF stored
    in 16 bits was upcast from), else float32."""
    for name in ("float16", "bfloat16"):
        narrow = w.astype(WEIGHT_TYPES[name])
        if np.array_equal(narrow.astype(np.float32), w):
            return name
    return "float32"


def pack(w: np.ndarray, weight_type: str) -> np.ndarray:
    """B of the contract from W [N, K] (rows are output features), in `weight_type` (WEIGHT_TYPES)."""
    n, k = w.shape
    groups = -(-n // ROWS)
    padded = np.zeros((groups * ROWS, k), dtype=WEIGHT_TYPES[weight_type])
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(groups, ROWS, k).transpose(0, 2, 1))


def unpack(b: np.ndarray, n: int) -> np.ndarray:
    """W [N, K] as float32 from B."""
    groups, k, _ = b.shape
    return b.astype(np.float32).transpose(0, 2, 1).reshape(groups * ROWS, k)[:n]


def reference_dense_matmul(x: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """y [M, N] in float64 from x [M, K] and B."""
    return x.astype(np.float64) @ unpack(b, n).astype(np.float64).T


def reference_dense_gather(ids: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    return unpack(b, n)[ids]
