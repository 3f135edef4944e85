"""The contract of `trtbuild::MoERoute` (documented in plugins/README.md; cpu_ops/moe_route.cc): a mixture of experts'
routing, as rows sorted by expert, and its numpy reference; and the reference of the tables of experts those rows
go through (`trtbuild::BlockQuantMatMul` with `experts`)."""

from __future__ import annotations

import numpy as np

from trtbuild.plugins.block_quant_reference import reference_block_quant_matmul

DOMAIN = "trtbuild"
OP_TYPE = "MoERoute"


def reference_moe_route(logits: np.ndarray, k: int, normalize: bool, sigmoid: bool = False,
                        selection_bias: np.ndarray | None = None, scale: float = 1.0
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows [T * k], weights [T * k, 1], offsets [E + 1], inverse [T * k]) of the router's logits [T, E]: each
    token's top k experts by softmax probability (ties: the lower expert), weighted by those probabilities
    (renormalized over the k where `normalize`), as rows sorted by expert, then token; the sorted row of token t's
    j-th expert is inverse[t * k + j]. `sigmoid`: scores sigmoid(logit), ranked with `selection_bias` [E] added,
    weighted unbiased. `scale` multiplies every weight."""
    t_count, e_count = logits.shape
    if sigmoid:
        probs = 1 / (1 + np.exp(-logits.astype(np.float32)))
        rank = probs + selection_bias if selection_bias is not None else probs
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        rank = probs
    chosen = np.argsort(-rank, axis=1, kind="stable")[:, :k]  # stable: ties keep the lower expert first
    weights = np.take_along_axis(probs, chosen, axis=1)
    if normalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    weights = weights * scale
    experts = chosen.reshape(-1)
    order = np.argsort(experts, kind="stable")  # by expert, then by token
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(experts, minlength=e_count))])
    return order // k, weights.reshape(-1)[order][:, None].astype(np.float32), offsets, inverse


def reference_block_quant_matmul_experts(x: np.ndarray, offsets: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                                         bits: int, experts: int, mins: np.ndarray | None = None,
                                         codebook: tuple[int, ...] | None = None,
                                         bias: np.ndarray | None = None) -> np.ndarray:
    """A table of experts (the op's `experts` mode): y [M, N / E] in float64, each run of x's rows offsets[e] ..
    offsets[e + 1] times expert e's rows e·N/E .. (e + 1)·N/E of the table (codes [N, K], scales and optional
    minimums [N, K / block]) as `block_quant_reference.reference_block_quant_matmul`, plus their slice of `bias` [N]
    where there is one. Rows past offsets[E] stay 0 here (the op leaves them unwritten)."""
    n = codes.shape[0]
    rows = n // experts
    per_row = [None if a is None else a.reshape(n, -1) for a in (scales, mins)]
    y = np.zeros((x.shape[0], rows))
    for e in range(experts):
        run, table = slice(int(offsets[e]), int(offsets[e + 1])), slice(e * rows, (e + 1) * rows)
        if run.stop > run.start:
            s, m = (None if a is None else a[table].reshape(-1) for a in per_row)
            y[run] = reference_block_quant_matmul(x[run], codes[table], s, bits, m, codebook)
            if bias is not None:
                y[run] += bias[table].astype(np.float64)
    return y
