"""Streaming detokenization with the real stories260K tokenizer (sentencepiece BPE with byte fallback) and a byte-level
stand-in: deltas add up to the full decode, never carry U+FFFD or part of a stop string, and decoding stays linear."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import STORIES260K, require_shared_models

from trtbuild.runtime.detokenizer import IncrementalDetokenizer
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.tokenizer import Tokenizer

BOS, EOS = 1, 2
STORY = "Once upon a time there was a little dog. The dog was happy. The end"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    require_shared_models()
    return Tokenizer(STORIES260K)


def stream(tok, prompt_ids, output_ids, **params) -> tuple[list[str], str, IncrementalDetokenizer]:
    """Deltas of each added token, the flushed rest, and the detokenizer."""
    d = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(**params))
    deltas = [d.add(t) for t in output_ids]
    return deltas, d.flush(), d


def expected_text(tok, prompt_ids, output_ids) -> str:
    full, prompt = tok.decode(prompt_ids + output_ids), tok.decode(prompt_ids)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def test_tokenizer_knows_its_special_and_byte_tokens(tok):
    assert tok.special_ids == {0, 1, 2}
    assert len(tok.byte_fallback_ids) == 256 and tok.encode("😀", add_special_tokens=False)[-1] in tok.byte_fallback_ids
    assert tok.encode("hi")[0] == BOS and BOS not in tok.encode("hi", add_special_tokens=False)
    assert tok.decode([BOS, *tok.encode("hi", add_special_tokens=False)], skip_special_tokens=False) == "<s> hi"


@pytest.mark.parametrize("prompt, text", [
    ("", "Once upon a time, there was a girl named Lily."),
    ("Once upon a time", " there was a café with 😀 and 日本語 signs, naïve ünïcödé!"),
    ("The cat said", " 🐱🐶 €100  two  spaces\nnew line\ttab"),
])
def test_incremental_text_equals_the_full_decode(tok, prompt, text):
    prompt_ids = tok.encode(prompt) if prompt else []
    output_ids = tok.encode(text, add_special_tokens=False)
    deltas, rest, d = stream(tok, prompt_ids, output_ids)
    assert "".join(deltas) + rest == expected_text(tok, prompt_ids, output_ids)
    assert not any("\ufffd" in x for x in deltas)
    assert d.output_text == "".join(deltas) + rest


def test_incremental_text_equals_the_full_decode_on_random_tokens(tok):
    """Random ids include special tokens and invalid byte-fallback runs (decoded as one U+FFFD per byte)."""
    special_tail = [*tok.encode("Once"), *[EOS] * 5]  # the first decoding window's prefix would be all special
    prompts = [[], [BOS], tok.encode("Once upon a time"), tok.encode("A café"), special_tail]
    for seed in range(200):
        rng = np.random.default_rng(seed)
        prompt_ids = prompts[seed % len(prompts)]
        output_ids = rng.integers(0, 512, size=300).tolist()
        deltas, rest, _ = stream(tok, prompt_ids, output_ids)
        assert "".join(deltas) + rest == expected_text(tok, prompt_ids, output_ids), f"seed {seed}"


class CountingTokenizer:
    def __init__(self, inner) -> None:
        self.inner, self.decoded = inner, 0
        self.special_ids, self.byte_fallback_ids = inner.special_ids, inner.byte_fallback_ids

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


def test_decoding_work_is_linear_in_the_output_length(tok):
    counting = CountingTokenizer(tok)
    rng = np.random.default_rng(0)
    story = tok.encode(STORY * 40 + " café 😀", add_special_tokens=False)
    output_ids = story + rng.integers(0, 512, size=2000).tolist()
    deltas, rest, _ = stream(counting, tok.encode("Once"), output_ids)
    assert "".join(deltas) + rest == expected_text(tok, tok.encode("Once"), output_ids)
    assert counting.decoded < 12 * len(output_ids)  # re-decoding everything would be ~ n^2 / 2 = 4.6M


def test_multibyte_characters_from_byte_fallback_tokens_never_yield_replacement_chars(tok):
    ids = tok.encode("café 😀")
    assert sum(i in tok.byte_fallback_ids for i in ids) == 4  # the emoji is four <0x..> tokens
    deltas, rest, _ = stream(tok, ids[:1], ids[1:])
    assert "".join(deltas) + rest == "café 😀"
    assert not any("\ufffd" in x for x in [*deltas, rest])
    ids = tok.encode("😀 and 日本")
    deltas, rest, _ = stream(tok, ids[:1], ids[1:])
    assert "😀 and" in deltas and rest == "日本"  # whole characters, once the byte run ended


class ByteTokenizer:
    """Byte-level stand-in (as GPT-2-style BPE): token i is byte i; partial UTF-8 decodes to U+FFFD."""

    special_ids: frozenset[int] = frozenset()
    byte_fallback_ids: frozenset[int] = frozenset()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_byte_level_text_split_mid_character_is_held_back():
    text = "naïve 😀 日本語 ok €"
    ids = list(text.encode())
    deltas, rest, _ = stream(ByteTokenizer(), list(b"Hi "), ids)
    assert "".join(deltas) + rest == text
    assert not any("\ufffd" in x for x in [*deltas, rest])
    assert "😀" in deltas  # emitted as soon as its last byte arrived
    deltas, rest, _ = stream(ByteTokenizer(), [], [0xF0, 0x9F, ord("a"), 0xE2])  # invalid bytes stay visible
    assert "".join(deltas) == "\ufffda" and rest == "\ufffd"


def test_stop_string_across_tokens_is_never_partly_emitted(tok):
    ids = tok.encode(STORY)
    expected = "Once upon a time there was a "
    d = IncrementalDetokenizer(tok, ids[:1], SamplingParams(stop=("little dog",)))
    for t in ids[1:]:
        d.add(t)
        assert expected.startswith(d.output_text)  # no piece of "little dog" ever went out
        if d.finished_by_stop:
            break
    assert d.output_text == expected and d.finished_by_stop == "little dog"
    assert d.add(ids[-1]) == "" and d.flush() == ""  # nothing after a stop


def test_stop_string_included_in_output(tok):
    ids = tok.encode(STORY)
    deltas, rest, d = stream(tok, ids[:1], ids[1:], stop=("dog was",), include_stop_str_in_output=True)
    assert "".join(deltas) + rest == "Once upon a time there was a little dog. The dog was"
    assert d.finished_by_stop == "dog was"


def test_earliest_stop_string_wins_and_prompt_text_does_not_stop(tok):
    prompt = tok.encode("The happy dog")
    output = tok.encode(" saw a little dog. The dog was happy.", add_special_tokens=False)
    deltas, rest, d = stream(tok, prompt, output, stop=("happy", "dog"))
    assert "".join(deltas) + rest == " saw a little " and d.finished_by_stop == "dog"


def test_partial_stop_match_is_released_when_the_text_diverges(tok):
    ids = tok.encode(STORY)
    d = IncrementalDetokenizer(tok, ids[:1], SamplingParams(stop=("little cat", "The end!")))
    deltas = [d.add(t) for t in ids[1:]]
    joined = "".join(deltas)
    assert " little dog." in joined and d.finished_by_stop is None
    assert joined == STORY[: -len("The end")]  # "The end" may still become "The end!": held back
    assert d.flush() == "The end" and d.output_text == STORY


def test_special_tokens_add_no_text(tok):
    ids = tok.encode("Once upon")
    deltas, rest, _ = stream(tok, ids[:1], [*ids[1:], EOS, BOS])
    assert deltas[-2:] == ["", ""] and "".join(deltas) + rest == "Once upon"
