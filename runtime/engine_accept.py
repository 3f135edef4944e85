"""Drafts verified inside the engine (SpeculativeAccept, engines built with `--speculative-decoding-mode
draft-tokens`) when a request's sampling is what the op implements, with the same tokens as speculative.verify.

The op computes greedy acceptance and rejection sampling at a temperature over the raw logits. A request that also
needs top-k/top-p/min-p, penalties, logit bias, masks (bad words, min_tokens, a JSON schema) or log probs keeps its
rows and is verified in Python. For a sampled request the op reads the request's own generator's next numbers (a
copy draws them) and the generator then advances by as many as verify would have drawn, so both paths give the
same tokens and leave the same stream behind (plugins/speculative_accept.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from trtbuild.plugins.speculative_accept import uniforms_used
from trtbuild.runtime.engine import DraftAccept
from trtbuild.runtime.sampling import SamplingState


def engine_can_verify(state: SamplingState, num_drafts: int, max_draft_len: int) -> bool:
    """Whether the engine's op verifies these drafts exactly as `speculative.verify` would."""
    p = state.params
    plain_temperature = p.greedy or (p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0)
    return (0 < num_drafts <= max_draft_len and plain_temperature and p.logprobs is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and state.num_output_tokens >= p.min_tokens and not state.bad_words_ids and state.guide is None)


def draft_accept(state: SamplingState, drafts: Sequence[int]) -> DraftAccept:
    """The op's inputs for one request: its drafts, temperature and (sampling) its generator's next numbers, drawn
    from a copy so that the request's own generator advances only by what is used (`advance`)."""
    if state.params.greedy:
        return DraftAccept(tuple(drafts), 0.0)
    uniforms = copy.deepcopy(state.rng).random(len(drafts) + 1)
    return DraftAccept(tuple(drafts), float(state.params.temperature), tuple(uniforms.tolist()))


def advance(state: SamplingState, num_drafts: int, num_accepted: int) -> None:
    """Move the request's generator past the numbers the op used, as `speculative.verify` would have drawn them."""
    if not state.params.greedy:
        state.rng.random(uniforms_used(num_accepted, num_drafts))
