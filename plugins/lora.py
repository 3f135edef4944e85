"""The contract of `trtbuild::LoraAdd` (documented in plugins/README.md): a linear's output plus each token's own
LoRA delta (builder/lora.py), its packing and the numpy reference.

    LoraAdd(y float [M, N], x float [M, K], lora_ids int64 [M], A [S, C, K], Bt [S, R, N]) -> y + delta [M, N]
      delta[t, n] = sum_r Bt[a - 1, r, n] * (A[a - 1, j(n) R + r, :] . x[t, :]),  a = lora_ids[t] (0: none, delta 0)
  Attributes K, N, R (rows per adapter and block), splits (the columns of each block, summing to N; multiples of
  16, as K): fused siblings (q / k / v, gate / up) are one node, block j adapting columns splits[j] with its own A
  rows. A and Bt are float16, bfloat16 or float32 alike (plugins/dense_matmul.py: exact_type), zero past an
  adapter's rank.

Only a token's own adapter is read, so the work per token does not grow with the adapters an engine holds (the
standard-op form of builder/lora.py multiplies by all of them and masks).
"""

from __future__ import annotations

import numpy as np

from trtbuild.plugins import dense_matmul as dm

DOMAIN = "trtbuild"
OP_TYPE = "LoraAdd"


def pack(a_blocks: list[np.ndarray], b_blocks: list[np.ndarray], offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A, Bt) of the contract from the network's tables of each block j: a_blocks[j] = lora_a^T [K, R_total] and
    b_blocks[j] = lora_b^T [R_total, N_j] over every adapter's columns, adapter s owning columns offsets[s] ..
    offsets[s + 1]."""
    ranks = np.diff(offsets)
    r, k = int(ranks.max()), a_blocks[0].shape[0]
    a = np.zeros((len(ranks), len(a_blocks) * r, k), np.float32)
    bt = np.zeros((len(ranks), r, sum(b.shape[1] for b in b_blocks)), np.float32)
    for s, (start, rank) in enumerate(zip(offsets[:-1], ranks, strict=True)):
        column = 0
        for j, (aj, bj) in enumerate(zip(a_blocks, b_blocks, strict=True)):
            a[s, j * r : j * r + rank] = aj[:, start : start + rank].T
            bt[s, :rank, column : column + bj.shape[1]] = bj[start : start + rank]
            column += bj.shape[1]
    weight = dm.WEIGHT_TYPES[dm.exact_type(np.concatenate([a.ravel(), bt.ravel()]))]
    return a.astype(weight), bt.astype(weight)


def reference_lora_add(y: np.ndarray, x: np.ndarray, ids: np.ndarray, a: np.ndarray, bt: np.ndarray,
                       splits: list[int]) -> np.ndarray:
    """The op's output in float64."""
    r = bt.shape[1]
    out = y.astype(np.float64).copy()
    bounds = np.cumsum([0, *splits])
    for t, adapter in enumerate(ids):
        if adapter:
            h = a[adapter - 1].astype(np.float64) @ x[t].astype(np.float64)  # [blocks x R]
            for j in range(len(splits)):
                cols = slice(bounds[j], bounds[j + 1])
                out[t, cols] += h[j * r : (j + 1) * r] @ bt[adapter - 1, :, cols].astype(np.float64)
    return out
