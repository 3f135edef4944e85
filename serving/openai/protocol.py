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
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do (each front end answers them with a 400)."""
        return []


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


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

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.response_format is not None and self.response_format.type not in ("text", "json_object",
                                                                                  "json_schema"):
            bad.append(f"response_format {self.response_format.type!r} (text, json_object and json_schema are served)")
        return bad


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field()
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [name for name in ("echo", "suffix") if getattr(self, name)]
        return bad


# ---- responses ------------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
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
