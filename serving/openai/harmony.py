"""OpenAI's harmony response format (gpt-oss): an answer is a run of messages, each a header and a content,

    <|channel|>analysis<|message|>User asks ... Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>

and this module splits it into what the OpenAI API returns: the `analysis` channel (the chain of thought) becomes
`reasoning_content`, the `final` channel and the `commentary` channel's preambles (written for the user) `content`,
and a message to `functions.NAME` (its recipient, `to=functions.NAME`, in the header's role or channel part) a call
whose arguments are the message's content. Messages to built-in tools (`python`, `browser.*`) belong to the chain
of thought. The first header has no `<|start|>assistant`: the chat template's generation prompt wrote it.
`<|return|>` (the final answer is done) and `<|call|>` (a tool is to be called) end generation, so an answer seldom
holds them; `<|end|>` ends a message within it.

A harmony model's answer needs its special tokens, so its requests keep them in the text (skip_special_tokens
false); none of them is ever returned as text. Text that is not harmony at all (e.g. a client that asked to skip
the special tokens) is returned as content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trtbuild.serving.openai.tool_calls import ToolCall, partial_marker

NAME = "harmony"  # as `--tool-call-parser` names it
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
_ENDS = (END, RETURN, CALL, START)  # what ends a message's content (<|start|>: a message left without its end)
_HEADER_STARTS = ("<|", "to=")  # how a header the model writes begins (a token, or the recipient right after role)
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."


def teaches_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): its messages have channels."""
    return CHANNEL in template_source and MESSAGE in template_source


def call_header(function: str) -> str:
    """The header of a call of `function`, written after the generation prompt when the request names the function
    to call (tool_choice), so that the constrained JSON that follows is where the model would write it."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{function} {CONSTRAIN}json{MESSAGE}"


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as gpt-oss's template takes them: it writes one analysis message before an earlier call, from the
    assistant's `thinking` or its `content`, and refuses both; an OpenAI client that got both back (a preamble and
    the thinking) sends both, so they are joined into the thinking, which is where the template would put either."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls") and m.get("content") and m.get("reasoning_content"):
            m = {**m, "reasoning_content": f"{m['reasoning_content']}\n{m['content']}", "content": ""}
        out.append(m)
    return out


def described(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools with a description each (empty where the request gave none): gpt-oss's template writes every
    function's description as a comment without asking whether there is one, and fails on a missing one."""
    if tools is None:
        return None
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


class HarmonyParser:
    """One answer, fed as it streams: each `feed` returns (thinking, content, calls completed); text that may be the
    start of a special token is held back until it is clear. The outputs of a stream concatenate to those of its
    whole text. `reasoning` false: the analysis goes to the content too; `calls` false (the request offered no
    tools): a message to a function is content, as text that does not parse as a call is."""

    def __init__(self, reasoning: bool = True, calls: bool = True) -> None:
        self.reasoning, self.parse_calls = reasoning, calls
        self.pending = ""  # text not read yet
        self.kind: str | None = None  # the open message's: "thinking", "content" or "call"; None: in a header
        self.function, self.arguments = "", ""  # the open call's
        self.written: set[str] = set()  # the kinds some message already wrote text to
        self.fresh = False  # the open message wrote nothing yet
        self.calls: list[ToolCall] = []
        self._out: dict[str, str] = {}
        self._new: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        self.pending += delta
        self._out, self._new = {"thinking": "", "content": ""}, []
        more = True
        while more:  # each step reads a header or a content, as far as the text goes
            more = self._header(final) if self.kind is None else self._content(final)
        self.calls += self._new
        return self._out["thinking"], self._out["content"], self._new

    # ---- reading ----------------------------------------------------------------------------------------------------
    def _header(self, final: bool) -> bool:
        """Read up to the open message's content; whether there is more to read."""
        body = self.pending.lstrip()
        if body and not any(body.startswith(s) or s.startswith(body) for s in _HEADER_STARTS):
            self._start("content")  # not harmony: plain text, the user's
            return True
        at = self.pending.find(MESSAGE)
        end, marker = _first(self.pending, _ENDS[:3])
        if at >= 0 and (end < 0 or at < end):
            self._open(self.pending[:at])
            self.pending = self.pending[at + len(MESSAGE):]
            return True
        if end >= 0:  # a message that ended before its content began: a broken header, dropped
            self.pending = self.pending[end + len(marker):]
            return True
        if final:
            if body and not body.startswith(_HEADER_STARTS):  # a header's first letters ("t"): text after all
                self._start("content")
                self._write(self.pending)
            self.pending = ""  # white space, or a header cut short (max_tokens): nothing to say
        return False

    def _content(self, final: bool) -> bool:
        """Read the open message's content up to its end; whether there is more to read."""
        at, marker = _first(self.pending, _ENDS)
        if at >= 0:
            self._write(self.pending[:at])
            self.pending = self.pending[at + (0 if marker == START else len(marker)):]
            self._close()
            return True
        keep = 0 if final else partial_marker(self.pending, _ENDS)
        self._write(self.pending[:len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        if final:
            self._close()  # a call stops generation at <|call|>, which is not in the text: its arguments end here
        return False

    def _open(self, header: str) -> None:
        header = header[header.rfind(START):] if START in header else header  # the last message's, if several
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient and recipient.group(1).startswith(FUNCTIONS) and self.parse_calls:
            self.function, self.arguments = recipient.group(1)[len(FUNCTIONS):], ""
            self._start("call")
        elif recipient and not recipient.group(1).startswith(FUNCTIONS):  # a built-in tool's call: chain of thought
            self._start("thinking")
        else:
            self._start("thinking" if channel and channel.group(1) == "analysis" else "content")

    # ---- writing ----------------------------------------------------------------------------------------------------
    def _start(self, kind: str) -> None:
        self.kind = "content" if kind == "thinking" and not self.reasoning else kind
        self.fresh = True

    def _write(self, text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            self.arguments += text
            return
        kind = self.kind
        if self.fresh and kind in self.written:  # messages of one kind are joined by a new line, as vLLM joins them
            text = "\n" + text
        self._out[kind] += text
        self.written.add(kind)
        self.fresh = False

    def _close(self) -> None:
        if self.kind == "call":
            arguments = self.arguments.strip()
            if _is_object(arguments):
                self._new.append(ToolCall(self.function, arguments))
            else:  # malformed arguments (or cut short): the text stays the user's, as the other formats leave it
                self.kind = "content"
                self._write(self.arguments)
        self.kind = None


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the first of `markers` in `text`; (-1, "") when none is."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
