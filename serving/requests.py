"""What every front end (gRPC, Triton, OpenAI HTTP) does with a request, apart from its wire format:

decode -> `sampling_params` + `prompt_of`    a client's fields become SamplingParams and a prompt; a bad value is a
                                            ValueError naming the field as the client spelled it
submit -> AsyncEngine.submit                 errors sorted by `error_kind` into the front end's status codes
stream -> `follow`                           the request's outputs (deltas) in order; the request is cancelled, and
                                            its KV blocks freed, as soon as the client is gone
answer -> `Accumulated`                      the deltas added up, for a client that wants one response
"""

from __future__ import annotations

import enum
import queue
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from trtbuild.errors import ConfigError
from trtbuild.runtime.async_engine import EngineDeadError, QueueFullError, RequestStream
from trtbuild.runtime.beam_search import Beam
from trtbuild.runtime.engine_core import RequestOutput
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.runtime.sampling import SamplingParams

DRAIN_S = 5.0  # how long a cancelled request is followed to its end (its abort output), after which we stop waiting


class ErrorKind(enum.Enum):
    """What went wrong with a request, for the front end to turn into its own status code."""

    INVALID_ARGUMENT = "invalid_argument"  # the client's fault: fix the request
    QUEUE_FULL = "queue_full"  # the server holds as many requests as it accepts: retry later
    UNAVAILABLE = "unavailable"  # the engine loop stopped
    INTERNAL = "internal"  # a bug


def error_kind(error: BaseException) -> ErrorKind:
    if isinstance(error, QueueFullError):
        return ErrorKind.QUEUE_FULL
    if isinstance(error, EngineDeadError):
        return ErrorKind.UNAVAILABLE
    return ErrorKind.INVALID_ARGUMENT if isinstance(error, ValueError) else ErrorKind.INTERNAL


def sampling_params(fields: Mapping[str, object], wire_names: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams from the fields a client set (SamplingParams field -> value; absent: the default). An invalid
    value is a ConfigError naming the field as the client spelled it (`wire_names`: SamplingParams field -> name)."""
    try:
        return SamplingParams(**fields)
    except ConfigError as e:
        raise ConfigError((wire_names or {}).get(e.field, e.field), e.problem) from None


def prompt_of(text: str | None, token_ids: Sequence[int] | None, text_name: str = "prompt",
              ids_name: str = "prompt_token_ids") -> str | list[int]:
    """The prompt: text or token ids, exactly one of them, not empty (ValueError names the client's fields)."""
    if (text is None) == (token_ids is None):
        raise ValueError(f"send exactly one of {text_name} (text) and {ids_name} (token ids), got "
                         f"{'both' if text is not None else 'neither'}")
    if text is not None:
        if not text:
            raise ValueError(f"{text_name} is empty")
        return text
    if not token_ids:
        raise ValueError(f"{ids_name} is empty")
    return [int(t) for t in token_ids]


def follow(stream: RequestStream, client_gone: Callable[[], bool], poll_s: float) -> Iterator[RequestOutput]:
    """Yield the outputs of `stream` up to its last. `client_gone()` is asked at most every `poll_s` seconds (while
    outputs flow, too); once true, the request is cancelled and its remaining outputs still come, up to the last
    (finish_reason "abort"). If the caller stops early (a generator closed because its client left), the request is
    cancelled and followed to its end for at most DRAIN_S, so that its KV blocks are free when this returns.

    Raises what the stream raises: ValueError (the request failed validation in the loop), EngineDeadError."""
    asked, cancelled = time.monotonic(), False
    try:
        while not stream.finished:
            if not cancelled and time.monotonic() - asked >= poll_s:
                asked = time.monotonic()
                if client_gone():
                    stream.cancel()
                    cancelled = True
            try:
                output = stream.get(timeout=poll_s)
            except queue.Empty:
                continue
            yield output
    finally:
        if not stream.finished:
            stream.cancel()
            deadline = time.monotonic() + DRAIN_S
            while not stream.finished and (left := deadline - time.monotonic()) > 0:
                try:
                    stream.get(timeout=left)
                except (queue.Empty, ValueError, EngineDeadError):
                    break


@dataclass
class Accumulated:
    """A request's deltas added up: one response for a client that does not stream, or a prefix to send first."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    last: RequestOutput | None = None  # the newest delta (the final one carries the usage numbers)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs (first delta's)
    beams: list[Beam] | None = None  # SamplingParams.beam_width > 1: the answers, best first (last delta's)

    def add(self, output: RequestOutput) -> Accumulated:
        self.text += output.new_text
        self.token_ids += output.new_token_ids
        self.logprobs += output.logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.beams is not None:
            self.beams = output.beams
        self.finish_reason, self.last = output.finish_reason, output
        return self

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


def cached_prompt_tokens(wholes: list[Accumulated], prompts: list[object] | None = None) -> int:
    """Prompt tokens the prefix cache gave (as usage counts prompt tokens): each prompt's first request's, whose other
    choices (n) share the prompt; `prompts`: each request's prompt object (None: one prompt, a chat's)."""
    firsts = [w for i, w in enumerate(wholes) if i == 0 or (prompts is not None and prompts[i] is not prompts[i - 1])]
    return sum(w.last.metrics.num_prefix_cached_tokens for w in firsts if w.last is not None and w.last.metrics)


def answers(wholes: list[Accumulated]) -> list[Accumulated]:
    """Each request's answer, in order; a beam search's are its beams, best first."""
    out = []
    for w in wholes:
        if w.beams is None:
            out.append(w)
        else:
            out += [Accumulated(b.text, list(b.token_ids), [], b.finish_reason.value, w.last) for b in w.beams]
    return out
