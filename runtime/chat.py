"""A model's chat template (from its tokenizer files), rendered with jinja2 as transformers' apply_chat_template does.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a string, or
transformers' list form [{"name": ..., "template": ...}], of which "default" is used); GGUF conversion writes it
there. The rendered text already holds every special token the template writes (BOS included), so it is encoded
without adding special tokens again (`ChatTemplate.encode`).
"""

from __future__ import annotations

import functools
import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtbuild.errors import TrtbuildError

if TYPE_CHECKING:
    from trtbuild.runtime.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# The assistant's answer in the probe conversation that finds the end-of-turn token: text no template writes itself.
_PROBE_ANSWER = "trtbuild-probe-answer-7f3a"
_PROBE_TOOL = "trtbuild_probe_tool_7f3a"  # a function name no template writes itself


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool" (a tool's result)
    content: str
    # an assistant's calls, as transformers' templates read them: {"type": "function", "function": {"name": ...,
    # "arguments": {...}}}, arguments a dict where they are a JSON object (templates write them with tojson)
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None  # a tool message's answer to this call
    reasoning_content: str | None = None  # an assistant's thinking (Qwen3's templates read it; gpt-oss's: `thinking`)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role {self.role!r} is not supported; use one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise ValueError(f"message content must be a string, got {type(self.content).__name__}")
        if self.reasoning_content is not None and not isinstance(self.reasoning_content, str):
            raise ValueError(f"message reasoning_content must be a string, got "
                             f"{type(self.reasoning_content).__name__}")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:  # under both names templates read it by
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


def as_message(message: ChatMessage | Mapping[str, Any]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        raise ValueError(f"a message must have a role and a content, got {message!r}")
    thinking = message.get("reasoning_content", message.get("thinking"))
    return ChatMessage(message["role"], message["content"], tuple(message.get("tool_calls") or ()),
                       message.get("tool_call_id"), thinking)


class ChatTemplate:
    """One chat template, compiled once; `special_tokens` are the template's variables bos_token, eos_token, ..."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        import jinja2

        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {_one_line(e)}") from None
        self._end_of_turn = self._find_end_of_turn(tokenizer) if tokenizer is not None else ()

    @classmethod
    def from_engine_dir(cls, directory: Path) -> ChatTemplate | None:
        """The template of an engine (or checkpoint, or HF) directory; None when the model has no chat template."""
        from trtbuild.runtime.tokenizer import Tokenizer

        directory = Path(directory)
        config = _read_json(directory / "tokenizer_config.json")
        source = _template_source(directory, config)
        if source is None:
            return None
        tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").is_file() else None
        return cls(source, named_special_tokens(directory), tokenizer)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template writes the `tools` it is given into the prompt (transformers' `tools` variable).
        NOTE: found by rendering, not by reading the source: Phi-4-mini's template names "tools" but reads them from
        the system message, where OpenAI clients never put them."""
        # NOTE: with a description, which gpt-oss's template writes without asking whether there is one
        probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "A probe.",
                                                   "parameters": {"type": "object"}}}]
        try:
            return _PROBE_TOOL in self.render([{"role": "user", "content": "x"}], tools=probe)
        except ValueError:
            return False

    def render(self, messages: Sequence[ChatMessage | dict], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, variables: Mapping[str, Any] | None = None) -> str:
        """The conversation as the model's prompt text; ValueError for a bad message or a template error. `tools`:
        the functions the model may call, as the OpenAI API lists them ({"type": "function", "function": {...}});
        `variables`: more of the template's variables (e.g. Qwen3's enable_thinking), none of those set here."""
        chat = [m.for_template() for m in map(as_message, messages)]
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        reserved = {"messages", "tools", "add_generation_prompt", *self.special_tokens}
        if clash := sorted(reserved & set(variables or {})):
            raise ValueError(f"chat template variables {clash} are set from the request itself; leave them out")
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra, **(variables or {}))
        except Exception as e:  # NOTE: a template is code: any error in it (TemplateError, TypeError) is the model's
            raise ValueError(f"chat template: {_one_line(e)}") from None

    def encode(self, tokenizer: Tokenizer, messages: Sequence[ChatMessage | dict], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt token ids of the conversation: the rendered text, without adding special tokens (BOS) again."""
        return tokenizer.encode(self.render(messages, add_generation_prompt, tools), add_special_tokens=False)

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn (to stop on), e.g. <|im_end|>; empty if unknown."""
        return self._end_of_turn

    def _find_end_of_turn(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The special token the template writes right after an assistant's answer, else the EOS token; then the one
        it writes right after an assistant's tool call where that ends the conversation, as gpt-oss's <|call|> does
        (harmony's answers end at <|return|>, and at <|call|> when they call a tool, the turn going on after the
        tool's result): generation stops there too. A token after a call that more text follows (Kimi's
        <|tool_call_end|>, between parallel calls) ends no turn."""
        candidates = dict(tokenizer.special_tokens)
        named = {t: tokenizer.token_to_id(t) for t in self.special_tokens.values()}
        candidates.update({t: i for t, i in named.items() if i is not None})
        user = {"role": "user", "content": "x"}
        answer = self._token_after([user, {"role": "assistant", "content": _PROBE_ANSWER}], candidates)
        if answer is None:
            eos = self.special_tokens.get("eos_token")
            answer = tokenizer.token_to_id(eos) if eos else None
        call = {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"probe": _PROBE_ANSWER}}}
        after_call = self._token_after([user, {"role": "assistant", "content": "", "tool_calls": [call]}], candidates,
                                       closing='"}', last=True)
        return tuple(dict.fromkeys(i for i in (answer, after_call) if i is not None))

    def _token_after(self, probe: list[dict], candidates: dict[str, int], closing: str = "",
                     last: bool = False) -> int | None:
        """The id of the special token the template writes after the probe answer's text in `probe` (past white space
        and `closing` characters), if it writes one (and, `last`: nothing after it)."""
        try:
            text = self.render(probe, add_generation_prompt=False)
        except ValueError:  # e.g. a template that insists on a system message, or takes no tool calls
            return None
        at = text.rfind(_PROBE_ANSWER)
        if at < 0:
            return None
        # Llama 2 writes " </s>", Llama 3 trims the answer; a call's arguments close with `"}` (tojson)
        after = text[at + len(_PROBE_ANSWER):].lstrip(closing + string.whitespace)
        for token in sorted(candidates, key=len, reverse=True):
            if token and after.startswith(token) and not (last and after[len(token):].strip()):
                return candidates[token]
        return None


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # jinja2's own escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_source(directory: Path, config: dict) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (its "default" in the list form)."""
    path = directory / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TrtbuildError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                            "{name, template}; copy the model's tokenizer_config.json again.")
    return template or None


def named_special_tokens(directory: Path) -> dict[str, str]:
    """A model directory's bos_token, eos_token, ... as text (tokenizer_config.json over special_tokens_map.json)."""
    special = _special_tokens(_read_json(Path(directory) / "special_tokens_map.json"))
    special.update(_special_tokens(_read_json(Path(directory) / "tokenizer_config.json")))
    return special


def _special_tokens(config: dict) -> dict[str, str]:
    """The config's named special tokens (bos_token, eos_token, ...) as text; values may be {"content": ...}."""
    tokens = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise TrtbuildError(f"{path} is not valid ({_one_line(e)}); copy the model's {path.name} again.") from None
    return doc


def _one_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
