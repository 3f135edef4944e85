"""A request's state inside the runtime: its tokens, how many of them are computed, status and metrics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from trtbuild.runtime.sampling import SamplingParams, TokenHistory


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens reached (or the engine's max_seq_len)
    ABORT = "abort"  # cancelled by the client


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prefix_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified by the engine
    num_accepted_draft_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class Request(TokenHistory):
    """Token ids are prompt + output. The scheduler advances `num_computed_tokens` (tokens whose K/V are cached)
    towards `len(token_ids) + len(spec_token_ids)` (tokens known); the gap is what the next steps compute: a
    prefill chunk, one decode token, or a decode token followed by speculative drafts (not yet part of the output)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks of token_ids
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    lora_id: int = 0  # the LoRA adapter it runs under (0: none; 1-based, runtime/lora_slots.py: LoraAdapters)
    lora_key: int = 0  # ... and that adapter's load, which its prefix-cache blocks chain from
    beam_group: str | None = None  # a beam of this client request's beam search (runtime/beam_search.py)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
