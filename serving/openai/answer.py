"""One chat choice's answer as the OpenAI API returns it: the thinking (`reasoning_content`, reasoning.py), the text
(`content`) and the tool calls (`tool_calls`, tool_use.py), built as it streams or from its whole text."""

from __future__ import annotations

from typing import Any

from trtbuild.serving.openai.reasoning import ReasoningSplitter
from trtbuild.serving.openai.tool_calls import ToolCall
from trtbuild.serving.openai.tool_use import ToolUse


class ChatAnswer:
    """`reasoning_inside`: None for an answer without thinking to split off, else whether it starts inside it."""

    def __init__(self, tools: ToolUse, reasoning_inside: bool | None) -> None:
        self.tools = tools
        self.reasoning = None if reasoning_inside is None else ReasoningSplitter(reasoning_inside)
        self.splitter = tools.splitter() if tools.active else None
        self.calls: list[ToolCall] = []  # the calls returned so far

    def feed(self, delta: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        """(thinking, content, new calls) that `delta` makes final (everything left, when `final`)."""
        thinking, content = self.reasoning.feed(delta, final) if self.reasoning else ("", delta)
        calls: list[ToolCall] = []
        if self.splitter is not None:
            before = len(self.splitter.calls)
            content, found = self.splitter.feed(content, final)
            calls = [c for j, c in enumerate(found) if self.tools.parallel or before + j == 0]
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
