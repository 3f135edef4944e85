"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"}, for an engine built with LoRA slots (`trtbuild build --max-loras`;
runtime/lora_slots.py). A loaded adapter is a model of the API at once (`model`: its name; /v1/models lists it);
an unloaded one is refused to new requests at once, while the requests already under it finish under it.

`lora_path` is a path on the server's machine (a PEFT adapter folder or llama.cpp's adapter .gguf), read by the
server: as with vLLM, let only clients you trust reach these endpoints (`--api-key`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from trtbuild.runtime.lora_slots import LoraLoadError

if TYPE_CHECKING:
    from trtbuild.serving.openai.app import OpenAIServer


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name is what trtbuild goes by


def lora_admin_router(server: OpenAIServer) -> APIRouter:
    from trtbuild.serving.openai.app import OpenAIError

    router = APIRouter()
    engine = server.engine

    def refuse(e: LoraLoadError, param: str) -> OpenAIError:
        return OpenAIError(400, e.message, param=param)

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load(body: LoadLoraAdapterRequest) -> str:
        if body.lora_name == server.model_name:
            raise OpenAIError(400, f"`{body.lora_name}` is the base model's name; name the adapter otherwise",
                              param="lora_name")
        try:
            if body.load_inplace and body.lora_name in engine.core.lora_names:
                await run_in_threadpool(engine.unload_lora, body.lora_name)
            await run_in_threadpool(engine.load_lora, body.lora_name, body.lora_path)
        except LoraLoadError as e:
            raise refuse(e, "lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload(body: UnloadLoraAdapterRequest) -> str:
        if engine.core.lora.dynamic and body.lora_name not in engine.core.lora_names:
            raise OpenAIError(404, f"The LoRA adapter `{body.lora_name}` is not loaded; loaded: "
                                   f"{', '.join(engine.core.lora_names) or 'none'}", "not_found_error", "lora_name")
        try:
            await run_in_threadpool(engine.unload_lora, body.lora_name)
        except LoraLoadError as e:
            raise refuse(e, "lora_name") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
