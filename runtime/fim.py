"""Fill-in-the-middle (FIM): the prompt a code model completes between a prefix and a suffix.

Code models (Qwen2.5-Coder, StarCoder 2, DeepSeek-Coder, CodeLlama, Granite Code) learned to write the
middle of a file from `[FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]`, their special tokens found by spelling as
llama.cpp finds them. Repository-level context (other files) goes before it, as Qwen2.5-Coder learned it and
llama.cpp's /infill sends it:

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n text0 ... [FIM_SEP]filename\\n [FIM_PRE]prefix[FIM_SUF]suffix[FIM_MID]

(without FIM_REP / FIM_SEP tokens, each file's text follows a "--- snippet ---" line). The middle ends at EOS or at
one of the FIM_PAD / FIM_REP / FIM_SEP tokens, which llama.cpp treats as ends of generation too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# each role's spellings, as llama.cpp's vocabulary loader looks them up
SPELLINGS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
               "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
               "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
               "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
}
REPO_NAME = "myproject"  # NOTE: llama.cpp's fixed project name: what its users' prompts were tuned with
CURRENT_FILE = "filename"
SNIPPET = "\n\n--- snippet ---\n\n"


class FimTokenizer(Protocol):
    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ExtraFile:
    """Another file of the repository, as context for the middle."""

    filename: str
    text: str


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    file_sep: int | None = None

    @classmethod
    def of(cls, tokenizer: FimTokenizer) -> FimTokens | None:
        """The tokenizer's FIM tokens; None when it lacks a prefix, suffix or middle token."""
        found = {role: next((i for s in spellings if (i := tokenizer.token_to_id(s)) is not None), None)
                 for role, spellings in SPELLINGS.items()}
        if None in (found["prefix"], found["suffix"], found["middle"]):
            return None
        return cls(**found)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens besides EOS that end a middle."""
        return tuple(i for i in (self.pad, self.repo, self.file_sep) if i is not None)


def infill_prompt(tokenizer: FimTokenizer, fim: FimTokens, prefix: str | Sequence[int], suffix: str,
                  extra: Sequence[ExtraFile] = (), prompt: str = "") -> list[int]:
    """The token ids of a FIM prompt: the tokenizer's leading special tokens (BOS where it adds one), the extra
    files, then prefix (and `prompt` after it: llama.cpp's /infill sends the cursor's line so), suffix and the
    middle token. A `prefix` given as token ids is used as it is."""
    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False)

    context: list[int] = []
    if fim.repo is not None:
        context += [fim.repo, *text(REPO_NAME + "\n")]
    for f in extra:
        context += [fim.file_sep, *text(f.filename + "\n")] if fim.file_sep is not None else text(SNIPPET)
        context += text(f.text)
    if fim.file_sep is not None:
        context += [fim.file_sep, *text(CURRENT_FILE + "\n")]
    head = text(prefix) if isinstance(prefix, str) else list(prefix)
    return [*leading_special_tokens(tokenizer), *context, fim.prefix, *head, *text(prompt), fim.suffix,
            *text(suffix), fim.middle]


def leading_special_tokens(tokenizer: FimTokenizer) -> list[int]:
    """What encode(..., add_special_tokens=True) puts before a text (BOS for Llama-like tokenizers, none for
    Qwen's)."""
    plain, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return full[:start]
