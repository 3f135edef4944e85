"""Beam search (SamplingParams.beam_width k > 1), as Hugging Face's generate(num_beams=k) searches.

Each live beam is a request of the scheduler: the client's request is the first, the others are forks of it
(`<id>#<n>`), sharing their parent's full KV blocks and a copy of its partial one (KVCacheManager.fork). A group's
beams advance together: once every live beam has the logits row that predicts its next token, `select` scores each
continuation by its beam's cumulative log probability plus log_softmax(row), after the request's logits processors
(masks, penalties, biases, applied to the log probs as HF applies them), and takes the 2k best:

- a continuation that ends its beam (EOS, a stop token, or max_tokens / max_seq_len reached) and ranks among the
  first k becomes a finished hypothesis, scored cum_logprob / output_length ** length_penalty (the ending token
  counted), while the search can still improve on the finished ones;
- the k best others are the next live beams (a beam chosen twice is forked; one chosen never ends).

The search ends when k hypotheses are finished and the best live beam, at its current length, scores no better
than the worst of them (HF's early_stopping=False), or when no continuation is left; the finished hypotheses are the
answer, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from trtbuild.runtime.request import FinishReason, Request
from trtbuild.runtime.sampling import SamplingState, process_logits


@dataclass(frozen=True)
class Beam:
    """One answer of a beam search: its output tokens (an ending token included) and scores."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what the answers are ranked by
    finish_reason: FinishReason
    text: str = ""


@dataclass(frozen=True)
class BeamStep:
    """What one round decided for a group's beams (applied by the scheduler)."""

    extended: list[tuple[str, int]]  # (beam id, token): the beam goes on with it, in place
    forks: list[tuple[str, str, int]]  # (parent beam id, new beam id, token): a new beam from the parent's tokens
    dropped: list[str]  # beams no continuation chose
    done: bool  # the search is over: every live beam ends


@dataclass(eq=False)  # NOTE: hashed by identity: the engine core keeps each group once, by its beams' ids
class BeamGroup:
    """The beam search of one client request (`root`); beams are keyed by request id."""

    root: str
    width: int
    length_penalty: float
    max_tokens: int
    max_seq_len: int
    ending_ids: frozenset[int]  # tokens that end a beam (EOS unless ignore_eos, stop tokens)
    cum: dict[str, float] = field(default_factory=dict)  # live beams' cumulative log probs
    beams: dict[str, Request] = field(default_factory=dict)  # live beams (the scheduler's requests, read only here)
    states: dict[str, SamplingState] = field(default_factory=dict)  # live beams' logits processors
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # this round's logits rows, by beam
    finished: list[Beam] = field(default_factory=list)  # the best hypotheses so far, at most `width`, best first
    improvable: bool = True  # whether a live beam may still beat the worst finished hypothesis
    num_forks: int = 0

    @classmethod
    def start(cls, request: Request, state: SamplingState, max_seq_len: int) -> BeamGroup:
        p = request.sampling
        ending = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
        group = cls(request.request_id, p.beam_width, p.length_penalty, p.max_tokens, max_seq_len, frozenset(ending))
        group.add(request, state, 0.0)
        return group

    def add(self, beam: Request, state: SamplingState, cum_logprob: float) -> None:
        """A live beam: the client's request, or a fork that `select` named (its score set there)."""
        self.beams[beam.request_id], self.states[beam.request_id] = beam, state
        self.cum.setdefault(beam.request_id, cum_logprob)

    @property
    def ready(self) -> bool:
        """Every live beam has its row: the group can take its next round."""
        return bool(self.cum) and self.rows.keys() == self.cum.keys()

    def select(self) -> BeamStep:
        """One round over the rows of every live beam; forks it names must be `add`ed before the next round."""
        ids = list(self.cum)
        raw = np.stack([self.rows.pop(b) for b in ids]).astype(np.float64)
        logprobs = raw - raw.max(axis=1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(axis=1, keepdims=True))
        logprobs = process_logits(logprobs, [self.states[b] for b in ids]).astype(np.float64)
        scores = (logprobs + np.array([self.cum[b] for b in ids])[:, None]).ravel()
        vocab = raw.shape[1]
        n = min(max(2, 1 + len(self.ending_ids)) * self.width, scores.size)  # as HF: room for the ending ones
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.lexsort((top, -scores[top]))]  # best first; ties: lower beam, then lower token
        chosen: list[tuple[str, int, float]] = []
        new_finished = []
        for rank, flat in enumerate(top.tolist()):
            beam, token, score = ids[flat // vocab], flat % vocab, float(scores[flat])
            if score == -np.inf:
                break
            request = self.beams[beam]
            length = request.num_output_tokens + 1
            ends = token in self.ending_ids
            if ends or length >= self.max_tokens or len(request.token_ids) + 1 >= self.max_seq_len:
                if rank < self.width and self.improvable:
                    reason = FinishReason.STOP if ends else FinishReason.LENGTH
                    new_finished.append(Beam((*request.output_ids, token), score,
                                             score / length ** self.length_penalty, reason))
            elif len(chosen) < self.width:
                chosen.append((beam, token, score))
        self.finished = sorted(self.finished + new_finished, key=lambda h: -h.score)[: self.width]
        return self._next_beams(chosen)

    def _next_beams(self, chosen: list[tuple[str, int, float]]) -> BeamStep:
        extended, forks, cum = [], [], {}
        for beam, token, score in chosen:
            if beam not in cum:
                extended.append((beam, token))
                cum[beam] = score
            else:
                self.num_forks += 1
                child = f"{self.root}#{self.num_forks}"
                forks.append((beam, child, token))
                cum[child] = score
        dropped = [b for b in self.cum if b not in cum]
        if chosen:  # HF's heuristic: the best live beam, at its length now, against the worst finished
            length = self.beams[chosen[0][0]].num_output_tokens + 1
            best = chosen[0][2] / length ** self.length_penalty
            self.improvable = self.improvable and (len(self.finished) < self.width or best > self.finished[-1].score)
        done = not chosen or not self.improvable
        self.cum = cum
        return BeamStep(extended, forks, dropped, done)

    def live(self) -> list[Request]:
        """The live beams' requests (forks not yet `add`ed left out)."""
        return [self.beams[b] for b in self.cum if b in self.beams]

    def drop(self, beam_ids: list[str]) -> list[Request]:
        """Forget beams a round dropped; returns their requests (for the scheduler to finish)."""
        for b in beam_ids:
            self.states.pop(b, None)
        return [self.beams.pop(b) for b in beam_ids]

    def answers(self, decode: Callable[[tuple[int, ...]], str] | None) -> list[Beam]:
        """The finished hypotheses, best first, with their text."""
        if decode is None:
            return list(self.finished)
        return [Beam(b.token_ids, b.cumulative_logprob, b.score, b.finish_reason, decode(b.token_ids))
                for b in self.finished]
