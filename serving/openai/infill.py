"""llama.cpp's POST /infill beside the OpenAI API: code completion between a prefix and a suffix, as editor plugins
(llama.vim, llama.vscode) ask llama-server for it.

The request and response are llama-server's (its native /completion JSON, not OpenAI's): `input_prefix`,
`input_suffix`, `input_extra` (other files: [{"filename", "text"}]), `prompt` (more prefix: the cursor's line),
the sampling fields with llama-server's defaults, `n_indent` (stop at a line indented less), `t_max_predict_ms`
(stop once a line has ended after this long since the first token), `response_fields` (return only these; "a/b"
lifts b out of a). The prompt is runtime/fim.py's. `cache_prompt` is accepted: the engine reuses cached prefixes
whenever it has them. `t_max_prompt_ms` is accepted and not applied, as llama-server does not apply it.
`samplers` is accepted only in llama-server's default orders: trtbuild applies top-k, top-p and min-p, then the
temperature, and has no "infill" sampler (the response's generation_settings says what ran).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trtbuild.runtime.fim import ExtraFile, infill_prompt
from trtbuild.serving.openai.streams import deltas
from trtbuild.serving.requests import sampling_params

if TYPE_CHECKING:
    from trtbuild.runtime.outputs import RequestOutput
    from trtbuild.serving.openai.app import OpenAIServer

# the sampler chains llama-server runs by default, and the ones llama.vim / llama.vscode send
_ACCEPTED_SAMPLERS = frozenset({"top_k", "top_p", "min_p", "temperature", "infill", "penalties", "dry",
                                "top_n_sigma", "typ_p", "xtc"})
APPLIED_SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


class InfillFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    filename: str = "tmp"  # llama-server's default


class InfillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_prefix: str
    input_suffix: str
    input_extra: list[InfillFile] = []
    prompt: str = ""
    model: str | None = None
    n_predict: int = Field(-1, ge=-1)  # -1: until the engine's max_seq_len
    max_tokens: int | None = Field(None, ge=-1)  # llama-server's alias of n_predict
    temperature: float = Field(0.8, ge=0.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, ge=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = []
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    n_indent: int = Field(0, ge=0)
    t_max_predict_ms: int = -1
    t_max_prompt_ms: int = -1
    cache_prompt: bool = True
    samplers: list[str] | None = None
    response_fields: list[str] | None = None

    @model_validator(mode="after")
    def _samplers_known(self) -> InfillRequest:
        if self.samplers is not None and (unknown := [s for s in self.samplers if s not in _ACCEPTED_SAMPLERS]):
            raise ValueError(f"samplers {unknown} are not served; trtbuild applies {APPLIED_SAMPLERS} in that order")
        return self

    @property
    def budget(self) -> int:
        return self.n_predict if self.max_tokens is None else self.max_tokens


class MiddleCut:
    """llama-server's two code-completion stops on the text so far: a new line indented less than `n_indent`
    (that line is cut off), and `t_max_predict_ms` past the first token once a line has ended."""

    def __init__(self, n_indent: int, t_max_predict_ms: int) -> None:
        self.n_indent, self.deadline_ms = n_indent, t_max_predict_ms
        self.text, self.first_token_time = "", None
        self.cut = False

    def add(self, new_text: str, now: float) -> str:
        """The part of `new_text` to send; sets `cut` when generation must stop."""
        self.first_token_time = self.first_token_time if self.first_token_time is not None else now
        start = len(self.text)
        self.text += new_text
        if self.n_indent > 0:  # NOTE: the lines before the one `new_text` continues were judged already
            line_start = max(self.text.rfind("\n", 0, start), 0)
            while (nl := self.text.find("\n", line_start)) != -1:
                line_start = nl + 1
                body = self.text[line_start:].lstrip(" \t")
                indent = len(self.text) - line_start - len(body)
                if body and indent < self.n_indent and not body.startswith("\n"):
                    self.text, self.cut = self.text[:line_start + indent], True
                    break
        if self.deadline_ms > 0 and "\n" in self.text and (now - self.first_token_time) * 1000 > self.deadline_ms:
            self.cut = True
        return self.text[start:]


def infill_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    async def infill(request: Request, r: InfillRequest) -> Any:
        fim = server.fim_tokens("input_prefix")
        if r.budget == 0:
            raise ValueError("n_predict 0 generates nothing: ask for at least 1 token, or -1 for as many as fit")
        prompt = infill_prompt(server.tokenizer, fim, r.input_prefix, r.input_suffix,
                               [ExtraFile(f.filename, f.text) for f in r.input_extra], r.prompt)
        room = server.max_seq_len - len(prompt)
        if room < 1 or r.budget > room:
            raise ValueError(f"the infill prompt has {len(prompt)} tokens and n_predict {r.budget}; the engine's "
                             f"max_seq_len is {server.max_seq_len}: shorten input_prefix / input_suffix / input_extra")
        fields = dict(max_tokens=room if r.budget < 0 else r.budget, temperature=r.temperature, top_k=r.top_k or None,
                      top_p=r.top_p, min_p=r.min_p or None, seed=r.seed, stop=r.stop or None,
                      repetition_penalty=r.repeat_penalty, presence_penalty=r.presence_penalty,
                      frequency_penalty=r.frequency_penalty, stop_token_ids=fim.stop_ids or None)
        params = sampling_params({k: v for k, v in fields.items() if v is not None},
                                 {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"})
        stream = server.engine.submit(prompt, params, lora=server.lora_of(r))
        run = _Run(server, r, prompt, time.monotonic())
        if r.stream:
            return StreamingResponse(run.events([stream]), media_type="text/event-stream")
        async for _ in run.outputs([stream]):
            pass
        return run.final(content=run.cut.text)

    @router.post("/infill")
    async def infill_route(request: Request, body: InfillRequest) -> Any:
        return await server.run(request, infill, body)

    return router


class _Run:
    """One /infill request's outputs, cut by MiddleCut, and llama-server's response fields."""

    def __init__(self, server: OpenAIServer, r: InfillRequest, prompt: list[int], start: float) -> None:
        self.server, self.r, self.prompt, self.start = server, r, prompt, start
        self.cut = MiddleCut(r.n_indent, r.t_max_predict_ms)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.first_token_time: float | None = None
        self.cached = 0

    async def outputs(self, streams: list) -> AsyncIterator[tuple[RequestOutput, str]]:
        engine_outputs = deltas(streams, self.server.workers)
        try:
            async for _, out in engine_outputs:
                now = time.monotonic()
                self.first_token_time = self.first_token_time or (now if out.new_token_ids else None)
                self.tokens += out.new_token_ids
                self.finish_reason = out.finish_reason
                self.cached = out.metrics.num_prefix_cached_tokens if out.metrics else self.cached
                text = self.cut.add(out.new_text, now)
                yield out, text
                if self.cut.cut:
                    self.finish_reason = "length"
                    return
        finally:  # NOTE: closing deltas() cancels a request cut short at once, which frees its KV blocks
            await engine_outputs.aclose()

    async def events(self, streams: list) -> AsyncIterator[str]:
        try:
            async for _, text in self.outputs(streams):
                if text:
                    yield _sse({"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1,
                                "tokens_predicted": len(self.tokens), "tokens_evaluated": len(self.prompt)})
        except Exception as e:  # the stream has started: the error goes in-band, as llama-server sends it
            yield _sse({"error": {"code": 500, "message": str(e), "type": "server_error"}})
            return
        yield _sse(self.final(content=""))

    def final(self, content: str) -> dict[str, Any]:
        end = time.monotonic()
        first = self.first_token_time or end
        prompt_ms, predicted_ms = (first - self.start) * 1000, (end - first) * 1000
        n_prompt, n_out = len(self.prompt) - self.cached, len(self.tokens)
        body = {
            "index": 0, "content": content, "tokens": [], "id_slot": -1, "stop": True,
            "model": self.server.served_model(self.r), "tokens_predicted": n_out, "tokens_evaluated": len(self.prompt),
            "tokens_cached": self.cached, "truncated": False, "has_new_line": "\n" in self.cut.text,
            "stop_type": "limit" if self.finish_reason == "length" else "eos", "stopping_word": "",
            "prompt": self.server.tokenizer.decode(self.prompt, skip_special_tokens=False),
            "generation_settings": {"n_predict": self.r.budget, "temperature": self.r.temperature,
                                    "top_k": self.r.top_k, "top_p": self.r.top_p, "min_p": self.r.min_p,
                                    "n_indent": self.r.n_indent, "t_max_predict_ms": self.r.t_max_predict_ms,
                                    "samplers": APPLIED_SAMPLERS, "seed": self.r.seed, "stop": self.r.stop},
            "timings": {"prompt_n": n_prompt, "prompt_ms": prompt_ms,
                        "prompt_per_token_ms": prompt_ms / max(n_prompt, 1),
                        "prompt_per_second": n_prompt / prompt_ms * 1000 if prompt_ms else 0.0,
                        "predicted_n": n_out, "predicted_ms": predicted_ms,
                        "predicted_per_token_ms": predicted_ms / max(n_out, 1),
                        "predicted_per_second": n_out / predicted_ms * 1000 if predicted_ms else 0.0},
        }
        return selected(body, self.r.response_fields)


def selected(body: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """llama-server's response_fields: only the named fields; "a/b" puts a's b at the top as "a/b". Missing
    fields are left out."""
    if fields is None:
        return body
    out = {}
    for name in fields:
        value: Any = body
        for part in name.split("/"):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is not _MISSING:
            out[name] = value
    return out


_MISSING = object()


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
