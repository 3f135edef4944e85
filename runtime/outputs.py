"""What EngineCore.step returns: each request's delta (RequestOutput) and the step's statistics (StepStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trtbuild.runtime.beam_search import Beam
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.runtime.request import RequestMetrics


@dataclass
class RequestOutput:
    """What one step produced for one request (a streaming delta); the last one has finished=True."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first, which nothing scores), in the
    # request's first output with tokens only
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    beams: list[Beam] | None = None  # SamplingParams.beam_width > 1: the answers, best first (the first is the output)
    embedding: np.ndarray | None = None  # an embed engine's answer (BuildConfig.task): the prompt's, L2-normalized


@dataclass(frozen=True)
class StepStats:
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_preempted: int
    kv_cache_usage: float
    seconds: float
    num_draft_tokens: int = 0  # speculative drafts among the scheduled tokens
    num_accepted_draft_tokens: int = 0
    engine_seconds: float = 0.0  # of `seconds`, inside the engine call (ONNX Runtime); the rest is host work
