"""vLLM's tokenizer endpoints beside the OpenAI API, so that a client needs no copy of the tokenizer:

POST /tokenize        a text (`prompt`), or a conversation (`messages`) rendered by the model's chat template ->
                      its token ids (`tokens`), their count and the engine's max_model_len
POST /detokenize      token ids -> text (`prompt`)
GET  /tokenizer_info  the special tokens, the chat template and the length limit

What lm-evaluation-harness's `tokenizer_backend=remote` reads. Like vLLM, these sit outside /v1, so an API key does
not guard them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from trtbuild.runtime.chat import named_special_tokens
from trtbuild.serving.openai.protocol import ChatMessage

if TYPE_CHECKING:
    from trtbuild.serving.openai.app import OpenAIServer


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None  # exactly one of prompt and messages
    messages: list[ChatMessage] | None = None
    # None: True for a prompt (BOS as a completion adds it), False for messages (the template writes it), as vLLM
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenizer_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    def tokenizer():
        if server.tokenizer is None:
            raise ValueError("this engine has no tokenizer (it was built without tokenizer files)")
        return server.tokenizer

    async def tokenize(_: Request, r: TokenizeRequest) -> dict[str, Any]:
        server.lora_of(r)  # a model this server does not serve is a 404, as on /v1
        if (r.prompt is None) == (r.messages is None):
            raise ValueError("send exactly one of prompt (a text) and messages (a conversation)")
        if r.messages is not None:
            if not r.messages:
                raise ValueError("messages is empty")
            text = server.render(r.messages, variables=r.chat_template_kwargs,
                                 add_generation_prompt=r.add_generation_prompt)
            ids = tokenizer().encode(text, add_special_tokens=bool(r.add_special_tokens))
        else:
            ids = tokenizer().encode(r.prompt, add_special_tokens=r.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": server.max_seq_len, "tokens": ids}
        if r.return_token_strs:
            out["token_strs"] = [server.token_text(t) for t in ids]
        return out

    async def detokenize(_: Request, r: DetokenizeRequest) -> dict[str, str]:
        server.lora_of(r)
        vocab = server.engine.core.vocab_size
        if bad := [t for t in r.tokens if not 0 <= t < vocab]:
            raise ValueError(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return {"prompt": tokenizer().decode(r.tokens, skip_special_tokens=False)}

    @router.post("/tokenize")
    async def tokenize_route(request: Request, body: TokenizeRequest) -> Any:
        return await server.run(request, tokenize, body)

    @router.post("/detokenize")
    async def detokenize_route(request: Request, body: DetokenizeRequest) -> Any:
        return await server.run(request, detokenize, body)

    @router.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Any:
        async def info(_: Request, __: None) -> dict[str, Any]:
            tokenizer()
            special = named_special_tokens(server.engine.core.engine.info.path)
            return {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                    "chat_template": server.template.source if server.template else None,
                    "model_max_length": server.max_seq_len}

        return await server.run(request, info, None)

    return router
