"""The tokenizer of an engine directory (Hugging Face `tokenizer.json`); streaming text is in detokenizer.py."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from trtbuild.errors import TrtbuildError


class Tokenizer:
    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise TrtbuildError(f"{directory} has no tokenizer.json; pass token ids or rebuild with tokenizer files.")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # NOTE: tokenizers raises a bare Exception for every parse error
            raise TrtbuildError(f"{path} is not a valid tokenizer ({_first_line(e)}); copy the model's tokenizer.json "
                                "into the engine directory again.") from None
        added = self._tok.get_added_tokens_decoder().items()
        self.special_tokens = {t.content: i for i, t in sorted(added) if t.special}  # text -> id
        self.special_ids = frozenset(self.special_tokens.values())
        self.byte_fallback_ids = _byte_fallback_ids(json.loads(self._tok.to_str()), self._tok.get_vocab())

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound of the UTF-8 bytes one token stands for (4 per character of its vocabulary entry: byte-level
        entries are one byte a character, others at most 4)."""
        return 4 * max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens adds what the tokenizer's template adds (e.g. BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for llguidance, runtime/guided.py)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode_bad_words(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids, encoded as given (no BOS or other special tokens)."""
        return tuple(tuple(self.encode(w, add_special_tokens=False)) for w in words)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_fallback_ids(config: dict, vocab: dict[str, int]) -> frozenset[int]:
    """Ids of <0xNN> tokens when the decoder has a ByteFallback step (sentencepiece-style), else none.

    ByteFallback turns a whole run of such tokens into text at once: a run that is not valid UTF-8 as a whole
    becomes one U+FFFD per byte, so text decoded from a run is only final once a non-byte token ends it.
    """

    def has_byte_fallback(decoder: dict | None) -> bool:
        if not decoder:
            return False
        return decoder.get("type") == "ByteFallback" or any(map(has_byte_fallback, decoder.get("decoders") or []))

    if not has_byte_fallback(config.get("decoder")):
        return frozenset()
    return frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))


def load_generation_eos(directory: Path) -> tuple[int, ...]:
    """Extra end-of-sequence ids from generation_config.json, if the folder has one."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        eos = doc.get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"eos_token_id {eos!r} is not a token id or a list of them")
    except (OSError, ValueError) as e:
        raise TrtbuildError(f"{path} is not a valid generation config ({_first_line(e)}); copy the model's "
                            "generation_config.json into the engine directory again, or delete it.") from None
    return tuple(ids)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
