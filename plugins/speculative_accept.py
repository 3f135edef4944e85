"""Contract of `trtbuild::SpeculativeAccept` (documented in plugins/README.md) and its numpy reference.

One node per engine built with `--speculative-decoding-mode draft-tokens`: the accept step of speculative decoding
inside the engine. Sequence a of the A sequences it verifies proposed draft_lens[a] <= K drafts and owns the
draft_lens[a] + 1 consecutive rows logits[accept_rows[a] :] (row i: the target's distribution after draft i, row 0
after the last accepted token). The draft is deterministic (q = one-hot), as in runtime/speculative.verify:
- greedy (temperature 0): accept d_i while d_i is the first argmax of row i; the next token is the argmax of the first
  row that disagrees, or of the bonus row draft_lens[a];
- sampling: p_i = softmax(row_i / temperature) in float64; accept d_i iff u[i] < p_i(d_i); on the first rejection
  (row n) the next token is drawn from p_n without d_n (renormalized) with u[n + 1]; with every draft accepted it is
  drawn from the bonus row with u[n]. A draw with u picks the first token whose cumulative probability (token id
  order) exceeds u * total, so tokens with probability 0 are never drawn.
The uniforms are the request's own stream in the order runtime/speculative.verify consumes it, so the op and the
Python path give the same tokens; the stream advances by num_accepted + 1 + (num_accepted < draft_lens).
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "SpeculativeAccept"
OPSET_VERSION = 1

INPUTS = ("logits", "accept_rows", "draft_tokens", "draft_lens", "temperatures", "uniforms")
OUTPUTS = ("num_accepted", "next_tokens")
LOGITS, ACCEPT_ROWS, DRAFT_TOKENS, DRAFT_LENS, TEMPERATURES, UNIFORMS = range(6)


def uniforms_used(num_accepted: int, draft_len: int) -> int:
    """How many of a sequence's uniforms a result consumed: one accept test per accepted draft, then either a
    rejection test plus the residual draw or the bonus draw."""
    return num_accepted + 1 + int(num_accepted < draft_len)


def draw_from(probs: np.ndarray, u: float) -> int:
    """The first token whose cumulative probability exceeds u * total (probs over the whole vocabulary)."""
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.size - 1)


def reference_speculative_accept(
    logits: np.ndarray, accept_rows: np.ndarray, draft_tokens: np.ndarray, draft_lens: np.ndarray,
    temperatures: np.ndarray, uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence loop over the rows; the lowered graphs and kernels are tested against it."""
    num_accepted = np.zeros(len(accept_rows), dtype=np.int64)
    next_tokens = np.zeros(len(accept_rows), dtype=np.int64)
    for a, (first, k, temperature) in enumerate(zip(accept_rows, draft_lens, temperatures, strict=True)):
        u = uniforms[a]
        for i in range(k + 1):
            row = logits[first + i]
            draft = int(draft_tokens[a, i]) if i < k else None
            if temperature == 0:
                token = int(np.argmax(row))
                if token == draft:
                    continue
                next_tokens[a] = token
            else:
                scaled = row.astype(np.float64) / np.float64(temperature)
                p = np.exp(scaled - scaled.max())
                p /= p.sum()
                if draft is None:
                    next_tokens[a] = draw_from(p, u[i])
                elif u[i] < p[draft]:
                    continue
                else:
                    residual = p.copy()
                    residual[draft] = 0.0
                    next_tokens[a] = draw_from(residual / (1.0 - p[draft]), u[i + 1])
            num_accepted[a] = i
            break
    return num_accepted, next_tokens
