"""OpenAI's /v1/embeddings, served by an engine built with `trtbuild build --task embed` (an embedding model such as
Qwen3-Embedding: each input's last token's final hidden state, L2-normalized; runtime/engine_core.py).

`input` is one text, one list of token ids, or a batch of either (each one engine request, batched like any
others); `dimensions` keeps the first n values, normalized again (Matryoshka-trained models are meant to be cut so);
`encoding_format` base64 sends little-endian float32 bytes, as OpenAI's clients expect.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.openai.completions import completion_prompts
from trtbuild.serving.openai.streams import collect

if TYPE_CHECKING:
    from trtbuild.serving.openai.app import OpenAIServer


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def embeddings_router(server: OpenAIServer) -> APIRouter:
    router = APIRouter()

    async def embed(request: Request, r: EmbeddingRequest) -> dict[str, Any]:
        lora = server.lora_of(r)
        if not server.engine.core.embeds:
            raise ValueError("this engine generates text: embeddings need an engine built with "
                             "`trtbuild build --task embed` (use /v1/completions or /v1/chat/completions here)")
        width = server.engine.core.engine.info.model.hidden_size
        if r.dimensions is not None and not 1 <= r.dimensions <= width:
            raise ValueError(f"dimensions must be in [1, {width}] (the model's embedding size), got {r.dimensions}")
        prompts = completion_prompts(r.input, server.encode)
        streams = []
        try:
            for p in prompts:
                streams.append(server.engine.submit(p.token_ids, SamplingParams(max_tokens=1), lora=lora, embed=True))
        except Exception:
            for s in streams:
                s.cancel()
            raise
        data = []
        for i, whole in enumerate(await collect(request, streams, server.workers)):
            vector = whole.last.embedding
            if vector is None:  # cancelled before its prompt was computed
                raise ValueError(f"input {i} was not embedded ({whole.finish_reason})")
            if r.dimensions is not None:
                vector = vector[: r.dimensions] / max(float(np.linalg.norm(vector[: r.dimensions])), 1e-12)
            vector = vector.astype("<f4")
            data.append({"object": "embedding", "index": i, "embedding": vector.tolist() if r.encoding_format == "float"
                         else base64.b64encode(vector.tobytes()).decode()})
        tokens = sum(len(p.token_ids) for p in prompts)
        return {"object": "list", "data": data, "model": lora or server.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @router.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest) -> Any:
        return await server.run(request, embed, body)

    return router
