"""The engine loop on its own thread: requests come in and outputs go out through queues.

Callers (gRPC handlers, the Triton backend, `trtbuild run`) never wait on a step: `submit` validates the request
in the caller's thread, enqueues it, and returns a stream; the loop thread drains commands, runs `step()` and
routes each output to its request's stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from trtbuild.runtime.engine_core import EngineCore, RequestOutput
from trtbuild.runtime.request import FinishReason
from trtbuild.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


# NOTE: the default bound on queued prompt tokens: a prompt that waits behind more than a few KV pools' worth of
# others waits for several turnovers of the whole pool, and each queued token costs host memory (~40 bytes as ids)
QUEUED_TOKENS_PER_POOL_TOKEN = 4


class QueueFullError(RuntimeError):
    """The server holds as many unfinished requests (or their prompt tokens) as it accepts; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped because of an internal error."""


@dataclass
class _Add:
    request: object
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _LoraUpdate:
    """A change to the adapters the engine serves, applied between steps (runtime/lora_slots.py)."""

    apply: Callable[[], None]
    done: Future = field(default_factory=Future)


class RequestStream:
    """Outputs of one request, in order; iterate it, or call `get()`. `cancel()` aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, num_prompt_tokens: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._queue: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    def cancel(self) -> None:
        if not self.finished:
            self.engine.cancel(self.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore, max_queue_size: int | None = None) -> None:
        """`max_queue_size`: unfinished requests held at most [None: the core's RuntimeConfig.max_queue_size]."""
        self.core = core
        self.max_queue_size = max_queue_size or core.config.max_queue_size
        pool_tokens = core.kv.pool.num_blocks * core.kv.block_size
        self.max_queued_tokens = core.config.max_queued_tokens or max(
            QUEUED_TOKENS_PER_POOL_TOKEN * pool_tokens, core.scheduler.config.max_seq_len)
        self._queued_tokens = 0  # prompt tokens of the requests in _streams
        self._commands: queue.Queue[_Add | _Abort | _LoraUpdate | None] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopped = False  # set once the loop has ended: no more submits
        self.num_finished = 0  # requests that ended (any reason), and their preemptions: counters for stats
        self.num_preemptions = 0
        self.finish_reasons: Counter[str] = Counter()  # ended requests by finish reason
        # called on the loop thread with each request's final output (e.g. Prometheus metrics); must not block
        self.on_finished: list[Callable[[RequestOutput], None]] = []
        self._thread = threading.Thread(target=self._loop, name="trtbuild-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side -------------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
               lora: str | None = None, embed: bool = False) -> RequestStream:
        """Validate and enqueue (under LoRA adapter `lora`, if named; `embed`: for the prompt's embedding, on an
        embed engine); raises ValueError (bad field), QueueFullError or EngineDeadError."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error}")
        request = self.core.make_request(prompt, params, request_id, lora, embed)
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine loop has stopped (shut down)")
            if request.request_id in self._streams:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            if len(self._streams) >= self.max_queue_size:
                raise QueueFullError(f"the server already holds {self.max_queue_size} unfinished requests")
            if self._queued_tokens + request.num_prompt_tokens > self.max_queued_tokens:
                raise QueueFullError(f"the server already holds {self._queued_tokens} prompt tokens of unfinished "
                                     f"requests; {request.num_prompt_tokens} more exceed its limit of "
                                     f"{self.max_queued_tokens} (--max-queued-tokens)")
            stream = RequestStream(self, request.request_id, request.num_prompt_tokens)
            self._streams[request.request_id] = stream
            self._queued_tokens += request.num_prompt_tokens
        self._commands.put(_Add(request, stream))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort" and its blocks return to the pool."""
        with self._lock:
            known = request_id in self._streams
        if known:
            self._commands.put(_Abort(request_id))
        return known

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve LoRA adapter `name` from `path` (a slot engine's): read and checked in the caller's thread, put in
        a free slot between steps. Raises LoraLoadError (what to do is in its message) or EngineDeadError."""
        adapter = self.core.lora.prepare(name, path)
        self._update(lambda: self.core.load_lora(adapter))

    def unload_lora(self, name: str) -> None:
        """Stop serving LoRA adapter `name`; the requests already under it finish under it."""
        self._update(lambda: self.core.unload_lora(name))

    def _update(self, apply: Callable[[], None]) -> None:
        command = _LoraUpdate(apply)
        with self._lock:  # NOTE: under the lock, so that the loop's end either sees the command or refuses it here
            if self._stopped or self._error is not None:
                raise EngineDeadError("the engine loop has stopped")
            self._commands.put(command)
        command.done.result()

    @property
    def dead(self) -> bool:
        """The loop stopped on an internal error: every request is refused (health checks report it)."""
        return self._error is not None

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # NOTE: a step still running keeps the engine until it ends
            self.core.close()

    # ---- loop thread -------------------------------------------------------------------------------------------
    def _apply(self, command: _Add | _Abort | _LoraUpdate) -> None:
        if isinstance(command, _LoraUpdate):
            try:
                command.apply()
                command.done.set_result(None)
            except Exception as e:  # NOTE: the caller's error (LoraLoadError), raised in its thread
                command.done.set_exception(e)
        elif isinstance(command, _Add):
            try:
                self.core.add_request(command.request)
            except ValueError as e:
                self._finish(command.stream.request_id, e)
        else:
            output = self.core.abort_request(command.request_id)
            if output is not None:
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._release(output.request_id)
                self.num_finished += 1
                self.finish_reasons[output.finish_reason or "unknown"] += 1
                if output.metrics is not None:
                    self.num_preemptions += output.metrics.num_preemptions
        if stream is not None:
            stream.put(output)
        if output.finished:
            for listener in self.on_finished:
                try:
                    listener(output)
                except Exception:  # NOTE: a metrics bug must not stop the engine loop
                    log.exception("on_finished listener failed")

    def _release(self, request_id: str) -> RequestStream | None:
        """Forget a request's stream (lock held)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._queued_tokens -= stream.num_prompt_tokens
        return stream

    def _finish(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._release(request_id)
        if stream is not None:
            stream.put(error)

    def _loop(self) -> None:
        try:
            while True:
                # Block for work when idle; otherwise take whatever arrived since the last step.
                block = not self.core.has_unfinished()
                try:
                    command = self._commands.get(block=block)
                    while True:
                        if command is None:
                            return
                        self._apply(command)
                        command = self._commands.get_nowait()
                except queue.Empty:
                    pass
                for output in self.core.step():
                    self._deliver(output)
        except BaseException as e:  # never leave a client waiting forever
            log.exception("engine loop failed")
            self._error = e
            with self._lock:
                streams, self._streams, self._queued_tokens = list(self._streams.values()), {}, 0
            for stream in streams:
                stream.put(EngineDeadError(f"the engine loop stopped: {e}"))
        finally:
            try:
                for request_id in list(self.core.tracked):
                    output = self.core.abort_request(request_id)
                    if output is not None:
                        self._deliver(output)
            finally:
                # Requests whose _Add was still queued behind the shutdown never reached the core: end their streams
                # too, and refuse later submits, so that no client waits forever.
                with self._lock:
                    self._stopped = True
                    streams, self._streams, self._queued_tokens = list(self._streams.values()), {}, 0
                self._refuse_queued_updates()
                for stream in streams:
                    stream.put(RequestOutput(stream.request_id, [], "", True, FinishReason.ABORT.value,
                                             num_prompt_tokens=stream.num_prompt_tokens))

    def _refuse_queued_updates(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _LoraUpdate):
                command.done.set_exception(EngineDeadError("the engine loop stopped before the LoRA change"))
