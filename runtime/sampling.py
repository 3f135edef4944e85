"""Batched token sampling for the serving runtime: per-request parameters and state, and one sampler for a step.

A step processes each request's logits row in this order (as vLLM's v1 sampler):
mask (bad words; EOS / stop tokens before min_tokens) -> repetition, frequency, presence penalties ->
greedy argmax (temperature 0), or temperature -> top-k -> top-p -> min-p -> one draw from the request's generator.
Returned logprobs describe the raw model distribution (log_softmax of the unprocessed logits), vLLM's default.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np

from trtbuild.errors import ConfigError
from trtbuild.runtime.logprobs import TokenLogprobs, token_logprobs

MAX_LOGPROBS = 20  # most top log probs one request may ask for per token (OpenAI's top_logprobs limit)
MAX_BEAM_WIDTH = 32
# what beam search decides by itself (runtime/beam_search.py): these keep their defaults with beam_width > 1
_NOT_WITH_BEAMS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None, "stop": (),
                   "logprobs": None, "prompt_logprobs": None, "json_schema": None}
TOP_P_HEAD = 1024  # top-p sorts only this many most likely tokens when they hold enough mass


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _as_tuple(x: object) -> object:
    """A tuple of a list, tuple or array; anything else unchanged (and then refused by the field's rule)."""
    return tuple(x) if isinstance(x, Sequence | np.ndarray) and not isinstance(x, str) else x


def _is_ids(x: object) -> bool:
    return isinstance(x, tuple) and all(_is_int(i) and i >= 0 for i in x)


def _is_strings(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(s, str) and s for s in x)


# field -> (rule in words, check); every message reads "<field> must be <rule>, got <value>"
_RULES = {
    "temperature": ("a number >= 0 (0 is greedy)", lambda v: _is_real(v) and v >= 0),
    "top_k": ("an integer >= 0 (0 is off)", lambda v: _is_int(v) and v >= 0),
    "top_p": ("in (0, 1]", lambda v: _is_real(v) and 0 < v <= 1),
    "min_p": ("in [0, 1]", lambda v: _is_real(v) and 0 <= v <= 1),
    "repetition_penalty": ("a number > 0 (1 is off)", lambda v: _is_real(v) and v > 0),
    "presence_penalty": ("in [-2, 2]", lambda v: _is_real(v) and -2 <= v <= 2),
    "frequency_penalty": ("in [-2, 2]", lambda v: _is_real(v) and -2 <= v <= 2),
    "seed": ("None or an integer >= 0", lambda v: v is None or (_is_int(v) and v >= 0)),
    "max_tokens": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "min_tokens": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "stop": ("non-empty strings", lambda v: _is_strings(v)),
    "stop_token_ids": ("token ids >= 0", _is_ids),
    "bad_words": ("non-empty strings", lambda v: _is_strings(v)),
    "bad_words_ids": ("non-empty sequences of token ids >= 0",
                      lambda v: isinstance(v, tuple) and all(_is_ids(w) and w for w in v)),
    "ignore_eos": ("a bool", lambda v: isinstance(v, bool)),
    "logprobs": (f"None or an integer in [0, {MAX_LOGPROBS}]",
                 lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS)),
    "prompt_logprobs": (f"None or an integer in [0, {MAX_LOGPROBS}]",
                        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS)),
    "beam_width": (f"an integer in [1, {MAX_BEAM_WIDTH}]", lambda v: _is_int(v) and 1 <= v <= MAX_BEAM_WIDTH),
    "length_penalty": ("a number", _is_real),
    "include_stop_str_in_output": ("a bool", lambda v: isinstance(v, bool)),
    "skip_special_tokens": ("a bool", lambda v: isinstance(v, bool)),
    "json_schema": ("None or a JSON schema as text", lambda v: v is None or isinstance(v, str)),
    "logit_bias": ("(token id >= 0, bias in [-100, 100]) pairs",
                   lambda v: isinstance(v, tuple) and all(isinstance(p, tuple) and len(p) == 2 and _is_int(p[0])
                                                          and p[0] >= 0 and _is_real(p[1]) and -100 <= p[1] <= 100
                                                          for p in v)),
}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Invalid values raise ValueError("<field> must be ...").

    Sequence fields accept any sequence (a single string for `stop` / `bad_words`) and are stored as tuples.
    """

    temperature: float = 0.0  # 0 is greedy; the default keeps `trtbuild run` deterministic
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # HF: divide positive / multiply negative logits of tokens in prompt + output
    presence_penalty: float = 0.0  # OpenAI: minus this for tokens present in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    seed: int | None = None  # None: nondeterministic
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens were generated
    stop: tuple[str, ...] = ()  # stop strings (handled by the detokenizer)
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()  # tokenized without special tokens when the request's state is made
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # a word's last token is banned after the word's other tokens
    ignore_eos: bool = False  # EOS is an ordinary token: it does not stop the request and is never masked
    logprobs: int | None = None  # top-n log probs per generated token (plus the chosen token's); None: none
    # the same for every prompt token after the first (vLLM's prompt_logprobs): the request's prompt is computed
    # whole, never read from the prefix cache, and the logits of every prompt position come out of the engine
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: special tokens' text is in the output (e.g. a tool call's marker)
    # OpenAI: added to the token's logit before sampling (-100 bans it, 100 all but forces it); a dict works too
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None  # the output is JSON valid under this schema (runtime/guided.py); None: free
    # > 1: beam search (runtime/beam_search.py) with this many beams, every one returned (TensorRT-LLM's beam_width)
    beam_width: int = 1
    length_penalty: float = 1.0  # beam search ranks answers by cumulative logprob / length ** length_penalty (HF)

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else _as_tuple(value))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(tuple(p) if isinstance(p, list | tuple) else p for p in bias))
        words = _as_tuple(self.bad_words_ids)
        object.__setattr__(self, "bad_words_ids", tuple(map(_as_tuple, words)) if isinstance(words, tuple) else words)
        for f in fields(self):
            rule, ok = _RULES[f.name]
            value = getattr(self, f.name)
            if not ok(value):
                raise ConfigError(f.name, f"must be {rule}, got {value!r}")
        if self.beam_width > 1:
            for name, default in _NOT_WITH_BEAMS.items():
                if getattr(self, name) != default:
                    raise ConfigError(name, f"cannot be set with beam_width {self.beam_width}: beam search keeps the "
                                            f"most likely beams (leave {name} at {default!r})")
        if self.min_tokens > self.max_tokens:
            raise ConfigError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.json_schema is not None:
            from trtbuild.runtime.guided import check_schema

            check_schema(self.json_schema)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class BadWordsEncoder(Protocol):
    def encode_bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]: ...


class TokenHistory:
    """Prompt + output token ids in one list: `token_ids`, whose first `num_prompt_tokens` are the prompt."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SamplingState(TokenHistory):
    """One request's mutable sampling state: its generator, its tokens (for penalties and bad words), banned words.

    `token_ids` holds prompt + output. Pass the request's own list (e.g. `Request.token_ids`) to share it, so that
    appending there is all the bookkeeping; otherwise call `append` with each generated token. The sampler never
    appends. The generator is seeded from `params.seed` and only this request's draws use it, so a seeded request
    samples the same tokens whatever else is in the batch.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], eos_token_ids: Sequence[int] = (), *,
                 token_ids: list[int] | None = None, tokenizer: BadWordsEncoder | None = None,
                 vocab_size: int | None = None) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.num_prompt_tokens = len(prompt_ids)
        self.token_ids = list(prompt_ids) if token_ids is None else token_ids
        if self.token_ids[: self.num_prompt_tokens] != list(prompt_ids):
            raise ValueError("token_ids must start with prompt_ids")
        self.eos_token_ids = tuple(eos_token_ids)
        if params.bad_words and tokenizer is None:
            raise ValueError("bad_words need a tokenizer to become token ids; pass bad_words_ids instead")
        words = tokenizer.encode_bad_words(params.bad_words) if params.bad_words and tokenizer else ()
        self.bad_words_ids: tuple[tuple[int, ...], ...] = tuple(w for w in params.bad_words_ids + tuple(words) if w)
        if vocab_size is not None:
            for name, ids in (("stop_token_ids", params.stop_token_ids), ("eos_token_ids", self.eos_token_ids),
                              ("logit_bias", tuple(t for t, _ in params.logit_bias)),
                              ("bad_words_ids", tuple(itertools.chain.from_iterable(self.bad_words_ids)))):
                if any(i >= vocab_size for i in ids):
                    raise ValueError(f"{name} must be token ids below the vocabulary size {vocab_size}, got {ids}")
        self._prompt_unique: np.ndarray | None = None
        self.guide = None
        if params.json_schema is not None:
            self.guide = _json_guide(params, tokenizer, vocab_size, self.eos_token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def append(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def masked_ids(self) -> list[int]:
        """Tokens the next draw must not pick: stop tokens before min_tokens, and bad words completed by them."""
        p = self.params
        banned = []
        if self.num_output_tokens < p.min_tokens:
            banned += p.stop_token_ids
            if not p.ignore_eos:
                banned += self.eos_token_ids
        for word in self.bad_words_ids:
            n = len(word) - 1
            if n == 0 or (n <= len(self.token_ids) and self.token_ids[-n:] == list(word[:-1])):
                banned.append(word[-1])
        return banned

    def changes_logits(self) -> bool:
        """Whether process_logits would change this request's row: masks, a JSON guide, penalties or biases."""
        p = self.params
        return bool(self.guide is not None or p.repetition_penalty != 1.0 or p.frequency_penalty
                    or p.presence_penalty or p.logit_bias or self.masked_ids())

    def seen_ids(self) -> np.ndarray:
        """Distinct token ids of prompt + output (what the repetition penalty applies to)."""
        if self._prompt_unique is None:
            self._prompt_unique = np.unique(np.asarray(self.prompt_ids, dtype=np.int64))
        return np.union1d(self._prompt_unique, np.asarray(self.output_ids, dtype=np.int64))


@dataclass(frozen=True)
class SampleOutput:
    token_ids: np.ndarray  # [N] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


def apply_masks(logits: np.ndarray, states: Sequence[SamplingState]) -> None:
    """Set the logits of each row's masked tokens (bad words, early EOS / stop tokens, what its JSON schema forbids)
    to -inf, in place."""
    pairs = [(row, t) for row, s in enumerate(states) for t in s.masked_ids()]
    if pairs:
        rows, ids = np.asarray(pairs, dtype=np.int64).T
        logits[rows, ids] = -np.inf
    for row, state in enumerate(states):
        if state.guide is not None:
            state.guide.mask(logits[row], state.output_ids)


def _json_guide(params: SamplingParams, tokenizer: object, vocab_size: int | None, eos: tuple[int, ...]):
    """The request's JSON matcher (runtime/guided.py), which needs the engine's tokenizer and vocabulary size."""
    from trtbuild.runtime.guided import JsonGuide

    if tokenizer is None or not hasattr(tokenizer, "to_json") or vocab_size is None:
        raise ConfigError("json_schema", "needs the engine's tokenizer (this engine has none)")
    return JsonGuide(params.json_schema, tokenizer, vocab_size, tuple(dict.fromkeys(
        eos + params.stop_token_ids)))


def apply_penalties(logits: np.ndarray, states: Sequence[SamplingState]) -> None:
    """Repetition (HF), then frequency and presence (OpenAI) penalties, in place on float32 logits [N, V].

    Sparse: only the (row, token) pairs a request has seen are touched, found at once for all rows via row * V + id.
    """
    vocab = logits.shape[1]
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        keys = np.concatenate([i * vocab + states[i].seen_ids() for i in rep])
        rows, ids = np.divmod(keys, vocab)
        penalty = np.array([s.params.repetition_penalty for s in states], dtype=np.float32)[rows]
        seen = logits[rows, ids]
        logits[rows, ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    additive = [i for i, s in enumerate(states) if s.params.frequency_penalty or s.params.presence_penalty]
    if additive:
        keys, counts = np.unique(np.concatenate(
            [i * vocab + np.asarray(states[i].output_ids, dtype=np.int64) for i in additive]), return_counts=True)
        rows, ids = np.divmod(keys, vocab)
        freq = np.array([s.params.frequency_penalty for s in states], dtype=np.float32)[rows]
        pres = np.array([s.params.presence_penalty for s in states], dtype=np.float32)[rows]
        logits[rows, ids] -= freq * counts.astype(np.float32)
        logits[rows, ids] -= pres


def process_logits(logits: np.ndarray, states: Sequence[SamplingState]) -> np.ndarray:
    """Masks, penalties, then logit biases on a float32 copy of logits [N, V] (the input is left as it is)."""
    if logits.ndim != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits must be [{len(states)}, vocab], got shape {logits.shape}")
    out = np.array(logits, dtype=np.float32, copy=True)
    apply_masks(out, states)
    apply_penalties(out, states)
    for row, state in enumerate(states):
        if state.params.logit_bias:
            ids, biases = zip(*state.params.logit_bias, strict=True)
            out[row, list(ids)] += np.asarray(biases, dtype=np.float32)
    return out


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a draw can pick from one processed logits row [V], and their probabilities (sum 1).

    Temperature, then top-k (every token at least as likely as the k-th, as HF), top-p (the smallest most-likely
    set with mass >= top_p, ties by lower id), min-p (tokens at least min_p times as likely as the most likely).
    """
    if params.greedy or not (logits > -np.inf).any():  # greedy, or all masked (token 0, as greedy's argmax)
        return np.array([np.argmax(logits)], dtype=np.int64), np.ones(1)
    ids = np.flatnonzero(logits > -np.inf)
    if params.top_k and params.top_k < ids.size:
        kth = np.partition(logits[ids], ids.size - params.top_k)[ids.size - params.top_k]
        ids = ids[logits[ids] >= kth]
    scaled = logits[ids].astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        ids, probs = _top_p(ids, probs, params.top_p)
    if params.min_p > 0:
        keep = probs >= params.min_p * probs.max()
        ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    nonzero = probs > 0  # NOTE: underflowed tokens must not be reachable by the inverse-CDF draw's rounding
    return ids[nonzero].astype(np.int64), probs[nonzero]


def _top_p(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest most-likely prefix (ties: lower id first) with mass >= top_p, renormalized."""
    if ids.size > TOP_P_HEAD:
        # NOTE: sort only the head of the distribution when it already holds top_p of the mass (the usual case for
        # a language model); all ties of its smallest value are in it, so its order is the full order's beginning.
        in_head = probs >= np.partition(probs, ids.size - TOP_P_HEAD)[ids.size - TOP_P_HEAD]
        head_ids, head, reached = _sorted_prefix(ids[in_head], probs[in_head], top_p)
        if reached:
            return head_ids, head
    return _sorted_prefix(ids, probs, top_p)[:2]


def _sorted_prefix(ids: np.ndarray, probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray, bool]:
    order = np.argsort(-probs, kind="stable")
    ids, probs = ids[order], probs[order]
    cumulative = np.cumsum(probs)
    keep = min(int(np.searchsorted(cumulative, top_p)) + 1, ids.size)
    return ids[:keep], probs[:keep] / probs[:keep].sum(), bool(cumulative[-1] >= top_p)


def draw(ids: np.ndarray, probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))  # exactly one draw per step
    return int(ids[min(index, ids.size - 1)])


class Sampler:
    """Picks one token per logits row; rows belong to different requests with their own parameters."""

    def sample(self, logits: np.ndarray, states: Sequence[SamplingState]) -> SampleOutput:
        """logits [N, V] -> the next token of each row's request. Does not record the tokens in the states."""
        if all(s.params.greedy and not s.changes_logits() for s in states):
            # NOTE: the common serving case, and no copy of [N, V] (10 MB at batch 16 over a 152k vocabulary)
            tokens = np.argmax(logits, axis=1)
        else:
            processed = process_logits(logits, states)
            tokens = np.empty(len(states), dtype=np.int64)
            greedy = np.array([s.params.greedy for s in states], dtype=bool)
            if greedy.any():
                tokens[greedy] = np.argmax(processed[greedy], axis=1)  # first maximum: ties go to the lowest id
            for i in np.flatnonzero(~greedy):
                tokens[i] = draw(*sampling_distribution(processed[i], states[i].params), states[i].rng)
        logprobs = [None if s.params.logprobs is None else token_logprobs(logits[i], int(tokens[i]), s.params.logprobs)
                    for i, s in enumerate(states)]
        return SampleOutput(tokens, logprobs)
