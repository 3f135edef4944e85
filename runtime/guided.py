"""Guided decoding: output constrained to a JSON schema (OpenAI's `response_format`), by llguidance.

Before each draw, a request's matcher gives the tokens its grammar allows next as a bitmask; the others' logits
become -inf. Each appended token advances the matcher. Once the JSON is complete only the stop tokens (EOS and the
request's stop_token_ids) remain allowed, so the request ends there.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import numpy as np

from trtbuild.errors import ConfigError

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format {"type": "json_object"}
# NOTE: compact JSON unless the schema's "x-guidance" says otherwise: with free whitespace, small models fill their
# token budget with newlines between a key and its colon
COMPILE_DEFAULTS = {"whitespace_flexible": False}


def check_schema(schema: str) -> None:
    """A JSON schema llguidance can compile (ConfigError naming json_schema otherwise)."""
    import llguidance

    try:
        json.loads(schema)
    except ValueError as e:
        raise ConfigError("json_schema", f"is not valid JSON ({e})") from None
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, COMPILE_DEFAULTS)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ConfigError("json_schema", f"cannot be compiled: {error.splitlines()[0]}")


@lru_cache(maxsize=8)
def _guidance_tokenizer(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """llguidance's view of an engine's Tokenizer (about 1 s to build, so cached per tokenizer object and stop
    tokens: a request serializes nothing)."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=list(stop_ids))


class JsonGuide:
    """One request's matcher. `mask` first catches up with the output tokens appended since (`sync`): the token list
    is the request's own, which the scheduler appends to."""

    def __init__(self, schema: str, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        """`tokenizer`: the engine's runtime.tokenizer.Tokenizer (its `to_json` is read once per tokenizer)."""
        import llguidance

        if not stop_ids:
            raise ConfigError("json_schema", "needs a stop token (the model's EOS) to end the output at")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, COMPILE_DEFAULTS)
        self.matcher = llguidance.LLMatcher(_guidance_tokenizer(tokenizer, vocab_size, stop_ids), grammar,
                                            log_level=0)
        self.vocab_size, self.consumed = vocab_size, 0
        self._mask = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def sync(self, output_ids: list[int]) -> None:
        """Consume the output tokens not consumed yet."""
        for token in output_ids[self.consumed:]:
            if not self.matcher.is_stopped():
                self.matcher.consume_token(int(token))
        self.consumed = len(output_ids)

    def mask(self, logits: np.ndarray, output_ids: list[int]) -> None:
        """Set the logits [V] of the tokens the grammar forbids after `output_ids` to -inf, in place."""
        self.sync(output_ids)
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        logits[~allowed] = -np.inf
