"""Tokenizer files of an engine directory, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from pathlib import Path

from trtbuild.errors import TrtbuildError


class Tokenizer:
    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise TrtbuildError(f"{directory} has no tokenizer.json; pass token ids or rebuild with tokenizer files.")
        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_generation_eos(directory: Path) -> tuple[int, ...]:
    """Extra end-of-sequence ids from generation_config.json, if the folder has one."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


class IncrementalDetokenizer:
    """Yields text as tokens arrive; holds back output while it ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_len = len(tokenizer.decode(self.ids))
        self.emitted = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)[self.prefix_len :]
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta
