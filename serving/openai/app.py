"""The OpenAI-compatible HTTP front end (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health,
/metrics, over the same AsyncEngine as the gRPC service.

Each choice of a request is one engine request, followed by streams.py. A client that disconnects has its requests
aborted, and their KV blocks freed, at once: streaming responses end their generator, non-streaming ones are watched.
/v1/completions' batches and echo are in completions.py (its `suffix`: fill-in-the-middle, runtime/fim.py), the
tokenizer endpoints in tokenize.py, llama.cpp's /infill in infill.py, vLLM's LoRA loading in lora_admin.py.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from trtbuild.errors import ConfigError
from trtbuild.runtime.async_engine import AsyncEngine, RequestStream
from trtbuild.runtime.fim import FimTokens, infill_prompt
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.openai import harmony
from trtbuild.serving.openai import protocol as api
from trtbuild.serving.openai.answer import ChatAnswer
from trtbuild.serving.openai.completions import EchoedChoice, Prompt, ScoredToken, completion_prompts
from trtbuild.serving.openai.embeddings import embeddings_router
from trtbuild.serving.openai.infill import infill_router
from trtbuild.serving.openai.lora_admin import lora_admin_router
from trtbuild.serving.openai.metrics import ServingMetrics
from trtbuild.serving.openai.reasoning import opens_thinking, teaches_reasoning
from trtbuild.serving.openai.streams import collect, deltas
from trtbuild.serving.openai.tokenize import tokenizer_router
from trtbuild.serving.openai.tool_calls import FORMATS, ToolCallFormat, format_of_template
from trtbuild.serving.openai.tool_use import NO_TOOLS, ToolUse, tool_use
from trtbuild.serving.requests import Accumulated, ErrorKind, answers, cached_prompt_tokens, error_kind, sampling_params

_STATUS = {ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"), ErrorKind.QUEUE_FULL: (429, "rate_limit_error"),
           ErrorKind.UNAVAILABLE: (503, "service_unavailable"), ErrorKind.INTERNAL: (500, "internal_error")}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def _error(e: Exception) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    status, kind = _STATUS[error_kind(e)]
    return OpenAIError(status, str(e), kind, e.field if isinstance(e, ConfigError) else None)


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None = None,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto") -> None:
        """`tool_call_parser`: how "auto" tool choices parse answers: a name of tool_calls.FORMATS, "harmony" (every
        answer is parsed as harmony.py reads gpt-oss's), or "auto" (harmony for a template that writes channels,
        else the format the chat template's markers name). `reasoning_parser`: "auto" splits the thinking off the
        answers of a model whose template knows the thinking tags (reasoning.py) or harmony's analysis channel,
        "none" never does."""
        from trtbuild.runtime.chat import ChatTemplate

        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        core = engine.core
        self.tokenizer, self.max_seq_len = core.tokenizer, core.scheduler.config.max_seq_len
        self.template = ChatTemplate.from_engine_dir(core.engine.info.path) if self.tokenizer else None
        self.fim = FimTokens.of(self.tokenizer) if self.tokenizer else None
        self.harmony = tool_call_parser == harmony.NAME or (
            tool_call_parser == "auto" and self.template is not None and harmony.teaches_harmony(self.template.source))
        self.tool_format: ToolCallFormat | None = (
            None if self.harmony else FORMATS[tool_call_parser] if tool_call_parser != "auto"
            else format_of_template(self.template.source) if self.template else None)
        self.reasoning = reasoning_parser == "auto" and self.template is not None and (
            self.harmony or teaches_reasoning(self.template.source))
        self.metrics = ServingMetrics(engine, model_name)
        self.workers = ThreadPoolExecutor(max_workers=engine.max_queue_size + 8, thread_name_prefix="openai")
        self.app = self._routes()

    # ---- requests -> engine ------------------------------------------------------------------------------------------
    def _params(self, r: api.ChatCompletionRequest | api.CompletionRequest, prompt_len: int, default_max: int,
                logprobs: int | None, extra_stop_ids: tuple[int, ...] = (),
                tools: ToolUse = NO_TOOLS, keep_special_tokens: bool = False,
                prompt_logprobs: int | None = None) -> SamplingParams:
        """`keep_special_tokens`: the answer's parser needs them in the text (unless the request says otherwise)."""
        if bad := r.unsupported():
            raise OpenAIError(400, f"not supported: {', '.join(bad)}", param=bad[0].split()[0])
        if r.n < 1:
            raise OpenAIError(400, f"n must be at least 1, got {r.n}", param="n")
        if r.use_beam_search and r.stream:
            raise OpenAIError(400, "use_beam_search answers once every beam is done: send stream false",
                              param="stream")
        if r.length_penalty is not None and not r.use_beam_search:
            raise OpenAIError(400, "length_penalty ranks beams: set use_beam_search too", param="length_penalty")
        self.lora_of(r)
        max_tokens = getattr(r, "max_completion_tokens", None) or r.max_tokens
        try:
            bias = {int(token): value for token, value in (r.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        if max_tokens is not None and prompt_len + max_tokens > self.max_seq_len:  # as vLLM refuses it
            raise OpenAIError(400, f"max_tokens {max_tokens} + the prompt's {prompt_len} tokens exceed the engine's "
                                   f"max_seq_len {self.max_seq_len}; ask for at most {self.max_seq_len - prompt_len}",
                              param="max_tokens")
        fields = {k: v for k, v in dict(
            max_tokens=max_tokens if max_tokens is not None else max(1, min(default_max,
                                                                            self.max_seq_len - prompt_len)),
            temperature=_first_set(r.temperature, 0.0 if r.use_beam_search else 1.0), top_p=r.top_p, top_k=r.top_k,
            beam_width=r.n if r.use_beam_search else None, length_penalty=r.length_penalty,
            min_p=r.min_p, seed=r.seed, stop=r.stop, presence_penalty=r.presence_penalty,
            frequency_penalty=r.frequency_penalty, repetition_penalty=r.repetition_penalty, min_tokens=r.min_tokens,
            ignore_eos=r.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias or None,
            json_schema=tools.json_schema or (r.response_format.schema() if getattr(r, "response_format", None)
                                              else None),
            skip_special_tokens=_first_set(r.skip_special_tokens, False if keep_special_tokens else None),
            stop_token_ids=tuple(r.stop_token_ids or ()) + extra_stop_ids or None).items() if v is not None}
        return sampling_params(fields)

    def lora_of(self, r: api.ChatCompletionRequest | api.CompletionRequest) -> str | None:
        """The LoRA adapter a request's `model` names (as vLLM serves them), None for the base model."""
        if r.model in (None, self.model_name):
            return None
        if r.model in self.engine.core.lora_names:
            return r.model
        served = ", ".join(f"`{m}`" for m in (self.model_name, *self.engine.core.lora_names))
        raise OpenAIError(404, f"The model `{r.model}` does not exist; this server serves {served}",
                          "not_found_error", "model")

    def served_model(self, r: api.ChatCompletionRequest | api.CompletionRequest) -> str:
        """The `model` of a response: the adapter the request ran under, else the base model."""
        return self.lora_of(r) or self.model_name

    def _submit(self, prompt: list[int], params: SamplingParams, n: int,
                r: api.ChatCompletionRequest | api.CompletionRequest) -> list[RequestStream]:
        streams = []
        try:
            # n > 1 with a seed: choice i samples with seed + i, so choices differ; a beam search gives all n at once
            for i in range(1 if params.beam_width > 1 else n):
                seeded = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
                streams.append(self.engine.submit(prompt, seeded, lora=self.lora_of(r)))
        except Exception:
            for s in streams:
                s.cancel()
            raise
        return streams

    # ---- logprobs ---------------------------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def _chat_logprobs(self, lps: list[TokenLogprobs], top: int) -> api.ChoiceLogprobs:
        return api.ChoiceLogprobs(content=[api.TokenLogprob(
            token=self.token_text(lp.token_id), logprob=lp.logprob, bytes=list(self.token_text(lp.token_id).encode()),
            top_logprobs=[api.TopLogprob(token=self.token_text(t), logprob=p) for t, p in lp.top[:top]]) for lp in lps])

    def _completion_logprobs(self, scored: list[ScoredToken], choice: EchoedChoice) -> api.CompletionLogprobs:
        """The logprobs of a choice's next tokens; their text offsets continue the choice's."""
        tokens = [self.token_text(token) for token, _ in scored]
        offsets = [choice.text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        choice.text_offset += sum(map(len, tokens))
        return api.CompletionLogprobs(
            tokens=tokens, token_logprobs=[lp.logprob if lp else None for _, lp in scored],
            top_logprobs=[{self.token_text(t): p for t, p in lp.top} if lp else None for _, lp in scored],
            text_offset=offsets)

    # ---- endpoints --------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, "this engine has no tokenizer: send the prompt as token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def fim_tokens(self, param: str) -> FimTokens:
        """The model's fill-in-the-middle tokens, or a 400 naming `param` for a model that has none."""
        if self.fim is None:
            raise OpenAIError(400, "this model has no fill-in-the-middle tokens (<|fim_prefix|>, <fim_prefix>, <PRE>, "
                                   "...) in its tokenizer: serve a code model trained for it (Qwen2.5-Coder, StarCoder "
                                   "2, DeepSeek-Coder, CodeLlama, Granite Code)", param=param)
        return self.fim

    def render(self, messages: list[api.ChatMessage], tools: ToolUse = NO_TOOLS,
               variables: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text (in harmony's form for a model that speaks it)."""
        if self.template is None:
            raise OpenAIError(400, "this model has no chat template: use /v1/completions", param="messages")
        chat = [m.for_template(i) for i, m in enumerate(messages)]
        if self.harmony:
            chat = harmony.for_template(chat)
        return self.template.render(chat, add_generation_prompt,
                                    tools=harmony.described(tools.tools) if self.harmony else tools.tools,
                                    variables=variables)

    async def chat(self, request: Request, r: api.ChatCompletionRequest) -> Any:
        if self.template is None:
            raise OpenAIError(400, "this model has no chat template: use /v1/completions", param="messages")
        tools = tool_use(r, self.template.renders_tools, self.tool_format, frozenset(self.tokenizer.special_tokens),
                         self.harmony)
        text = self.render(r.messages, tools, r.chat_template_kwargs)
        if self.harmony and tools.function is not None:  # the call's header, then its constrained arguments
            text += harmony.call_header(tools.function)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        top = r.top_logprobs or 0
        params = self._params(r, len(prompt), self.max_seq_len, top if r.logprobs else None,
                              self.template.end_of_turn_token_ids, tools, tools.keep_special_tokens or self.harmony)
        # NOTE: an answer constrained to JSON from its first token has no thinking to split off, nor channels
        free = params.json_schema is None
        inside = opens_thinking(text) if self.reasoning and free else None
        in_harmony = self.harmony and free
        streams = self._submit(prompt, params, r.n, r)
        rid = api.new_id("chatcmpl")
        if r.stream:
            return self._stream(streams, rid, len(prompt), r, chat=True, answers=[
                ChatAnswer(tools, inside, in_harmony) for _ in streams])
        collected = await collect(request, streams, self.workers)
        wholes = answers(collected)
        choices = []
        for i, w in enumerate(wholes):
            answer = ChatAnswer(tools, inside, in_harmony)
            choices.append(api.ChatChoice(index=i, message=answer.message(w.text),
                                          logprobs=self._chat_logprobs(w.logprobs, top) if r.logprobs else None,
                                          finish_reason=_finish(w.finish_reason, answer.called)))
        return api.ChatCompletion(id=rid, model=self.served_model(r), choices=choices,
                                  usage=api.Usage.of(len(prompt), sum(len(w.token_ids) for w in wholes),
                                                     cached_prompt_tokens(collected)))

    async def completion(self, request: Request, r: api.CompletionRequest) -> Any:
        stop_ids: tuple[int, ...] = ()
        if r.suffix:  # fill in the middle: each prompt is a prefix
            if r.echo:
                raise OpenAIError(400, "echo and suffix do not go together: a middle has no prompt to echo",
                                  param="echo")
            fim = self.fim_tokens("suffix")
            prompts = completion_prompts(r.prompt, self.encode,
                                         lambda p: infill_prompt(self.tokenizer, fim, p, r.suffix))
            stop_ids = fim.stop_ids
        else:
            prompts = completion_prompts(r.prompt, self.encode)
        echo_only = r.echo and r.max_tokens == 0
        if r.max_tokens == 0 and not r.echo:
            raise OpenAIError(400, "max_tokens 0 generates nothing: ask for at least 1 token, or set echo to get the "
                                   "prompt back (with logprobs: its tokens' log probabilities)", param="max_tokens")
        if echo_only:  # NOTE: the prompt's last position is computed by the pass that samples one token
            r = r.model_copy(update={"max_tokens": 1})
        params = [self._params(r, len(p.token_ids), 16, r.logprobs, stop_ids,
                               prompt_logprobs=r.logprobs if r.echo else None) for p in prompts]
        streams, stream_prompts = [], []
        try:
            for p, sp in zip(prompts, params, strict=True):
                streams += self._submit(p.token_ids, sp, r.n, r)
                stream_prompts += [p] * (len(streams) - len(stream_prompts))
        except Exception:
            for s in streams:
                s.cancel()
            raise

        def shown(p: Prompt) -> EchoedChoice:
            echoed = p.text if p.text is not None else self.tokenizer.decode(p.token_ids) if self.tokenizer else ""
            return EchoedChoice(p, echoed, r.echo, echo_only)

        rid, prompt_tokens = api.new_id("cmpl"), sum(len(p.token_ids) for p in prompts)
        if r.stream:
            return self._stream(streams, rid, prompt_tokens, r, chat=False, choices=list(map(shown, stream_prompts)),
                                stream_prompts=stream_prompts)
        collected = await collect(request, streams, self.workers)
        wholes = answers(collected)  # a beam search's stream has n answers
        choices = [shown(p) for p, w in zip(stream_prompts, collected, strict=True) for _ in answers([w])]
        out = []
        for i, (w, choice) in enumerate(zip(wholes, choices, strict=True)):
            text, scored = choice.whole(w)
            out.append(api.CompletionChoice(
                index=i, text=text, finish_reason=choice.finish_reason(w.finish_reason),
                logprobs=self._completion_logprobs(scored, choice) if r.logprobs is not None else None))
        return api.Completion(id=rid, model=self.served_model(r), choices=out,
                              usage=api.Usage.of(prompt_tokens, sum(c.num_output_tokens for c in choices),
                                                 cached_prompt_tokens(collected, stream_prompts)))

    def _stream(self, streams: list[RequestStream], rid: str, prompt_len: int,
                r: api.ChatCompletionRequest | api.CompletionRequest, chat: bool,
                answers: list[ChatAnswer] | None = None, choices: list[EchoedChoice] | None = None,
                stream_prompts: list[Prompt] | None = None) -> StreamingResponse:
        """`answers`: chat only, each choice's answer; `choices`, `stream_prompts`: completions only, what each choice
        shows and its prompt."""
        include_usage = bool(r.stream_options and r.stream_options.include_usage)
        model = self.served_model(r)

        async def events() -> AsyncIterator[str]:
            wholes = [Accumulated() for _ in streams]
            if chat:
                for i in range(len(streams)):
                    yield _sse(api.ChatCompletionChunk(id=rid, model=model, choices=[
                        api.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""})]))
            try:
                async for i, out in deltas(streams, self.workers):
                    wholes[i].add(out)
                    if chat:
                        lp = self._chat_logprobs(out.logprobs, r.top_logprobs or 0) if r.logprobs else None
                        delta = answers[i].delta(out.new_text, out.finished)
                        chunk = api.ChatCompletionChunk(id=rid, model=model, choices=[api.ChatChunkChoice(
                            index=i, delta=delta, logprobs=lp,
                            finish_reason=_finish(out.finish_reason, answers[i].called))])
                    else:
                        text, scored = choices[i].take(out)
                        lp = self._completion_logprobs(scored, choices[i]) if r.logprobs is not None else None
                        reason = choices[i].finish_reason(out.finish_reason)
                        chunk = api.Completion(id=rid, model=model, choices=[api.CompletionChoice(
                            index=i, text=text, logprobs=lp, finish_reason=reason)])
                    yield _sse(chunk)
            except Exception as e:  # the stream has started: the error goes in-band, as vLLM sends it
                err = _error(e)
                yield f"data: {json.dumps(api.error_body(str(err), err.kind, err.status, err.param))}\n\n"
            if include_usage:
                outputs = (sum(c.num_output_tokens for c in choices) if choices
                           else sum(len(w.token_ids) for w in wholes))
                usage = api.Usage.of(prompt_len, outputs, cached_prompt_tokens(wholes, stream_prompts))
                cls = api.ChatCompletionChunk if chat else api.Completion
                yield _sse(cls(id=rid, model=model, choices=[], usage=usage))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def run(self, request: Request, handler: Callable[[Request, Any], Awaitable[Any]], body: Any) -> Any:
        """An endpoint's handler, its errors as OpenAI's."""
        try:
            return await handler(request, body)
        except Exception as e:
            raise _error(e) from None

    def _routes(self) -> FastAPI:
        app = FastAPI(title="trtbuild OpenAI-compatible server")

        @app.exception_handler(OpenAIError)
        async def openai_error(_: Request, e: OpenAIError) -> JSONResponse:
            return JSONResponse(api.error_body(str(e), e.kind, e.status, e.param), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0]
            if first.get("type") == "json_invalid":
                return JSONResponse(api.error_body(f"the request body is not valid JSON ({first.get('msg')}, "
                                                   f"{(first.get('ctx') or {}).get('error', 'at the start')})",
                                                   "invalid_request_error", 400), status_code=400)
            param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            return JSONResponse(api.error_body(f"{param}: {first.get('msg')}" if param else str(first.get("msg")),
                                               "invalid_request_error", 400, param), status_code=400)

        @app.middleware("http")
        async def auth(request: Request, call_next):
            if self.api_key and request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    return JSONResponse(api.error_body("invalid or missing API key (Authorization: Bearer <key>)",
                                                       "authentication_error", 401), status_code=401)
            return await call_next(request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request, body: api.ChatCompletionRequest) -> Any:
            return await self.run(request, self.chat, body)

        @app.post("/v1/completions")
        async def completions(request: Request, body: api.CompletionRequest) -> Any:
            return await self.run(request, self.completion, body)

        for router in (tokenizer_router, embeddings_router, infill_router, lora_admin_router):
            app.include_router(router(self))

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            base = {"id": self.model_name, "object": "model", "owned_by": "trtbuild", "max_model_len": self.max_seq_len}
            # NOTE: the engine's LoRA adapters are models of their own, with the base as their parent (as vLLM)
            adapters = [{**base, "id": name, "parent": self.model_name} for name in self.engine.core.lora_names]
            return {"object": "list", "data": [base, *adapters]}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.engine.dead else 200)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for an answer with calls that ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def _first_set(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"
