"""Tool calls in a chat model's output: the formats model families write them in, and a parser that follows a
streamed answer, splitting it into the text meant for the user and the calls.

A format is found from the chat template's source (the markers it teaches the model), or named on the command line
(`trtbuild serve --tool-call-parser`), as vLLM's `--tool-call-parser` names them:
- `hermes` (Qwen 2.5 / 3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
  call, anywhere in the answer;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or (v11 tokenizers on)
  `[TOOL_CALLS]name[ARGS]{...}` per call;
- `granite` (Granite 3): `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, optionally closed by
  `<|/tool_call|>`;
- `llama3_json` (Llama 3.1 / 3.2): an answer that is JSON `{"name": ..., "parameters": {...}}` (calls separated by
  `;`), after an optional `<|python_tag|>`.
Text that does not parse as calls stays the answer's text, as vLLM leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def as_call(obj: Any) -> ToolCall | None:
    """A call from one parsed JSON object ({"name", "arguments" | "parameters"}, or that inside "function"); None
    when it is not one."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _all_calls(items: list[Any], region: str) -> tuple[list[ToolCall], str]:
    """(the calls, "") when every item is one, else (none, the region as the user's text)."""
    calls = [as_call(item) for item in items]
    return (calls, "") if calls and all(calls) else ([], region)


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of one of `markers`: text a stream holds back until
    the next delta says whether a marker begins there."""
    longest = max(map(len, markers)) - 1
    return next((n for n in range(min(len(text), longest), 0, -1) if any(m.startswith(text[-n:]) for m in markers)),
                0)


class ToolCallFormat(ABC):
    """One way of writing tool calls. Invariants (ToolCallParser relies on them): once `start` finds the calls'
    start in a text it finds the same index in every longer text with that prefix; `parse` of a growing region
    returns a growing list (a call, once complete, never changes)."""

    name: str
    markers: tuple[str, ...]  # the texts that open the calls (special tokens in some vocabularies)

    def call_id(self) -> str:
        """A new call's id, as the model's template accepts it back in later turns."""
        return f"call_{uuid.uuid4().hex[:24]}"

    @abstractmethod
    def start(self, text: str) -> int | None:
        """Where the calls begin in the answer so far; None: not (yet)."""

    def held(self, text: str) -> int:
        """Where text that may still turn out to start the calls begins (a marker's first characters at the end)."""
        return len(text) - partial_marker(text, self.markers)

    @abstractmethod
    def parse(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        """The complete calls in `region` (the answer from `start` on), and, when `final`, the text of the region
        that is not a call (the whole region when it holds no valid call)."""


class _FirstMarker(ToolCallFormat):
    def start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None


class Hermes(_FirstMarker):
    name, markers = "hermes", ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN_END = re.compile(r"<tool_call>((?:(?!</tool_call>).)*)\Z", re.DOTALL)

    def parse(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        calls, rest, at = [], [], 0
        for match in self._BLOCK.finditer(region):
            call = as_call(_json(match.group(1)))
            rest.append(region[at:match.start()] if call else region[at:match.end()])
            calls += [call] if call else []
            at = match.end()
        tail = region[at:]
        unclosed = self._OPEN_END.search(tail) if final else None  # a model may stop at EOS before closing
        if unclosed and (call := as_call(_json(unclosed.group(1)))):
            calls.append(call)
            tail = tail[:unclosed.start()]
        if not final:
            return calls, ""
        return calls, ("".join(rest) + tail).strip() if calls else region


class MarkedArray(_FirstMarker):
    """A marker, then a JSON array of calls (a single object is taken too), then an optional closing marker."""

    def __init__(self, name: str, markers: tuple[str, ...], closing: str = "", id_length: int = 0) -> None:
        """`id_length`: call ids of that many letters and digits (Mistral's templates take only 9), else OpenAI's."""
        self.name, self.markers, self.closing, self.id_length = name, markers, closing, id_length

    def call_id(self) -> str:
        if not self.id_length:
            return super().call_id()
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(self.id_length))

    def parse(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        if not final:
            return [], ""
        marker = next(m for m in self.markers if region.startswith(m))
        body = region[len(marker):].strip()
        if self.closing:
            body = body.split(self.closing, 1)[0].strip()
        decoded = _json(body)
        return _all_calls(decoded if isinstance(decoded, list) else [decoded], region)


class Llama3Json(ToolCallFormat):
    name, markers = "llama3_json", ("<|python_tag|>", "{")

    # NOTE: only the answer's start may open calls, so the calls' region is the whole answer (its leading white
    # space included, which is not the user's text either)
    def start(self, text: str) -> int | None:
        return 0 if text.lstrip().startswith(self.markers) else None

    def held(self, text: str) -> int:
        return 0 if self.markers[0].startswith(text.lstrip()) else len(text)

    def parse(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        if not final:
            return [], ""
        body = region.strip().removeprefix(self.markers[0]).strip()
        decoded = _json(body)
        if decoded is None:  # several calls: objects separated by ";"
            decoded = [_json(part) for part in body.split(";") if part.strip()]
        return _all_calls(decoded if isinstance(decoded, list) else [decoded], region)


class Mistral(MarkedArray):
    """`[TOOL_CALLS]` then a JSON array of calls (Mistral 7B v0.3, Nemo), or, from the v11 tokenizers on (Mistral
    Small 3, Magistral, Devstral), `name[ARGS]{...}` after each `[TOOL_CALLS]`."""

    def __init__(self) -> None:
        super().__init__("mistral", ("[TOOL_CALLS]",), id_length=9)

    def parse(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        if not final:
            return [], ""
        parts = [p.strip() for p in region.split(self.markers[0])[1:]]
        if not parts or parts[0].startswith(("[", "{")):
            return super().parse(region, final)
        items = []
        for part in parts:
            name, _, arguments = part.partition("[ARGS]")
            decoded = _json(arguments)
            items.append({"name": name.strip(), "arguments": decoded} if decoded is not None else None)
        return _all_calls(items, region)


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (
    Hermes(), Mistral(),
    MarkedArray("granite", ("<|tool_call|>",), closing="<|/tool_call|>"), Llama3Json())}


def format_of_template(source: str) -> ToolCallFormat | None:
    """The format a chat template teaches its model, from the markers it writes; None when it renders no tools."""
    if "tools" not in source:
        return None
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|tool_call|>", "granite"),
                         ("<|python_tag|>", "llama3_json"), ('"parameters"', "llama3_json")):
        if marker in source:
            return FORMATS[name]
    return None


class ToolCallParser:
    """One answer, fed as it streams: each `feed` returns the text that is surely the user's and the calls that
    completed. Text that may open calls is held back until it is clear; the concatenated outputs of a stream are
    those of feeding its whole text at once."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.format = fmt
        self.text, self.region_start = "", None
        self.emitted = 0  # characters of text returned as the user's
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.region_start is None:
            self.region_start = self.format.start(self.text)
        if self.region_start is None:
            end = len(self.text) if final else max(self.emitted, self.format.held(self.text))
            content, self.emitted = self.text[self.emitted:end], end
            return content, []
        content, self.emitted = self.text[self.emitted:self.region_start], self.region_start
        found, rest = self.format.parse(self.text[self.region_start:], final)
        new = [dataclasses.replace(c, id=self.format.call_id()) for c in found[len(self.calls):]]
        self.calls += new
        return content + rest, new


# ---- tool_choice "required" or a named function: the answer is constrained to the calls' JSON (as vLLM does) ------
def forced_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """The JSON schema of the answer: the named function's arguments, or (name None: "required") an array of at
    least one {"name", "parameters"} of any tool (at most one unless `parallel`)."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if name is not None:
        return json.dumps(functions[name])
    one_of = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
               "required": ["name", "parameters"], "additionalProperties": False} for n, p in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}, **({} if parallel else {"maxItems": 1})}
    return json.dumps(schema)


def forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """The calls of an answer constrained by `forced_schema` (none when it was cut short, e.g. by max_tokens)."""
    if name is not None:
        return [ToolCall(name, text)] if _json(text) is not None else []
    decoded = _json(text)
    calls = [as_call(item) for item in decoded] if isinstance(decoded, list) else []
    return [c for c in calls if c is not None]
