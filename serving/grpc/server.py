"""`trtbuild serve`: the gRPC front end over the engine loop (service trtbuild.v1.Generation, see proto/).

Handlers never wait on a step: they validate and enqueue through AsyncEngine.submit and then only read their
request's output queue. Besides Generation the server runs the standard grpc.health.v1 service (NOT_SERVING until
the engine is loaded, then SERVING) and server reflection. Status codes are listed in proto/trtbuild.proto.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from trtbuild import __version__
from trtbuild.builder.engine_dir import engine_target, read_engine_config
from trtbuild.errors import TrtbuildError
from trtbuild.runtime.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore, RequestOutput
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.runtime.lora_slots import LoraLoadError
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving import requests
from trtbuild.serving.grpc.proto import trtbuild_pb2 as pb
from trtbuild.serving.grpc.proto import trtbuild_pb2_grpc as pb_grpc
from trtbuild.serving.requests import ErrorKind

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "trtbuild.v1.Generation"
DEFAULT_PORT = 8001
# NOTE: a request or response message at most: 4 MiB holds any prompt an engine can take (EngineCore refuses text
# longer than max_seq_len tokens could be before tokenizing it) without letting a client queue gigabytes
MAX_MESSAGE_BYTES = 4 << 20
_POLL_S = 1.0  # how often a waiting handler re-checks that its client is still connected
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_STATUS = {ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
           ErrorKind.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
           ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL}
_OPTIONAL_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs",
                    "prompt_logprobs", "include_stop_str_in_output", "beam_width", "length_penalty")


# ---- proto <-> runtime ----------------------------------------------------------------------------------------------
def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """SamplingParams of a request's options; unset fields keep SamplingParams' defaults (ValueError names a field)."""
    fields: dict[str, object] = {name: getattr(options, name) for name in _OPTIONAL_FIELDS if options.HasField(name)}
    for name in ("stop", "stop_token_ids", "bad_words"):
        if getattr(options, name):
            fields[name] = list(getattr(options, name))
    if options.bad_words_ids:
        fields["bad_words_ids"] = [list(word.ids) for word in options.bad_words_ids]
    return requests.sampling_params(fields)


def request_prompt(request: pb.GenerateRequest) -> str | list[int]:
    """The prompt text or token ids; exactly one must be given (ValueError otherwise)."""
    return requests.prompt_of(request.prompt if request.HasField("prompt") else None,
                              list(request.prompt_token_ids) or None)


def _logprobs(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


def _usage(output: RequestOutput) -> pb.Usage:
    usage = pb.Usage(prompt_tokens=output.num_prompt_tokens, output_tokens=output.num_output_tokens)
    m = output.metrics
    if m is not None:
        usage.cached_prefix_tokens, usage.num_preemptions = m.num_prefix_cached_tokens, m.num_preemptions
        if m.queue_time is not None:
            usage.queue_time_s = m.queue_time
        if m.ttft is not None:
            usage.ttft_s = m.ttft
        if m.finished_time is not None:
            usage.e2e_s = m.finished_time - m.arrival_time
    return usage


def response(output: RequestOutput) -> pb.GenerateResponse:
    r = pb.GenerateResponse(request_id=output.request_id, token_ids=output.new_token_ids, text=output.new_text,
                            finished=output.finished, logprobs=[_logprobs(lp) for lp in output.logprobs],
                            finish_reason=_FINISH_REASONS.get(output.finish_reason or "", 0),
                            prompt_logprobs=[_logprobs(lp) for lp in (output.prompt_logprobs or [])[1:]],
                            beams=[pb.Beam(token_ids=b.token_ids, text=b.text, cumulative_logprob=b.cumulative_logprob,
                                           score=b.score, finish_reason=_FINISH_REASONS[b.finish_reason.value])
                                   for b in output.beams or []])
    if output.finished:
        r.usage.CopyFrom(_usage(output))
    return r


# ---- the service ----------------------------------------------------------------------------------------------------
class GenerationServicer(pb_grpc.GenerationServicer):
    """trtbuild.v1.Generation over an AsyncEngine (None until the engine is loaded: every call is UNAVAILABLE)."""

    def __init__(self, max_queue_size: int, health_servicer: health.HealthServicer | None = None) -> None:
        self.engine: AsyncEngine | None = None
        self.max_queue_size = max_queue_size
        self.health = health_servicer
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()

    def _engine(self, context: grpc.ServicerContext) -> AsyncEngine:
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading; retry when health is SERVING")
        return self.engine

    def _abort(self, context: grpc.ServicerContext, error: Exception) -> NoReturn:
        kind = requests.error_kind(error)
        if kind is ErrorKind.UNAVAILABLE and self.health is not None:
            self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        message = f"{error}; retry later" if kind is ErrorKind.QUEUE_FULL else str(error)
        context.abort(_STATUS[kind], message)

    def _outputs(self, request: pb.GenerateRequest, context: grpc.ServicerContext, embed: bool = False
                 ) -> Iterator[RequestOutput]:
        """Submit the request (`embed`: for its prompt's embedding) and yield its outputs; the request is aborted if
        the RPC ends first."""
        engine = self._engine(context)
        try:
            if embed and request.HasField("sampling"):
                raise ValueError("sampling: an embedding request samples nothing; leave it unset")
            params = SamplingParams(max_tokens=1) if embed else sampling_params(request.sampling)
            stream = engine.submit(request_prompt(request), params, request.request_id or None,
                                   request.lora if request.HasField("lora") else None, embed)
        except (ValueError, QueueFullError, EngineDeadError) as e:
            self._abort(context, e)
        with self._lock:
            self._streams[stream.request_id] = stream
        try:
            # Runs when the RPC ends for any reason, e.g. the client cancelled or disconnected: free the KV blocks.
            if not context.add_callback(stream.cancel):
                stream.cancel()
            yield from requests.follow(stream, lambda: not context.is_active(), _POLL_S)
        except (ValueError, EngineDeadError) as e:
            self._abort(context, e)
        finally:
            with self._lock:
                self._streams.pop(stream.request_id, None)

    def GenerateStream(self, request: pb.GenerateRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for output in self._outputs(request, context):
            yield response(output)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        whole = requests.Accumulated()
        for output in self._outputs(request, context):
            whole.add(output)
        last = whole.last
        return response(RequestOutput(last.request_id, whole.token_ids, whole.text, last.finished, last.finish_reason,
                                      whole.logprobs, last.num_prompt_tokens, last.num_output_tokens, last.metrics,
                                      whole.prompt_logprobs, whole.beams))

    def Embed(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        *_, last = self._outputs(request, context, embed=True)
        if last.embedding is None:
            context.abort(grpc.StatusCode.CANCELLED, f"request {last.request_id} ended before its prompt was embedded")
        return pb.EmbedResponse(request_id=last.request_id, embedding=last.embedding.tolist(), usage=_usage(last))

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty; give the id of the request")
        return pb.CancelResponse(found=self._engine(context).cancel(request.request_id))

    def cancel_all(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.cancel()

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        core = self._engine(context).core
        info, sched = core.engine.info, core.scheduler.config
        return pb.ModelInfo(
            architecture=info.model.architecture, dtype=info.model.dtype, vocab_size=core.vocab_size,
            num_layers=info.model.num_hidden_layers, max_seq_len=sched.max_seq_len,
            max_batch_size=sched.max_batch_size, max_num_tokens=sched.max_num_tokens,
            tokens_per_block=core.kv.block_size, kv_cache_blocks=core.kv.pool.num_blocks,
            kv_cache_tokens=core.kv.pool.num_blocks * core.kv.block_size, policy=sched.policy,
            prefix_caching=core.kv.pool.enable_caching, max_queue_size=self.max_queue_size,
            has_tokenizer=core.tokenizer is not None, eos_token_ids=core.eos_token_ids,
            trtbuild_version=__version__, lora_names=core.lora_names, task=info.build.task,
            max_loras=info.build.max_loras)

    def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                        context: grpc.ServicerContext) -> pb.LoraAdaptersResponse:
        engine = self._engine(context)
        if not request.lora_name or not request.lora_path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give both lora_name and lora_path")
        return self._lora_change(context, lambda: engine.load_lora(request.lora_name, request.lora_path))

    def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                          context: grpc.ServicerContext) -> pb.LoraAdaptersResponse:
        engine = self._engine(context)
        if engine.core.lora.dynamic and request.lora_name not in engine.core.lora_names:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {request.lora_name!r} is loaded; loaded: "
                                                     f"{', '.join(engine.core.lora_names) or 'none'}")
        return self._lora_change(context, lambda: engine.unload_lora(request.lora_name))

    def _lora_change(self, context: grpc.ServicerContext, change: Callable[[], None]) -> pb.LoraAdaptersResponse:
        try:
            change()
        except LoraLoadError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, e.message)
        except EngineDeadError as e:
            self._abort(context, e)
        return pb.LoraAdaptersResponse(lora_names=self._engine(context).core.lora_names)

    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.Stats:
        engine = self._engine(context)
        core = engine.core
        pool = core.kv.pool
        stats = pb.Stats(num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
                         num_unfinished=engine.num_unfinished, kv_cache_usage=pool.usage, kv_free_blocks=pool.num_free,
                         kv_total_blocks=pool.num_blocks, num_finished=engine.num_finished,
                         num_preemptions=engine.num_preemptions)
        stats.finish_reasons.update(engine.finish_reasons)
        last = core.last_stats
        if last is not None:
            stats.last_step.CopyFrom(pb.StepStats(
                num_running=last.num_running, num_waiting=last.num_waiting,
                num_scheduled_tokens=last.num_scheduled_tokens, num_preempted=last.num_preempted,
                kv_cache_usage=last.kv_cache_usage, seconds=last.seconds))
        return stats


# ---- the server -----------------------------------------------------------------------------------------------------
def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <key>` (UNAUTHENTICATED); health checks stay open, as vLLM leaves
    /health open, so that probes need no secret."""

    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health.v1."):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if secrets.compare_digest(given.encode(), self.expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization: "
                                                           "Bearer <key>)")

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class _ParseRequestsInterceptor(grpc.ServerInterceptor):
    """Parses unary request messages inside the handler: bytes that are not the method's message get
    INVALID_ARGUMENT and one log line. NOTE: grpcio answers a failing request deserializer with INTERNAL and logs a
    traceback per call, which blames the server for the client's bytes."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method, parse = handler_call_details.method, handler.request_deserializer
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def parsed(raw: bytes, context: grpc.ServicerContext):
            try:
                request = parse(raw)
            except Exception as e:  # protobuf's DecodeError, or whatever a generated parser raises
                log.warning("%s: malformed request of %d bytes refused (%s)", method, len(raw), e)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request body is not a valid {method} request message ({e})")
            return behavior(request, context)

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else \
            grpc.unary_unary_rpc_method_handler
        return make(parsed, request_deserializer=None, response_serializer=handler.response_serializer)


class GenerationServer:
    """A started gRPC server (health NOT_SERVING) bound to host:port (`port` 0 picks one: see `.port`).
    `load()` loads the engine and turns health to SERVING; `stop()` shuts down gracefully."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 max_queue_size: int = RuntimeConfig.max_queue_size, api_key: str | None = None) -> None:
        """`max_queue_size` (RuntimeConfig's, validated there) sizes the worker pool before an engine is loaded.
        `api_key`: every call but health checks needs `authorization: Bearer <key>` metadata."""
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.servicer = GenerationServicer(max_queue_size, self.health)
        # NOTE: each streaming call holds a worker thread while its request is unfinished.
        self._server = grpc.server(ThreadPoolExecutor(max_workers=max_queue_size + 16, thread_name_prefix="grpc"),
                                   options=[("grpc.so_reuseport", 0),  # a second server must not share the port
                                            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
                                   interceptors=[*([_ApiKeyInterceptor(api_key)] if api_key else []),
                                                 _ParseRequestsInterceptor()])
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            self.port = self._server.add_insecure_port(_address(host, port))
        except RuntimeError as e:
            raise TrtbuildError(f"cannot listen on {_address(host, port)} ({e}); is the port in use?") from None
        if self.port == 0:  # older grpcio reports a failed bind this way
            raise TrtbuildError(f"cannot listen on {_address(host, port)}; is the port in use?")
        self.address = _address(host, self.port)
        self._server.start()

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def load(self, engine_dir: Path, config: RuntimeConfig | None = None) -> EngineCore:
        core = EngineCore(Path(engine_dir), config)
        self.servicer.engine = AsyncEngine(core, self.servicer.max_queue_size)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return core

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting calls, end every stream (its request is aborted), then stop the engine loop."""
        self.health.enter_graceful_shutdown()
        done = self._server.stop(grace)
        self.servicer.cancel_all()
        done.wait(grace + 1.0)
        if self.servicer.engine is not None:
            self.servicer.engine.shutdown()


def serve(engine_dir: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT, config: RuntimeConfig | None = None,
          grace: float = 5.0, http_port: int | None = None, api_key: str | None = None,
          model_name: str | None = None, tool_call_parser: str = "auto", reasoning_parser: str = "auto",
          lora_modules: tuple[tuple[str, str], ...] = ()) -> None:
    """Serve until SIGTERM or SIGINT (from the main thread). Binds loopback unless told otherwise.
    `tool_call_parser`, `reasoning_parser`: the OpenAI API's (serving/openai/app.py). `lora_modules`: (name, path)
    of LoRA adapters to load into the engine's slots before it serves."""
    config = config or RuntimeConfig()
    max_queue_size = config.max_queue_size
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    http = None
    # a broken engine fails before "listening on"
    read_engine_config(Path(engine_dir), expect_target=engine_target(Path(engine_dir)))
    try:
        server = GenerationServer(host, port, max_queue_size, api_key)
        try:
            print(f"trtbuild serve listening on {server.address}", flush=True)
            core = server.load(engine_dir, config)
            for name, path in lora_modules:
                server.servicer.engine.load_lora(name, path)
                print(f"trtbuild serve: LoRA adapter {name} loaded from {path}", flush=True)
            kv, pool = core.kv, core.kv.pool
            print(f"trtbuild serve: KV cache {pool.num_blocks} blocks x {kv.block_size} tokens = "
                  f"{pool.num_blocks * kv.block_size} tokens; policy {core.scheduler.config.policy}; "
                  f"max queue {max_queue_size}; ready", flush=True)
            if http_port is not None:  # the OpenAI API over the same engine loop
                from trtbuild.serving.openai.server import HttpServer

                http = HttpServer(server.servicer.engine, host, http_port, model_name or Path(engine_dir).name,
                                  api_key, tool_call_parser, reasoning_parser)
                tools = http.openai.tool_format.name if http.openai.tool_format else "none"
                print(f"trtbuild serve: OpenAI API on {http.address}/v1 (model {http.openai.model_name}, tool "
                      f"calls: {tools}, reasoning split: {'yes' if http.openai.reasoning else 'no'})", flush=True)
            while not stop.wait(0.5):
                pass
            print("trtbuild serve: shutting down", flush=True)
        finally:
            if http is not None:
                http.stop()
            server.stop(grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
