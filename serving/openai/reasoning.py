"""A reasoning model's thinking, split from its answer: the text between `<think>` and `</think>` (Qwen3, DeepSeek-R1
and its distills, SmolLM3, ...) becomes the message's `reasoning_content`, as llama.cpp's server and vLLM's
reasoning parsers return it; the rest is `content` (where tool calls are then looked for).

Whether an answer starts inside its thinking depends on the prompt: DeepSeek-R1's template ends the generation
prompt with `<think>\\n`, so the answer holds only the closing tag; Qwen3's lets the model open it, or (with
`enable_thinking` false) writes an empty `<think></think>` itself, after which the answer is all content.
"""

from __future__ import annotations

from trtbuild.serving.openai.tool_calls import partial_marker

OPEN, CLOSE = "<think>", "</think>"


def teaches_reasoning(template_source: str) -> bool:
    """Whether a chat template knows the thinking tags (so its model's answers are split)."""
    return CLOSE in template_source


def opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open, so that the answer starts inside the thinking."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ReasoningSplitter:
    """One answer, fed as it streams: each `feed` returns (thinking, content) text; text that may be the start of a
    tag is held back until it is clear. The outputs of a stream concatenate to those of its whole text."""

    def __init__(self, inside: bool) -> None:
        self.state = "thinking" if inside else "start"  # start: before anything but white space was seen
        self.pending = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        thinking, content = "", ""
        while True:
            if self.state == "start":
                body = self.pending.lstrip()
                if body.startswith(OPEN):
                    self.state, self.pending = "thinking", body[len(OPEN):]
                    continue
                if not final and OPEN.startswith(body):  # white space, or the tag's first characters
                    return thinking, content
                self.state = "content"
            if self.state == "thinking":
                at = self.pending.find(CLOSE)
                if at >= 0:
                    thinking += self.pending[:at]
                    self.state, self.pending = "separator", self.pending[at + len(CLOSE):]
                    continue
                keep = 0 if final else partial_marker(self.pending, (CLOSE,))
                thinking += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return thinking, content
            if self.state == "separator":  # the new lines templates put between the thinking and the answer
                self.pending = self.pending.lstrip("\n")
                if not self.pending and not final:
                    return thinking, content
                self.state = "content"
            content += self.pending
            self.pending = ""
            return thinking, content
