"""The contract of `trtbuild::MoERoute` (documented in plugins/README.md; cpu_ops/moe_route.cc): a mixture of experts'
routing, as rows sorted by expert, and its numpy reference."""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "MoERoute"


def reference_moe_route(logits: np.ndarray, k: int, normalize: bool
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows [T * k], weights [T * k, 1], offsets [E + 1], inverse [T * k]) of the router's logits [T, E]: each
    token's top k experts by softmax probability (ties: the lower expert), weighted by those probabilities
    (renormalized over the k where `normalize`), as rows sorted by expert, then token; the sorted row of token t's
    j-th expert is inverse[t * k + j]."""
    t_count, e_count = logits.shape
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # stable: ties keep the lower expert first
    weights = np.take_along_axis(probs, chosen, axis=1)
    if normalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    experts = chosen.reshape(-1)
    order = np.argsort(experts, kind="stable")  # by expert, then by token
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(experts, minlength=e_count))])
    return order // k, weights.reshape(-1)[order][:, None].astype(np.float32), offsets, inverse
