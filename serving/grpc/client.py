"""A small typed client for `trtbuild serve` (service trtbuild.v1.Generation). Errors are grpc.RpcError; their
code() is INVALID_ARGUMENT (details name the field), RESOURCE_EXHAUSTED (queue full) or UNAVAILABLE."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trtbuild.serving.grpc.proto import trtbuild_pb2 as pb
from trtbuild.serving.grpc.proto import trtbuild_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def make_request(prompt: str | Sequence[int], request_id: str = "", lora: str | None = None,
                 **sampling: object) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes SamplingParams' field names (None values are left unset: server default).
    A str prompt is text, a sequence of ints is prompt token ids. `lora`: the engine's LoRA adapter to run under
    (ModelInfo.lora_names; None: the base model)."""
    fields = {k: v for k, v in sampling.items() if v is not None}
    if "bad_words_ids" in fields:
        fields["bad_words_ids"] = [pb.TokenIds(ids=word) for word in fields["bad_words_ids"]]  # type: ignore[union-attr]
    for name in ("stop", "bad_words"):
        if isinstance(fields.get(name), str):
            fields[name] = [fields[name]]
    request = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingOptions(**fields))
    if lora is not None:
        request.lora = lora
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


class ResponseStream:
    """The responses of one GenerateStream call, as they arrive; `cancel()` closes the call, and the server then
    aborts the request."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[pb.GenerateResponse]:
        return self

    def __next__(self) -> pb.GenerateResponse:
        return next(self._call)  # type: ignore[call-overload]

    def cancel(self) -> None:
        self._call.cancel()


class GenerationClient:
    """`with GenerationClient("127.0.0.1:8001") as c: c.wait_ready(); print(c.generate("Once", max_tokens=8).text)`"""

    def __init__(self, address: str, timeout: float = 30.0, api_key: str | None = None) -> None:
        """`timeout` bounds every call except streams and generate, which take their own (None: no deadline).
        `api_key`: sent as `authorization: Bearer <key>` (a server started with --api-key needs it)."""
        self.address = address
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def generate_stream(self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None,
                        lora: str | None = None, **sampling: object) -> ResponseStream:
        """Stream the generation: one response per step with new tokens / text; the last has finished and usage.
        `lora`: the engine's LoRA adapter to run under (None: the base model)."""
        return ResponseStream(self.stub.GenerateStream(make_request(prompt, request_id, lora, **sampling),
                                                       timeout=timeout, metadata=self.metadata))

    def generate(self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None,
                 lora: str | None = None, **sampling: object) -> pb.GenerateResponse:
        """The whole generation in one response (`lora`: as generate_stream's)."""
        return self.stub.Generate(make_request(prompt, request_id, lora, **sampling), timeout=timeout,
                                  metadata=self.metadata)

    def embed(self, prompt: str | Sequence[int], *, request_id: str = "", timeout: float | None = None,
              lora: str | None = None) -> pb.EmbedResponse:
        """The prompt's embedding (an engine built with `--task embed`)."""
        request = make_request(prompt, request_id, lora)
        request.ClearField("sampling")
        return self.stub.Embed(request, timeout=timeout, metadata=self.metadata)

    def cancel(self, request_id: str) -> bool:
        """Abort an unfinished request; False when no unfinished request has this id."""
        return self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=self.timeout,
                                metadata=self.metadata).found

    def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Load a LoRA adapter (a path on the server's machine) into a slot of the served engine; returns the
        adapters loaded now."""
        return list(self.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name=name, lora_path=str(path)),
                                              timeout=self.timeout, metadata=self.metadata).lora_names)

    def unload_lora_adapter(self, name: str) -> list[str]:
        return list(self.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name=name), timeout=self.timeout,
                                                metadata=self.metadata).lora_names)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def stats(self) -> pb.Stats:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout, metadata=self.metadata)

    def health_status(self, service: str = SERVICE_NAME) -> str:
        """The grpc.health.v1 status name of `service` ("" is the whole server): SERVING, NOT_SERVING, ..."""
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the health service reports the Generation service SERVING (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                reply = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                          timeout=min(remaining, 2.0), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
            time.sleep(0.05)
        raise TimeoutError(f"{self.address} is not SERVING after {timeout:g} s (last: {last})")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
