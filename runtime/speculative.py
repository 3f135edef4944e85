"""Speculative decoding: propose draft tokens cheaply, verify them all in one engine step, keep what the target
model agrees with.

A decoding request with drafts d_1..d_k computes [last token, d_1, .., d_k] in one chunk and gets k + 1 logits rows.
Row i is the target model's distribution p_i for the token after d_i (row 0: after the last token). Verification
walks the rows in order (gpt-fast / Leviathan et al. 2023, with a deterministic draft q = one-hot(d_i)):
- greedy: accept d_i while it is the argmax of p_{i-1};
- sampling: accept d_i with probability p_{i-1}(d_i); on rejection draw from p_{i-1} without d_i (the residual
  max(p - q, 0), normalized), and stop.
If every draft is accepted, one more token is drawn from the last row, so a step yields 1 .. k + 1 tokens and each
token is distributed exactly as in plain decoding. Penalties and masks see the accepted drafts (the rows are
processed one at a time, each after the previous token was appended).

Proposers: `NgramProposer` (prompt lookup: copy what followed the latest earlier occurrence of the context's last
n tokens) and `DraftModelProposer` (runtime/draft_model.py: a smaller engine with the same tokenizer drafts greedily,
batched over the running requests, with its own KV pool).
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trtbuild.errors import ConfigError
from trtbuild.runtime.logprobs import TokenLogprobs, token_logprobs
from trtbuild.runtime.sampling import SamplingState, draw, process_logits, sampling_distribution

if TYPE_CHECKING:
    from trtbuild.builder.engine_dir import EngineInfo
    from trtbuild.runtime.request import Request

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed. `num_speculative_tokens` drafts at most per request and step."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4  # longest n-gram matched (tried first)
    prompt_lookup_min: int = 1  # shortest n-gram matched
    draft_engine_dir: str | None = None  # method "draft_model": the draft engine's directory

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.draft_engine_dir is not None):
            raise ConfigError("draft_engine_dir", "is needed by method draft_model and by no other method, got "
                                                  f"{self.draft_engine_dir!r} with method {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens", f"must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("prompt_lookup_min", f"must be at least 1 and at most prompt_lookup_max "
                                                   f"({self.prompt_lookup_max}), got {self.prompt_lookup_min}")


class Proposer(abc.ABC):
    """Invariant: `propose_batch` returns at most `max_tokens[i]` token ids for request i and never changes a
    request (the scheduler stores the drafts)."""

    @abc.abstractmethod
    def propose_batch(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """Drafts for the decoding requests, all at once."""

    def release(self, live_request_ids: Collection[str]) -> None:
        """Forget every request not in `live_request_ids` (finished, aborted or preempted); nothing to do here."""
        return None

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Start-up work before the first request (a draft engine's warm-up step); nothing to do here."""
        return None


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_batch(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [self.propose(r.token_ids, n) for r, n in zip(requests, max_tokens, strict=True)]

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the last n tokens, longest n first."""
        if max_tokens <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows[s] = tokens[s : s + n] for every start s whose window ends before the last token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                follow = int(starts[-1]) + n
                return tokens[follow : follow + max_tokens].tolist()
        return []


def make_proposer(config: SpeculativeConfig, target: EngineInfo | None = None, num_threads: int | None = None,
                  kv_tokens: int = 1024) -> Proposer:
    """The proposer of `config.method`; a draft model needs the target engine's info (tokenizer check), ONNX
    Runtime's threads and how many tokens its KV pool holds."""
    if config.method == "draft_model":
        from trtbuild.runtime.draft_model import DraftModelProposer

        if target is None:
            raise ValueError("a draft model proposer needs the target engine")
        return DraftModelProposer(config, target, num_threads, kv_tokens)
    return NgramProposer(config)


@dataclass(frozen=True)
class Verified:
    token_ids: list[int]  # accepted drafts, then one corrected / bonus token
    num_accepted: int  # drafts accepted
    logprobs: list[TokenLogprobs | None]


def verify(logits: np.ndarray, drafts: Sequence[int], state: SamplingState) -> Verified:
    """Rows logits [len(drafts) + 1, V] of one request -> the tokens this step yields (see the module docstring).

    Each row is processed (masks, penalties) with the tokens decided before it. Like `Sampler.sample`, this leaves
    `state` as it found it: the scheduler records the tokens (and may stop early at a stop token).
    """
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} logits rows, got {logits.shape[0]}")
    params = state.params
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    try:
        for i, row in enumerate(logits):
            processed = process_logits(row[None, :], [state])[0]
            draft = drafts[i] if i < len(drafts) else None
            if params.greedy:
                token = int(np.argmax(processed))  # first maximum, as the plain sampler
            else:
                token = _accept_or_resample(*sampling_distribution(processed, params), draft, state.rng)
            tokens.append(token)
            state.append(token)
            logprobs.append(None if params.logprobs is None else token_logprobs(row, token, params.logprobs))
            if token != draft:  # a correction, or the bonus token after all drafts: always the last token
                break
    finally:
        del state.token_ids[len(state.token_ids) - len(tokens):]
    return Verified(tokens, len(tokens) - 1, logprobs)


def _accept_or_resample(ids: np.ndarray, probs: np.ndarray, draft: int | None, rng: np.random.Generator) -> int:
    """Accept `draft` with probability p(draft); otherwise draw from p with the draft removed (renormalized).
    Without a draft (the bonus row), one plain draw from p.

    NOTE: the accept test draws even when p(draft) is 0, so the stream advances by accepted + 1 + rejected, what the
    engine's SpeculativeAccept op (plugins/speculative_accept.py) is fed and reports."""
    if draft is not None:
        hit = ids == draft
        p_draft = float(probs[hit].sum())
        if rng.random() < p_draft:
            return draft
        ids, probs = ids[~hit], probs[~hit] / (1.0 - p_draft)  # p_draft < 1 here: the test failed
    return draw(ids, probs, rng)
