"""The Triton Python-backend model: trtbuild's engine loop (AsyncEngine over EngineCore) behind Triton.

One model instance holds one engine; requests of every Triton client join its inflight batch.
- Decoupled: `execute` validates and submits each request, hands it to a worker thread and returns at once; the
  worker streams the request's outputs through its response sender (the last one flagged FINAL), checks for
  cancellation while it waits, and cancels the request in the engine (its KV blocks return to the pool).
- Non-decoupled: `execute` submits all requests of its batch (the dynamic batcher's), waits, and returns one
  response per request.
Invalid inputs are answered with a TritonError response naming the tensor; the stub never raises for them.
KV pool and request gauges are Triton custom metrics (trtbuild_kv_cache_block_metrics, trtbuild_request_metrics).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trtbuild.runtime.async_engine import AsyncEngine, RequestStream
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.serving.requests import Accumulated, ErrorKind, error_kind, follow
from trtbuild.serving.triton_backend.repository import runtime_options
from trtbuild.serving.triton_backend.tensors import (
    INPUT_NAMES,
    STREAMING_NEEDS_DECOUPLED,
    ParsedRequest,
    check_output_len,
    parse_request,
    response_arrays,
)

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton stub: the module still imports (docs, tests of the helpers)
    pb_utils = None

log = logging.getLogger(__name__)
POLL_S = 0.05  # a worker asks Triton whether its client cancelled at most this often (an IPC call)
METRICS_S = 0.02  # how often the gauges are refreshed (a gauge is sent to Triton only when it changed)


def _error(message: str, code: str = "INVALID_ARG") -> Any:
    cls = pb_utils.TritonError
    return pb_utils.InferenceResponse(error=cls(message, getattr(cls, code, cls.INTERNAL)))


_CODES = {ErrorKind.INVALID_ARGUMENT: "INVALID_ARG", ErrorKind.QUEUE_FULL: "UNAVAILABLE",
          ErrorKind.UNAVAILABLE: "UNAVAILABLE", ErrorKind.INTERNAL: "INTERNAL"}


def _answer_error(error: Exception) -> Any:
    """The error response of a request that failed (requests.error_kind picks the Triton code)."""
    kind = error_kind(error)
    message = {ErrorKind.QUEUE_FULL: f"{error}; retry later", ErrorKind.INTERNAL: f"internal error: {error}"}
    return _error(message.get(kind, str(error)), _CODES[kind])


def _response(whole: Accumulated, parsed: ParsedRequest, cum_log_prob: float | None = None) -> Any:
    logprobs = [lp.logprob for lp in whole.logprobs] if parsed.return_log_probs else None
    arrays = response_arrays(whole.text, whole.token_ids, logprobs, whole.finish_reason, cum_log_prob)
    return pb_utils.InferenceResponse([pb_utils.Tensor(name, a) for name, a in arrays.items()])


class _ClientGone:
    """Asks Triton whether the client cancelled (an IPC call), and remembers the answer once it is yes."""

    def __init__(self, is_cancelled: Any) -> None:
        self.is_cancelled, self.seen = is_cancelled, False

    def __call__(self) -> bool:
        self.seen = self.seen or bool(self.is_cancelled())
        return self.seen


class _Metrics:
    """Gauges in Triton's /metrics, refreshed by a thread: KV blocks (max, free, used, tokens_per) and requests
    (active = unfinished in the engine, running, waiting, max = queue size, completed = answered by this model,
    cancelled = of those, cancelled by their client before the end)."""

    def __init__(self, engine: AsyncEngine, labels: dict[str, str], max_queue_size: int) -> None:
        self.engine, self.max_queue_size, self.completed, self.cancelled = engine, max_queue_size, 0, 0
        kv = pb_utils.MetricFamily("trtbuild_kv_cache_block_metrics", "KV cache blocks of the trtbuild engine",
                                   pb_utils.MetricFamily.GAUGE)
        req = pb_utils.MetricFamily("trtbuild_request_metrics", "Requests in the trtbuild engine",
                                    pb_utils.MetricFamily.GAUGE)
        self._gauges = {("kv", k): kv.Metric({**labels, "kv_cache_block_type": k})
                        for k in ("max", "free", "used", "tokens_per")}
        self._gauges.update({("req", k): req.Metric({**labels, "request_type": k})
                             for k in ("active", "running", "waiting", "max", "completed", "cancelled")})
        self._families, self._last, self._stop = (kv, req), {}, threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trtbuild-triton-metrics", daemon=True)
        self._thread.start()

    def values(self) -> dict[tuple[str, str], int]:
        core, pool = self.engine.core, self.engine.core.kv.pool
        return {("kv", "max"): pool.num_blocks, ("kv", "free"): pool.num_free,
                ("kv", "used"): pool.num_blocks - pool.num_free, ("kv", "tokens_per"): core.kv.block_size,
                ("req", "active"): self.engine.num_unfinished, ("req", "running"): len(core.scheduler.running),
                ("req", "waiting"): len(core.scheduler.waiting), ("req", "max"): self.max_queue_size,
                ("req", "completed"): self.completed, ("req", "cancelled"): self.cancelled}

    def _loop(self) -> None:
        while not self._stop.wait(METRICS_S):
            for key, value in self.values().items():
                if self._last.get(key) != value:
                    self._gauges[key].set(value)
                    self._last[key] = value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        engine_dir, runtime = runtime_options(config.get("parameters", {}))
        max_queue_size = runtime.max_queue_size
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.core = EngineCore(engine_dir, runtime)
        self.engine = AsyncEngine(self.core)
        self._workers = ThreadPoolExecutor(max_workers=max_queue_size, thread_name_prefix="trtbuild-triton")
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        labels = {"model": args.get("model_name", ""), "version": args.get("model_version", "")}
        self.metrics = _Metrics(self.engine, labels, max_queue_size)
        pool, sched = self.core.kv.pool, self.core.scheduler.config
        pb_utils.Logger.log_info(
            f"trtbuild: engine {engine_dir} loaded ({'decoupled' if self.decoupled else 'not decoupled'}); KV cache "
            f"{pool.num_blocks} blocks x {self.core.kv.block_size} tokens; max batch {sched.max_batch_size}, "
            f"max num tokens {sched.max_num_tokens}, policy {sched.policy}, prefix reuse {pool.enable_caching}")

    # ---- requests ------------------------------------------------------------------------------------------------
    def _submit(self, request: Any) -> tuple[ParsedRequest, list[int], RequestStream]:
        """Parse and validate a request and enqueue it in the engine (ValueError, QueueFullError, EngineDeadError)."""
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        extra = [k for k in json.loads(request.parameters() or "{}") if not k.startswith("triton_")]
        if extra:  # HTTP generate turns JSON fields that are not input tensors into parameters: a typo lands here
            raise ValueError(f"unknown inputs {sorted(extra)} (sent as request parameters); this model takes the "
                             f"input tensors {', '.join(INPUT_NAMES)}")
        parsed = parse_request(inputs, self.core.vocab_size, self.core.lora_names)
        if parsed.stream and not self.decoupled:
            raise ValueError(STREAMING_NEEDS_DECOUPLED)
        ids = parsed.prompt_ids
        if ids is None:
            if self.core.tokenizer is None:
                raise ValueError("text_input: this engine has no tokenizer; send input_ids")
            ids = self.core.tokenizer.encode(parsed.prompt)
        check_output_len(parsed, len(ids), self.core.scheduler.config.max_seq_len)
        stream = self.engine.submit(ids, parsed.params, uuid.uuid4().hex, parsed.lora)
        with self._lock:
            self._streams[stream.request_id] = stream
        return parsed, ids, stream

    def _accumulated(self, parsed: ParsedRequest, ids: list[int]) -> Accumulated:
        """Where a non-streaming answer starts: the prompt itself, unless exclude_input_in_output."""
        if parsed.stream or parsed.exclude_input_in_output:
            return Accumulated()
        text = parsed.prompt if parsed.prompt is not None else (self.core.tokenizer.decode(ids)
                                                                 if self.core.tokenizer else "")
        return Accumulated(text, list(ids))

    def _done(self, stream: RequestStream, cancelled: bool = False) -> None:
        with self._lock:
            self._streams.pop(stream.request_id, None)
            self.metrics.completed += 1
            self.metrics.cancelled += cancelled

    def _stream_worker(self, request: Any, parsed: ParsedRequest, ids: list[int], stream: RequestStream) -> None:
        """Decoupled: answer one request through its response sender; the FINAL flag is always sent once."""
        sender, final = request.get_response_sender(), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sent_final = cancelled = False

        def send(response: Any, last: bool) -> None:
            nonlocal sent_final
            sent_final = sent_final or last  # a failed send is not retried (the client is gone)
            try:
                if response is None:
                    sender.send(flags=final)
                else:
                    sender.send(response, flags=final if last else 0)
            except Exception as e:  # the request may be cancelled or the server stopping
                log.warning("trtbuild: cannot answer request %s: %s", stream.request_id, e)

        gone = _ClientGone(sender.is_cancelled)
        try:
            whole, cum = self._accumulated(parsed, ids), 0.0
            for output in follow(stream, gone, POLL_S):
                if gone.seen:  # cancelled: the client gets the CANCELLED error below, not the abort output
                    continue
                if parsed.stream:  # one response per step: the new tokens; cum_log_probs covers the whole sequence
                    cum += sum(lp.logprob for lp in output.logprobs)
                    send(_response(Accumulated().add(output), parsed, cum), output.finished)
                else:
                    whole.add(output)
            if gone.seen and not sent_final:
                cancelled = True
                send(_error("the request was cancelled", "CANCELLED"), True)
            elif not parsed.stream:
                send(_response(whole, parsed), True)
        except Exception as e:  # every request gets an answer, whatever happened
            log.exception("trtbuild: request %s failed", stream.request_id)
            if not sent_final:
                send(_answer_error(e), True)
        finally:
            if not stream.finished:
                stream.cancel()
            if not sent_final:
                send(None, True)
            self._done(stream, cancelled)

    def _wait(self, request: Any, parsed: ParsedRequest, ids: list[int], stream: RequestStream) -> Any:
        """Non-decoupled: the one response of a request."""
        gone = _ClientGone(request.is_cancelled)
        try:
            whole = self._accumulated(parsed, ids)
            for output in follow(stream, gone, POLL_S):
                whole.add(output)
            return _error("the request was cancelled", "CANCELLED") if gone.seen else _response(whole, parsed)
        except Exception as e:  # every request gets an answer, whatever happened
            if error_kind(e) is ErrorKind.INTERNAL:
                log.exception("trtbuild: request %s failed", stream.request_id)
            return _answer_error(e)
        finally:
            self._done(stream, gone.seen)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        answers: list[Any] = [None] * len(requests)
        submitted = []
        for i, request in enumerate(requests):
            try:
                submitted.append((i, request, *self._submit(request)))
            except Exception as e:
                if error_kind(e) is ErrorKind.INTERNAL:
                    log.exception("trtbuild: cannot submit a request")
                answers[i] = _answer_error(e)
        if self.decoupled:
            for i, request in enumerate(requests):
                if answers[i] is not None:
                    request.get_response_sender().send(answers[i], flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            for _, request, parsed, ids, stream in submitted:
                self._workers.submit(self._stream_worker, request, parsed, ids, stream)
            return None
        for i, request, parsed, ids, stream in submitted:
            answers[i] = self._wait(request, parsed, ids, stream)
        return answers

    def finalize(self) -> None:
        """End every unfinished request, stop the engine loop, the workers and the metrics thread."""
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.cancel()
        self.engine.shutdown()
        self._workers.shutdown(wait=True, cancel_futures=False)
        self.metrics.stop()
        pb_utils.Logger.log_info("trtbuild: engine loop stopped")
