"""One chat choice's answer as the OpenAI API returns it: the thinking (`reasoning_content`, reasoning.py), the text
(`content`) and the tool calls (`tool_calls`, tool_use.py), built as it streams or from its whole text. A harmony
model's answer (gpt-oss, harmony.py) is split into all three by its channels at once."""

from __future__ import annotations

from typing import Any

from trtbuild.serving.openai.harmony import HarmonyParser
from trtbuild.serving.openai.reasoning import ReasoningSplitter
from trtbuild.serving.openai.tool_calls import ToolCall
from trtbuild.serving.openai.tool_use import ToolUse


class ChatAnswer:
    """`reasoning_inside`: None for an answer without thinking to split off, else whether it starts inside it.
    `harmony`: the answer is in the harmony format (its analysis is the thinking unless `reasoning_inside` is None;
    its calls are parsed when `tools` are active)."""

    def __init__(self, tools: ToolUse, reasoning_inside: bool | None, harmony: bool = False) -> None:
        self.tools = tools
        self.harmony = HarmonyParser(reasoning_inside is not None, tools.active) if harmony else None
        self.reasoning = None if harmony or reasoning_inside is None else ReasoningSplitter(reasoning_inside)
        self.splitter = tools.splitter() if tools.active and not harmony else None
        self.calls: list[ToolCall] = []  # the calls returned so far
        self.found = 0  # the calls the answer holds so far (more than returned when parallel calls are not asked)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        """(thinking, content, new calls) that `delta` makes final (everything left, when `final`)."""
        found: list[ToolCall] = []
        if self.harmony is not None:
            thinking, content, found = self.harmony.feed(delta, final)
        else:
            thinking, content = self.reasoning.feed(delta, final) if self.reasoning else ("", delta)
            if self.splitter is not None:
                content, found = self.splitter.feed(content, final)
        calls = [c for j, c in enumerate(found) if self.tools.parallel or self.found + j == 0]
        self.found += len(found)
        self.calls += calls
        return thinking, content, calls

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as the assistant message."""
        thinking, content, calls = self.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": content or None if calls else content}
        if thinking:
            message["reasoning_content"] = thinking
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's delta for the next piece of the answer: content ("" while nothing is final yet, as
        every chunk of a plain answer carries one), reasoning_content, and the calls it completed (indexed)."""
        before = len(self.calls)
        thinking, content, calls = self.feed(text, final)
        delta: dict[str, Any] = {}
        if thinking:
            delta["reasoning_content"] = thinking
        if content or (not final and not calls and not thinking):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": before + j, **c.as_openai()} for j, c in enumerate(calls)]
        return delta

    @property
    def called(self) -> bool:
        return bool(self.calls)
