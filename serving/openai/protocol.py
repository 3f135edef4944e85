"""The OpenAI API's request and response bodies (the subset trtbuild serves), as pydantic models.

Requests name every field OpenAI and vLLM clients send; the ones trtbuild cannot honour are refused by
`unsupported()` with a message naming them, rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension
    min_p: float | None = None  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_tokens: int | None = None  # vLLM's extension
    ignore_eos: bool | None = None  # vLLM's extension
    skip_special_tokens: bool | None = None  # vLLM's extension
    use_beam_search: bool = False  # vLLM's extension: `n` beams searched, every one a choice (runtime/beam_search.py)
    length_penalty: float | None = None  # vLLM's extension, with use_beam_search
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do (each front end answers them with a 400)."""
        return []


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # image_url / input_audio parts: refused by name, not by pydantic

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallIn(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's thinking, as this server returned it (and clients send back); `reasoning` is vLLM's newer name
    reasoning_content: str | None = None
    reasoning: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as runtime.chat reads it (ValueError naming messages[index] when it cannot be one): text
        parts joined by newlines, as vLLM joins them; a call's arguments parsed, since templates write them with
        tojson; OpenAI's "developer" role is the system prompt; an assistant's thinking as `reasoning_content`."""
        where = f"messages[{index}]"
        if isinstance(self.content, list):
            if bad := sorted({p.type for p in self.content if p.type != "text" or p.text is None}):
                raise ValueError(f"{where}: only text content parts are served, not {', '.join(bad)}")
            content = "\n".join(p.text for p in self.content)
        elif self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{where}: content is required (it may be null only in an assistant's tool call)")
        else:
            content = self.content or ""
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"{where}: only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError(f"{where}: a tool message needs the tool_call_id of the call it answers")
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role != "assistant":
            raise ValueError(f"{where}: only assistant messages carry reasoning_content")
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if thinking is not None:
            message["reasoning_content"] = thinking
        return message


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(BaseModel):
    type: str  # text | json_object | json_schema
    json_schema: dict[str, Any] | None = None  # json_schema: {"name": ..., "schema": {...}}

    def schema(self) -> str | None:
        """The JSON schema the output must follow, as text (None: free text)."""
        from trtbuild.runtime.guided import JSON_OBJECT_SCHEMA

        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            return json.dumps((self.json_schema or {}).get("schema", {}))
        return None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: more variables of the chat template

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.response_format is not None and self.response_format.type not in ("text", "json_object",
                                                                                  "json_schema"):
            bad.append(f"response_format {self.response_format.type!r} (text, json_object and json_schema are served)")
        return bad

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether the answer must be tool calls, the function it must call or None for any), from tool_choice."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]] = Field()  # one prompt, or a batch (completions.py)
    logprobs: int | None = None
    echo: bool = False  # the prompt before each choice's text (and its tokens' logprobs before the output's)
    suffix: str | None = None  # fill in the middle between the prompt and this (runtime/fim.py)


# ---- responses ------------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache, not computed (OpenAI's prompt caching field)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
