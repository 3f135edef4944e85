"""Log probabilities of chosen tokens under the raw model distribution (log_softmax of unprocessed logits), with
their rank and the top n: what `logprobs` and `prompt_logprobs` return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the chosen token under the raw model distribution
    rank: int  # 1 + the number of tokens the model found strictly more likely
    top: tuple[tuple[int, float], ...]  # the n most likely (token id, logprob), most likely first, ties: lower id


def token_logprobs(logits: np.ndarray, token_id: int, n: int) -> TokenLogprobs:
    """Log probs of one raw logits row [V]: the chosen token's, its rank, and the top n."""
    return rows_logprobs(logits[None], [token_id], n)[0]


def rows_logprobs(logits: np.ndarray, token_ids: Sequence[int], n: int, rows_at_once: int = 32
                  ) -> list[TokenLogprobs]:
    """token_logprobs of each raw logits row [R, V] for its token (float64 scratch of rows_at_once x V)."""
    out = []
    for begin in range(0, len(token_ids), rows_at_once):
        block = logits[begin : begin + rows_at_once].astype(np.float64)
        block -= block.max(axis=1, keepdims=True)
        block -= np.log(np.exp(block).sum(axis=1, keepdims=True))
        out += [_row_logprobs(row, int(t), n) for row, t in zip(block, token_ids[begin : begin + rows_at_once],
                                                                  strict=True)]
    return out


def _row_logprobs(logprobs: np.ndarray, token_id: int, n: int) -> TokenLogprobs:
    chosen = float(logprobs[token_id])
    top: tuple[tuple[int, float], ...] = ()
    n = min(n, logprobs.size)
    if n:
        kth = np.partition(logprobs, logprobs.size - n)[logprobs.size - n]
        ids = np.flatnonzero(logprobs >= kth)
        ids = ids[np.lexsort((ids, -logprobs[ids]))][:n]
        top = tuple((int(i), float(logprobs[i])) for i in ids)
    return TokenLogprobs(token_id, chosen, int((logprobs > chosen).sum()) + 1, top)
