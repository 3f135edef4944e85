"""What /v1/completions adds to the chat endpoint's machinery: a batch of prompts, and `echo`.

A request's `prompt` is one text, one list of token ids, or a batch of either; each prompt gets `n` choices, numbered
prompt by prompt (choice i * n + j is prompt i's j-th sample, as vLLM numbers them). With `echo` a choice's text starts
with its prompt, and with `logprobs` its logprobs start with the prompt tokens' (the first token's is null: nothing
predicts it), computed from the logits of every prompt position (SamplingParams.prompt_logprobs). `max_tokens` 0 with
`echo` returns the prompt alone: how lm-evaluation-harness and other scoring clients read a text's log-likelihood.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trtbuild.runtime.engine_core import RequestOutput
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.serving.requests import Accumulated

# (token id, its logprobs or None: the prompt's first token, or logprobs not asked for)
ScoredToken = tuple[int, TokenLogprobs | None]


@dataclass(frozen=True)
class Prompt:
    text: str | None  # as the client sent it; None for token ids
    token_ids: list[int]


def completion_prompts(prompt: str | list, encode: Callable[[str], list[int]],
                       infill: Callable[[str | list[int]], list[int]] | None = None) -> list[Prompt]:
    """The request's prompts, in order (ValueError for an empty batch or an empty prompt). With `infill` each
    prompt, text or token ids, is the prefix of a fill-in-the-middle prompt."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise ValueError("prompt: the batch of prompts is empty")
    if infill is not None:
        return [Prompt(p, infill(p)) if isinstance(p, str) else Prompt(None, infill([int(t) for t in p]))
                for p in prompt]
    prompts = [Prompt(p, encode(p)) if isinstance(p, str) else Prompt(None, [int(t) for t in p]) for p in prompt]
    if empty := [i for i, p in enumerate(prompts) if not p.token_ids]:
        raise ValueError(f"prompt: prompt {empty[0]} of the batch is empty" if len(prompts) > 1 else "prompt is empty")
    return prompts


class EchoedChoice:
    """One choice as the client sees it: with `echo`, the prompt before the output; with `echo_only` (max_tokens 0),
    the prompt alone (the one token the engine samples to finish the prompt's pass is dropped)."""

    def __init__(self, prompt: Prompt, prompt_text: str, echo: bool, echo_only: bool) -> None:
        self.prompt, self.prompt_text = prompt, prompt_text
        self.echo, self.echo_only = echo, echo_only
        self.echoed = False
        self.text_offset = 0  # the next token's: the lengths of the earlier tokens' texts added up (as vLLM)
        self.num_output_tokens = 0

    def take(self, output: RequestOutput) -> tuple[str, list[ScoredToken]]:
        """The text and tokens a delta adds to the choice (streaming)."""
        return self._add(output.new_text, len(output.new_token_ids), output.logprobs, output.prompt_logprobs)

    def whole(self, answer: Accumulated) -> tuple[str, list[ScoredToken]]:
        """The choice's text and tokens from its deltas added up."""
        return self._add(answer.text, len(answer.token_ids), answer.logprobs, answer.prompt_logprobs)

    def _add(self, text: str, num_tokens: int, logprobs: list[TokenLogprobs],
             prompt_logprobs: Sequence[TokenLogprobs | None] | None) -> tuple[str, list[ScoredToken]]:
        shown, tokens = "", []
        if self.echo and not self.echoed:
            self.echoed = True
            scores = prompt_logprobs or [None] * len(self.prompt.token_ids)
            shown, tokens = self.prompt_text, list(zip(self.prompt.token_ids, scores, strict=True))
        if not self.echo_only:
            shown += text
            tokens += [(lp.token_id, lp) for lp in logprobs]
            self.num_output_tokens += num_tokens
        return shown, tokens

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's reason; "length" for the prompt alone (max_tokens 0 was reached at once)."""
        return "length" if self.echo_only and reason is not None else reason
