"""Streaming detokenization: token ids in, text deltas out, with stop strings, in O(1) tokens of decoding per step.

Only a sliding window is decoded (vLLM's prefix_offset / read_offset): the tokens of the last emitted delta
(`prefix`) and those after them. The new text is what decoding the whole window adds to decoding the prefix; the
prefix gives the new tokens their context (a sentencepiece leading space is stripped only at the window start).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from trtbuild.runtime.sampling import SamplingParams

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens (vLLM's value)


class DecodingTokenizer(Protocol):
    special_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's output as its tokens arrive, never emitting broken UTF-8 or part of a stop string.

    The deltas concatenate to decode(prompt + output) minus decode(prompt), cut at the first stop string. Text is
    held back while it may still change: it ends in U+FFFD (an incomplete UTF-8 sequence) or in an unfinished run of
    byte-fallback tokens, or its end could be the start of a stop string. Special tokens are skipped unless the
    request's `skip_special_tokens` is False.
    """

    def __init__(self, tokenizer: DecodingTokenizer, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        # NOTE: skipped special tokens are dropped up front: a window prefix of only such tokens would decode to ""
        # and let the decoder strip the next token's leading space, which the full decode keeps.
        self._skipped = tokenizer.special_ids if params.skip_special_tokens else frozenset()
        self._ids = [i for i in prompt_ids if i not in self._skipped]
        self._prefix_offset = max(len(self._ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        self._text = ""  # output text decoded so far, cut at a stop string
        self._emitted = 0  # characters of _text returned so far
        self._max_stop_len = max(map(len, params.stop), default=0)
        self.finished_by_stop: str | None = None

    @property
    def output_text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text it makes final (often "", e.g. mid-character).

        After a stop string was found, further tokens are ignored and "" is returned.
        """
        if self.finished_by_stop is not None:
            return ""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        return self._emit(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """The held-back text, when generation ended for another reason than a stop string (EOS, length, abort)."""
        if self.finished_by_stop is not None:
            return ""
        return self._emit(self._decode_window(final=True), final=True)

    def _decode_window(self, final: bool) -> str:
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        text = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        unfinished = text.endswith("\ufffd") or (self._ids and self._ids[-1] in self.tokenizer.byte_fallback_ids)
        if len(text) <= len(prefix) or (unfinished and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix) :]

    def _emit(self, delta: str, final: bool) -> str:
        start = len(self._text)
        self._text += delta
        if self.params.stop and delta:
            hit = self._find_stop(start)
            if hit is not None:
                index, stop = hit
                self._text = self._text[: index + len(stop) if self.params.include_stop_str_in_output else index]
                self.finished_by_stop = stop
                final = True
        end = len(self._text) if final else max(self._emitted, len(self._text) - self._stop_prefix_len())
        out, self._emitted = self._text[self._emitted : end], end
        return out

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in the text from `start` on (ties: the first listed)."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self._text.find(stop, max(start - len(stop) + 1, 0))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of the text that is the start of a stop string (held back until it resolves)."""
        for n in range(min(self._max_stop_len - 1, len(self._text) - self._emitted), 0, -1):
            tail = self._text[-n:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return n
        return 0
