"""A minimal in-process generation loop over the CPU engine: token-budget batching with chunked prefill.

Each step packs one decode token per running sequence, then prefill chunks of waiting prompts while the step's
token budget lasts. A sequence's logits are read only when its chunk ends at its newest known token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.sampling import SamplingParams, sample


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class _Sequence:
    index: int
    request: GenerationRequest
    tokens: list[int]
    computed: int = 0  # tokens whose K/V are in the cache
    generated: int = 0
    done: bool = False
    rng: np.random.Generator = field(default_factory=np.random.default_rng)


@dataclass(frozen=True)
class TokenEvent:
    request_index: int
    token_id: int
    finished: bool


class Generator:
    def __init__(self, engine: CpuEngine, prefill_chunk_size: int | None = None) -> None:
        self.engine = engine
        build = engine.info.build
        self.max_tokens_per_step = build.max_num_tokens
        self.prefill_chunk_size = prefill_chunk_size or build.max_num_tokens

    def _check(self, r: GenerationRequest) -> None:
        limit = self.engine.info.build.max_seq_len
        if not r.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(r.prompt_ids) + r.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds "
                             f"the engine's max_seq_len {limit}; shorten the prompt or rebuild with a larger one")

    def stream(self, requests: list[GenerationRequest]) -> Iterator[TokenEvent]:
        """Run every request to completion, yielding each generated token as soon as it is sampled."""
        for r in requests:
            self._check(r)
        waiting = [_Sequence(i, r, list(r.prompt_ids), rng=np.random.default_rng(r.sampling.seed))
                   for i, r in enumerate(requests)]
        running: list[_Sequence] = []
        seq_ids = 1 << 40  # engine-wide sequence ids, distinct from other generators' by construction
        try:
            while waiting or running:
                max_batch = self.engine.info.build.max_batch_size
                while waiting and len(running) < max_batch:
                    running.append(waiting.pop(0))
                chunks, budget = [], self.max_tokens_per_step
                for s in running:  # decode tokens first, then prefill chunks (so decoding never stalls)
                    todo = len(s.tokens) - s.computed
                    take = min(todo, budget if todo == 1 else min(budget, self.prefill_chunk_size))
                    if take <= 0:
                        continue
                    end = s.computed + take
                    chunks.append((s, SequenceChunk(seq_ids + s.index, s.tokens[s.computed:end], s.computed,
                                                    num_logits=int(end == len(s.tokens)))))
                    budget -= take
                chunks.sort(key=lambda sc: len(sc[1].token_ids) > 1)
                logits = self.engine.step([c for _, c in chunks])
                row = 0
                for s, c in chunks:
                    s.computed += len(c.token_ids)
                    if not c.num_logits:
                        continue
                    token = sample(logits[row], s.request.sampling, s.rng)
                    row += 1
                    s.tokens.append(token)
                    s.generated += 1
                    s.done = s.generated >= s.request.max_new_tokens or token in s.request.stop_token_ids
                    yield TokenEvent(s.index, token, s.done)
                for s in [s for s in running if s.done]:
                    running.remove(s)
                    self.engine.release(seq_ids + s.index)
        finally:
            for s in running:
                self.engine.release(seq_ids + s.index)

    def generate(self, requests: list[GenerationRequest]) -> list[list[int]]:
        """Generated token ids of each request (prompt excluded)."""
        out: list[list[int]] = [[] for _ in requests]
        for event in self.stream(requests):
            out[event.request_index].append(event.token_id)
        return out
