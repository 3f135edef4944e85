"""What a chat request's `tools` and `tool_choice` ask of the server, and its answers split into text and calls.

- no tools, or tool_choice "none": a plain answer (the tools are not rendered, so the model is not told of them);
- "auto" (the default with tools): the template renders the tools; the answer is parsed in the model's format
  (tool_calls.py, or harmony.py for gpt-oss): its calls become `tool_calls`, the rest the message's content;
- "required" or a named function: the template renders the tools and the answer is constrained to the calls' JSON
  (guided decoding, runtime/guided.py), as vLLM does; it is all calls.
An answer with calls that ended naturally finishes with "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from trtbuild.errors import ConfigError
from trtbuild.serving.openai import protocol as api
from trtbuild.serving.openai.harmony import NAME as HARMONY
from trtbuild.serving.openai.tool_calls import (
    FORMATS,
    ToolCall,
    ToolCallFormat,
    ToolCallParser,
    forced_calls,
    forced_schema,
)

SERVE_FLAG = "--tool-call-parser"


class AnswerSplitter(Protocol):
    calls: list[ToolCall]

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The user's text and the calls that `delta` completes (everything left, when `final`)."""


class ForcedAnswer:
    """An answer constrained to calls: nothing until it ends, then its calls (or, if it was cut short, its text)."""

    def __init__(self, name: str | None) -> None:
        self.name, self.text, self.calls = name, "", []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if not final:
            return "", []
        self.calls = forced_calls(self.text, self.name)
        return ("", self.calls) if self.calls else (self.text, [])


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict[str, Any]] | None = None  # what the template renders
    format: ToolCallFormat | None = None  # "auto": how the answer is parsed
    forced: bool = False
    function: str | None = None  # forced: the one function to call (None: any)
    parallel: bool = True
    keep_special_tokens: bool = False  # the format's markers are special tokens, which the text must keep

    @property
    def active(self) -> bool:
        return self.tools is not None

    @property
    def json_schema(self) -> str | None:
        return forced_schema(self.tools, self.function, self.parallel) if self.forced else None

    def splitter(self) -> AnswerSplitter | None:
        """None: no format to parse the answer in (a harmony answer's calls are read with its channels, harmony.py,
        and one constrained to a response_format's JSON has none)."""
        if self.forced:
            return ForcedAnswer(self.function)
        return ToolCallParser(self.format) if self.format is not None else None


NO_TOOLS = ToolUse()


def tool_use(r: api.ChatCompletionRequest, renders_tools: bool, fmt: ToolCallFormat | None,
             special_tokens: frozenset[str], harmony: bool = False) -> ToolUse:
    """The request's tool use, or ConfigError naming the field that cannot be honoured. `renders_tools`: whether
    the model's chat template writes tools; `fmt`: the server's tool call format (None: the template teaches none);
    `special_tokens`: the vocabulary's special tokens' texts; `harmony`: the model answers in harmony, whose calls
    harmony.py parses (with its channels), in place of a format."""
    forced, function = r.forced_tool()
    if not r.tools:
        if forced:
            raise ConfigError("tool_choice", "asks for a tool call but the request lists no tools")
        return NO_TOOLS
    if r.tool_choice == "none":
        return NO_TOOLS
    tools = [t.model_dump(exclude_none=True) for t in r.tools]
    names = [t["function"]["name"] for t in tools]
    if function is not None and function not in names:
        raise ConfigError("tool_choice", f"names the function {function!r}, which is not in tools ({names})")
    if not renders_tools:
        raise ConfigError("tools", "this model's chat template does not write tools into the prompt, so the model "
                                   "would never see them; serve a model whose template does")
    if forced:
        if r.response_format is not None and r.response_format.type != "text":
            raise ConfigError("response_format", "cannot be combined with a required or named tool_choice")
        return ToolUse(tools, None, True, function, r.parallel_tool_calls)
    if harmony:
        return ToolUse(tools, None, False, None, r.parallel_tool_calls, keep_special_tokens=True)
    if fmt is None:
        raise ConfigError("tool_choice", f"\"auto\" needs to know how the model writes its calls, and its chat "
                                         f"template names no known format: restart the server with {SERVE_FLAG} "
                                         f"({', '.join([*FORMATS, HARMONY])}), or ask for tool_choice \"required\" "
                                         f"or a function")
    keep = any(m in special_tokens for m in fmt.markers)
    return ToolUse(tools, fmt, False, None, r.parallel_tool_calls, keep)
