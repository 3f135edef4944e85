"""Token-budget inflight batching: each step mixes decode tokens and prefill chunks of many requests.

Requests are scheduled in tokens: every step computes, for each scheduled request, some of the tokens between
`num_computed_tokens` and `len(token_ids) + len(spec_token_ids)`. A decode is one such token, a prefill chunk many;
speculative drafts are more known tokens after a decode token, with no new phase. With recurrent layers, a rejected
draft sends the request back to the state before its drafts: the drafts it accepted are computed again at the head
of its next chunk, before that chunk's own drafts (runtime/recurrent_state.py).

Policies (as TensorRT-LLM's capacity scheduler):
- guaranteed_no_evict: admit a request only when blocks for its whole lifetime (prompt + max_tokens) can be
  reserved, so running requests never run out of KV memory.
- max_utilization: admit while the current chunk fits; when the pool runs dry, preempt the most recently admitted
  request (free its blocks, recompute it later, reusing whatever prefix blocks are still cached).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from trtbuild.errors import ConfigError
from trtbuild.runtime.kv_cache_manager import NO_PREFIX, CachedPrefix, KVCacheManager
from trtbuild.runtime.request import FinishReason, Request, RequestStatus

POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int
    max_batch_size: int
    max_seq_len: int
    policy: str = "max_utilization"
    max_prefill_chunk: int | None = None  # cap on one request's prefill tokens per step (None: the whole budget)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # tokens of this request already computed
    num_tokens: int
    # rows for the last num_logits tokens: num_prompt_logits rows scoring prompt tokens, then 1 + num_drafts rows to
    # sample from when the chunk reaches the request's newest known token
    num_logits: int
    block_ids: tuple[int, ...]
    num_drafts: int = 0  # the chunk's last num_drafts tokens are speculative drafts
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # the tables of the other KV cache groups, if any
    num_prompt_logits: int = 0  # rows whose position p scores prompt token p + 1 (SamplingParams.prompt_logprobs)

    @property
    def samples(self) -> bool:
        """Whether the step samples new tokens for the request from this chunk's last rows."""
        return self.num_logits > self.num_prompt_logits


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # beam searches admitted: their beams (all running or all waiting) may take this many batch slots
        self.beam_slots: dict[str, int] = {}

    # ---- admission ---------------------------------------------------------------------------------------------
    def lifetime_tokens(self, request: Request) -> int:
        return min(request.num_prompt_tokens + request.sampling.max_tokens, self.config.max_seq_len)

    def check_fits(self, request: Request) -> None:
        """Reject, at submission, a request that could never run (raises ValueError naming the limit)."""
        n, limit = request.num_prompt_tokens, self.config.max_seq_len
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens; the engine's max_seq_len is {limit} (prompt + output), "
                             "so shorten the prompt or rebuild the engine with a larger --max-seq-len")
        lifetime = self.lifetime_tokens(request)
        if self.config.policy == "guaranteed_no_evict":  # reserved up front, in every group
            blocks = -(-lifetime // self.kv.block_size) * self.kv.num_groups
        else:
            blocks = self.kv.max_blocks(lifetime, self.config.max_num_tokens)
        if blocks > self.kv.pool.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks but the whole cache holds {self.kv.pool.num_blocks}; "
                             "lower max_tokens or give the server more --kv-cache-memory")

    def add_request(self, request: Request) -> None:
        self.check_fits(request)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------------
    def _chunk_size(self, request: Request, budget: int) -> int:
        todo = len(request.token_ids) - request.num_computed_tokens
        if request.spec_token_ids and todo < budget:  # its known tokens, then whatever drafts the budget allows
            del request.spec_token_ids[budget - todo:]
            return todo + len(request.spec_token_ids)
        request.spec_token_ids.clear()
        return self._prefill_size(request, request.num_computed_tokens, budget)

    def _prefill_size(self, request: Request, start: int, budget: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Tokens of a prefill chunk from position `start`: as many as the budget and max_prefill_chunk allow, up to
        where a recurrent state is kept (KVCacheManager.state_save_point) if the chunk would pass it."""
        n = min(len(request.token_ids) - start, budget, self.config.max_prefill_chunk or budget)
        stop = self.kv.state_save_point(request, start, prefix)
        return stop - start if start < stop < start + n else n

    @staticmethod
    def scores_prompt(request: Request) -> bool:
        """Whether the request still needs its prompt's logprobs: asked for, and no output yet (a request preempted
        after its first token has had them)."""
        return request.sampling.prompt_logprobs is not None and request.num_output_tokens == 0

    def _prompt_logits(self, request: Request, start: int, num_new: int) -> int:
        """Rows of a chunk of positions [start, start + num_new) that score prompt tokens: every position before the
        prompt's last (whose row samples the first output token)."""
        if not self.scores_prompt(request):
            return 0
        return max(0, min(start + num_new, request.num_prompt_tokens - 1) - start)

    def _preempt(self, request: Request, last: bool = False) -> None:
        """Free the request's blocks and send it back to wait (first in line, or `last`), to be recomputed."""
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        if last:
            self.waiting.append(request)
        else:
            self.waiting.appendleft(request)

    def _idle_beam(self) -> Request | None:
        """The latest running beam with nothing to compute: its row waits for its group's other beams (kept there,
        so preempting it costs only its K/V, recomputed when its group next extends it)."""
        return next((r for r in reversed(self.running)
                     if r.beam_group is not None and r.num_computed_tokens == len(r.token_ids)), None)

    def schedule(self) -> SchedulerOutput:
        budget, chunks, preempted = self.config.max_num_tokens, [], []
        scheduled: list[tuple[Request, int]] = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below to make room for an earlier request
            num_new = self._chunk_size(request, budget)
            if num_new <= 0:
                continue
            while not self.kv.allocate(request, request.num_computed_tokens + num_new):
                if request.spec_token_ids:  # drafts are optional: drop them before preempting anyone
                    request.spec_token_ids.clear()
                    num_new = self._chunk_size(request, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
        while self.waiting and not preempted and budget > 0 and self._has_slot(self.waiting[0]):
            request = self.waiting[0]
            # NOTE: cached prefix blocks have no logits to score the prompt with, so such a request computes it all
            prefix = NO_PREFIX if self.scores_prompt(request) else self.kv.computed_prefix(request)
            computed = len(prefix) * self.kv.block_size
            num_new = self._prefill_size(request, computed, budget, prefix)
            reserve = self.lifetime_tokens(request) if self.config.policy == "guaranteed_no_evict" else 0
            if not self.kv.allocate(request, max(computed + num_new, reserve), prefix):
                # NOTE: beams waiting for their group's others hold blocks without running; a beam search whose
                # waiting beam they crowd out would wait forever: they make room, at the back of the line
                if (idle := self._idle_beam()) is None:
                    break
                self._preempt(idle, last=True)
                continue
            self.waiting.popleft()
            if request.beam_group is not None:
                self.beam_slots.setdefault(request.beam_group, request.sampling.beam_width)
            request.num_computed_tokens = computed
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
                request.metrics.num_prefix_cached_tokens = computed
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        for request, num_new in scheduled:
            start, drafts = request.num_computed_tokens, len(request.spec_token_ids)
            reaches_end = start + num_new == len(request.token_ids) + drafts
            first, *others = self.kv.block_tables(request)
            prompt_rows = self._prompt_logits(request, start, num_new)
            chunks.append(ScheduledChunk(request, start, num_new, prompt_rows + (1 + drafts) * reaches_end, first,
                                         drafts, tuple(others), prompt_rows))
        return SchedulerOutput(chunks, preempted)

    def _has_slot(self, request: Request) -> bool:
        """Whether the batch has room for the request: a beam search reserves a slot per beam when first admitted,
        since its beams advance together (one left waiting would stall the others in their slots)."""
        used = sum(self.beam_slots.values()) + sum(r.beam_group is None for r in self.running)
        if request.beam_group is None:
            return used < self.config.max_batch_size
        return request.beam_group in self.beam_slots or used + request.sampling.beam_width <= self.config.max_batch_size

    # ---- after the engine ran ----------------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: list[list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance computed counts and append each chunk's new tokens (one list per chunk that samples, in order:
        its accepted drafts, then one sampled token), up to the first that stops the request; returns the requests
        that received tokens, with those tokens."""
        got_tokens, sampled_iter = [], iter(sampled)
        for chunk in output.chunks:
            request = chunk.request
            tokens = next(sampled_iter) if chunk.samples else []
            accepted = max(len(tokens) - 1, 0)  # drafts the engine verified and the sampler kept
            request.spec_token_ids.clear()
            request.num_computed_tokens += chunk.num_tokens - chunk.num_drafts + accepted
            if accepted < chunk.num_drafts and self.kv.state_slots is not None:
                # NOTE: the recurrent state went through the rejected drafts too; it is restored to where the step
                # kept it, after the known tokens, and the accepted drafts are computed again with the next chunk
                request.num_computed_tokens -= accepted
                self.kv.roll_back_state(request)
            request.metrics.num_draft_tokens += chunk.num_drafts
            request.metrics.num_accepted_draft_tokens += accepted
            appended, reason = [], None
            for token in tokens:
                request.token_ids.append(token)
                appended.append(token)
                if (reason := self._stop_reason(request, token)) is not None:
                    break
            # NOTE: a stop among the accepted drafts leaves computed K/V past the last kept token; it is dropped.
            request.num_computed_tokens = min(request.num_computed_tokens, len(request.token_ids))
            self.kv.cache_full_blocks(request)
            self.kv.keep_state(request)
            self.kv.release_outside_window(request)  # after caching: released blocks stay revivable
            if appended:
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = time.monotonic()
                got_tokens.append((request, appended))
            if reason is not None:
                self.finish_requests([request], reason)
        return got_tokens

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling
        is_stop = token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids)
        if is_stop and request.num_output_tokens >= params.min_tokens:
            return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or len(request.token_ids) >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    # ---- beam search (runtime/beam_search.py decides, this applies) ------------------------------------------------
    def extend_beam(self, request: Request, token: int) -> None:
        """A beam's next token (its logits row was computed in an earlier step)."""
        request.token_ids.append(int(token))
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.monotonic()

    def fork_beam(self, parent: Request, child_id: str, token: int) -> tuple[Request, list[tuple[int, int]]]:
        """A new beam: the parent's tokens and `token`, running beside it on the parent's KV (the returned block
        copies must reach the KV storage before the next step), or waiting to be recomputed if the pool lacks a
        block for the copy or the parent is not running."""
        child = Request(child_id, parent.prompt_ids, parent.sampling, parent.eos_token_ids,
                        token_ids=list(parent.token_ids), lora_id=parent.lora_id, lora_key=parent.lora_key,
                        beam_group=parent.beam_group,
                        block_hashes=list(parent.block_hashes))
        copies = self.kv.fork(parent, child) if parent in self.running else None
        if copies is not None and self.config.policy == "guaranteed_no_evict" and not self.kv.allocate(
                child, self.lifetime_tokens(child)):  # its whole lifetime, as every admitted request
            self.kv.free(child)
            copies = None
        if copies is None:
            self.waiting.appendleft(child)
        else:
            child.num_computed_tokens, child.status = parent.num_computed_tokens, RequestStatus.RUNNING
            child.metrics.first_scheduled_time = child.metrics.first_token_time = time.monotonic()
            self.running.append(child)
        child.token_ids.append(int(token))
        return child, copies or []

    def end_beam_search(self, root: Request) -> None:
        """Give back the batch slots of a beam search whose beams all finished (`root`: the client's request)."""
        self.beam_slots.pop(root.request_id, None)
        root.metrics.finished_time = time.monotonic()

    def set_draft_tokens(self, request: Request, draft_token_ids: list[int]) -> None:
        """Drafts a proposer made for a decoding request, verified by its next step (counted as known tokens)."""
        request.spec_token_ids = list(draft_token_ids)

    def finish_requests(self, requests: Iterable[Request], reason: FinishReason, truncate_to: int | None = None
                        ) -> None:
        """End requests (stop, length or abort) and return their blocks to the pool; idempotent.

        `truncate_to` keeps the first n output tokens and drops the rest: a stop string ended the text inside this
        step's tokens. That outranks how update() ended the request, so the reason is overwritten even when the
        request already finished (e.g. by length on the same token)."""
        for request in requests:
            if truncate_to is not None:
                del request.token_ids[request.num_prompt_tokens + truncate_to:]
                request.num_computed_tokens = min(request.num_computed_tokens, len(request.token_ids))
                request.finish_reason = reason
            if request.finished:
                continue
            if request in self.running:
                self.running.remove(request)
                self.kv.free(request)
            elif request in self.waiting:
                self.waiting.remove(request)
                self.kv.free(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            request.metrics.finished_time = time.monotonic()
