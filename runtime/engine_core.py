"""EngineCore: one synchronous step = schedule -> execute the engine -> sample -> update requests -> outputs.

No threads here (see async_engine.py): tests drive `step()` directly and see exactly what the server sees.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trtbuild.builder.engine_dir import engine_target, read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.runtime.beam_search import BeamGroup
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.detokenizer import IncrementalDetokenizer
from trtbuild.runtime.engine import DraftAccept, SequenceChunk, StepOutput
from trtbuild.runtime.engine_accept import advance, draft_accept, engine_can_verify
from trtbuild.runtime.engines import make_engine
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.logprobs import TokenLogprobs, rows_logprobs
from trtbuild.runtime.lora_slots import LoraAdapters
from trtbuild.runtime.outputs import RequestOutput, StepStats
from trtbuild.runtime.request import FinishReason, Request
from trtbuild.runtime.sampling import Sampler, SamplingParams, SamplingState
from trtbuild.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from trtbuild.runtime.speculative import make_proposer, verify
from trtbuild.runtime.tensor_parallel import TensorParallelEngine
from trtbuild.runtime.tokenizer import Tokenizer, load_generation_eos

if TYPE_CHECKING:
    from trtbuild.builder.lora import LoraAdapter

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer | None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled as prompt chunks run; None once sent
    embedding: np.ndarray | None = None  # an embed engine's answer, once its prompt's last row came


class EngineCore:
    def __init__(self, engine_dir: Path, config: RuntimeConfig | None = None) -> None:
        engine_dir = Path(engine_dir)
        start = time.perf_counter()
        target = engine_target(engine_dir)  # NOTE: the engine class follows the engine dir's target
        info = read_engine_config(engine_dir, expect_target=target)  # compatibility, before any work
        build, model = info.build, info.model
        self.config = config = (config or RuntimeConfig()).resolve(build)
        self.engine, num_blocks, snapshots = make_engine(info, target, config)
        if config.speculative and model.recurrent_layers and not getattr(self.engine, "can_checkpoint_states", False):
            raise ConfigError("num_speculative_tokens", f"{engine_dir} was built before its recurrent layers (linear "
                              "attention, Mamba2) could keep their state from before a step's drafts, which "
                              "verifying drafts needs; rebuild the engine from its checkpoint, or run it without "
                              "speculative decoding.")
        # seconds spent starting: the ONNX Runtime session, then the KV pool faulted in + the warm-up step
        self.start_seconds = {"session": time.perf_counter() - start, "warm_up": 0.0}
        self.kv = KVCacheManager.for_groups(info.kv_cache_groups, num_blocks, build.tokens_per_block,
                                            config.enable_prefix_caching,
                                            config.max_batch_size if model.recurrent_layers else 0, snapshots)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_tokens=config.max_num_tokens, max_batch_size=config.max_batch_size,
                            max_seq_len=build.max_seq_len, policy=config.policy,
                            max_prefill_chunk=config.max_prefill_chunk),
            self.kv)
        self.tokenizer = Tokenizer(engine_dir) if (engine_dir / "tokenizer.json").is_file() else None
        self.eos_token_ids = tuple(dict.fromkeys(model.eos_token_ids + load_generation_eos(engine_dir)))
        self.vocab_size = model.vocab_size
        self.embeds = build.task == "embed"  # every request's answer is its prompt's embedding (BuildConfig.task)
        self.sampler = Sampler()
        self.proposer = None
        if config.speculative:
            # NOTE: a draft pool holds as many tokens as the target's, plus every request's drafts
            draft_tokens = (num_blocks * build.tokens_per_block
                            + config.max_batch_size * config.speculative.num_speculative_tokens)
            self.proposer = make_proposer(config.speculative, info, config.num_threads, draft_tokens)
            if 0 < build.max_draft_len < config.speculative.num_speculative_tokens:
                log.warning("the engine verifies at most %d drafts itself (--max-draft-len); steps with more drafts "
                            "(--speculative-tokens %d) are verified on the host instead", build.max_draft_len,
                            config.speculative.num_speculative_tokens)
        self.lora = LoraAdapters(build, model, getattr(self.engine, "lora_slots", None))
        self.tracked: dict[str, _Tracked] = {}
        self.beam_groups: dict[str, BeamGroup] = {}  # by the request id of each of their beams
        self.last_stats: StepStats | None = None
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB", num_blocks, build.tokens_per_block,
                 num_blocks * build.tokens_per_block, num_blocks * self.engine.kv.bytes_per_block / 2**20)
        if config.warm_up:
            start, limits = time.perf_counter(), self.scheduler.config
            self.engine.kv.reserve()
            self.engine.warm_up(limits.max_batch_size, limits.max_num_tokens)
            if self.proposer is not None:
                self.proposer.warm_up(limits.max_batch_size, limits.max_num_tokens)
            self.start_seconds["warm_up"] = time.perf_counter() - start
            log.info("warmed up: KV pool resident and one step of %d sequences in %.2f s",
                     max(1, min(limits.max_batch_size, limits.max_num_tokens)), self.start_seconds["warm_up"])

    def close(self) -> None:
        """Stop a tensor-parallel engine's rank processes (a single-rank engine holds nothing outside this one)."""
        if isinstance(self.engine, TensorParallelEngine):
            self.engine.close()

    # ---- requests ----------------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     lora: str | None = None, embed: bool = False) -> Request:
        """Tokenize and validate a request without touching engine state (safe from any thread). `lora`: the name
        of one of the engine's LoRA adapters to run it under (None: the base model); `embed`: the request asks for
        its prompt's embedding, which only an embed engine gives (and all it gives).
        Raises ValueError with a message naming the offending field."""
        if embed != self.embeds:
            raise ValueError("this engine embeds (built with `trtbuild build --task embed`): ask it for embeddings "
                             "(the OpenAI API's /v1/embeddings, LLM.embed)" if self.embeds else
                             "this engine generates text: embeddings need an engine built with `--task embed`")
        lora_id, lora_key = self.lora.id_of(lora)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this engine has no tokenizer; send prompt token ids")
            # NOTE: refused by size before tokenizing: a prompt of more bytes than max_seq_len tokens can hold has
            # too many tokens whatever they are, and tokenizing megabytes only to refuse them costs seconds of CPU
            limit = self.scheduler.config.max_seq_len * self.tokenizer.max_token_bytes
            if len(prompt) > limit or len(prompt.encode()) > limit:
                raise ValueError(f"prompt: {len(prompt.encode())} bytes cannot fit in the engine's max_seq_len "
                                 f"({self.scheduler.config.max_seq_len} tokens of at most "
                                 f"{self.tokenizer.max_token_bytes} bytes each); shorten it")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if params.beam_width > self.scheduler.config.max_batch_size:
            raise ValueError(f"beam_width {params.beam_width} is more than the engine runs at once (max_batch_size "
                             f"{self.scheduler.config.max_batch_size}); ask for fewer beams")
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, lora_id=lora_id, lora_key=lora_key,
                          beam_group=request_id if params.beam_width > 1 else None)
        self.scheduler.check_fits(request)
        SamplingState(params, prompt_ids, self.eos_token_ids, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        return request

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name now (built in, or loaded into the engine's slots)."""
        return self.lora.names

    def load_lora(self, adapter: LoraAdapter) -> None:
        """Serve an adapter read by `self.lora.prepare` (between steps); LoraLoadError when it cannot."""
        self.lora.release({t.request.lora_id for t in self.tracked.values()})
        self.lora.install(adapter)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (between steps); the requests already under it finish under it."""
        self.lora.unload(name)
        self.lora.release({t.request.lora_id for t in self.tracked.values()})

    def add_request(self, request: Request) -> None:
        if request.request_id in self.tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not self.lora.holds(request.lora_id, request.lora_key):
            raise ValueError(f"lora: the adapter {self.lora.name_of(request.lora_id) or ''!r} was unloaded before "
                             "the request started; send it again naming a loaded one")
        state = self._sampling_state(request)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.sampling) if self.tokenizer else None
        self.scheduler.add_request(request)
        if request.beam_group is not None:
            self.beam_groups[request.request_id] = BeamGroup.start(request, state, self.scheduler.config.max_seq_len)
        scores = None if request.sampling.prompt_logprobs is None else [None] * request.num_prompt_tokens
        self.tracked[request.request_id] = _Tracked(request, state, detok, scores)

    def _sampling_state(self, request: Request) -> SamplingState:
        return SamplingState(request.sampling, request.prompt_ids, self.eos_token_ids, token_ids=request.token_ids,
                             tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return None
        if request_id in self.beam_groups:
            return self._end_beam_search(self.beam_groups[request_id], FinishReason.ABORT)
        self.scheduler.finish_requests([tracked.request], FinishReason.ABORT)
        self._release_drafts()
        return self._final_output(tracked, [], "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ----------------------------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Drafts for each decoding request, as many as its remaining output allows (the step adds one more)."""
        k, max_seq_len = self.config.speculative.num_speculative_tokens, self.scheduler.config.max_seq_len
        decoding, limits = [], []
        for request in self.scheduler.running:
            # NOTE: a request whose drafts were rejected with recurrent layers computes the accepted ones again: its
            # known tokens end after its prompt, at most k + 1 of them
            todo = len(request.token_ids) - request.num_computed_tokens
            if (0 < todo <= k + 1 and request.num_computed_tokens >= request.num_prompt_tokens
                    and request.beam_group is None):
                room = min(request.sampling.max_tokens - request.num_output_tokens,
                           max_seq_len - len(request.token_ids)) - 1
                decoding.append(request)
                limits.append(min(k, room))
        if decoding:
            for request, drafts in zip(decoding, self.proposer.propose_batch(decoding, limits), strict=True):
                self.scheduler.set_draft_tokens(request, drafts)

    def _release_drafts(self) -> None:
        """The proposer forgets requests the scheduler no longer runs (a draft model frees their KV blocks)."""
        if self.proposer is not None:
            self.proposer.release({r.request_id for r in self.scheduler.running})

    def _engine_accept(self, chunk: ScheduledChunk) -> DraftAccept | None:
        """Drafts the engine verifies itself (engine_accept.py), or None: their rows come out for `verify`."""
        if not chunk.num_drafts:
            return None
        state = self.tracked[chunk.request.request_id].sampling
        if not engine_can_verify(state, chunk.num_drafts, self.engine.max_draft_len):
            return None
        return draft_accept(state, chunk.request.spec_token_ids)

    def _score_prompt(self, chunk: ScheduledChunk, rows: np.ndarray) -> None:
        """Logprobs of the prompt tokens that a chunk's prompt rows predict (a row already scored before a preemption
        is scored again, and kept)."""
        scores = self.tracked[chunk.request.request_id].prompt_logprobs
        first = chunk.start + chunk.num_tokens - chunk.num_logits + 1  # the token the first row predicts
        targets = chunk.request.prompt_ids[first : first + len(rows)]
        for position, lp in enumerate(rows_logprobs(rows, targets, chunk.request.sampling.prompt_logprobs), first):
            scores[position] = scores[position] or lp

    def _sample(self, scheduled: SchedulerOutput, output: StepOutput) -> tuple[list[list[int]], dict[str, list]]:
        """New tokens of each chunk that samples (in order), and their logprobs by request id: the engine's accept
        results, one batched draw for the chunks without drafts, verification (speculative.verify) for the others.
        Rows scoring prompt tokens come first in their chunk's rows (_score_prompt)."""
        chunks = scheduled.chunks
        first_row, row = {}, 0
        for i, c in enumerate(chunks):  # rows come out only for chunks the engine did not verify
            if c.num_logits and i not in output.accepted:
                first_row[i], row = row, row + c.num_logits
                if c.num_prompt_logits:
                    self._score_prompt(c, output.logits[first_row[i] : first_row[i] + c.num_prompt_logits])
                first_row[i] += c.num_prompt_logits  # the rows to sample from
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if self.embeds:  # NOTE: an embed engine's rows are final hidden states, a prompt's last is its embedding
            for i in sampling:
                row = output.logits[first_row[i]].astype(np.float32)
                self.tracked[chunks[i].request.request_id].embedding = row / max(float(np.linalg.norm(row)), 1e-12)
            return [[] for _ in sampling], {}
        tokens: dict[int, list[int]] = {}
        logprobs: dict[str, list] = {}
        for i in sampling:  # a beam's row waits in its group for the others' (_advance_beams)
            if (beam := chunks[i].request.request_id) in self.beam_groups:
                self.beam_groups[beam].rows[beam] = output.logits[first_row[i]]
                tokens[i] = []
        plain = [i for i in sampling if not chunks[i].num_drafts and i not in tokens]
        if plain:
            states = [self.tracked[chunks[i].request.request_id].sampling for i in plain]
            rows = [first_row[i] for i in plain]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))  # NOTE: a view, not a copy of [N, V]
            sampled = self.sampler.sample(output.logits[rows[0]:rows[-1] + 1] if contiguous else output.logits[rows],
                                          states)
            for i, token, lp in zip(plain, sampled.token_ids.tolist(), sampled.logprobs, strict=True):
                tokens[i], logprobs[chunks[i].request.request_id] = [token], [lp]
        for i in sampling:
            c = chunks[i]
            if not c.num_drafts:
                continue
            rid, drafts = c.request.request_id, c.request.spec_token_ids
            if i in output.accepted:
                num_accepted, token = output.accepted[i]
                advance(self.tracked[rid].sampling, len(drafts), num_accepted)
                tokens[i] = list(drafts[:num_accepted]) + [token]
                logprobs[rid] = [None] * len(tokens[i])
            else:
                rows = output.logits[first_row[i] : first_row[i] + c.num_logits - c.num_prompt_logits]
                verified = verify(rows, drafts, self.tracked[rid].sampling)
                tokens[i], logprobs[rid] = verified.token_ids, verified.logprobs
        return [tokens[i] for i in sampling], logprobs

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose_drafts()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        chunks = [SequenceChunk(c.request.request_id,
                                (c.request.token_ids + c.request.spec_token_ids)[c.start : c.start + c.num_tokens],
                                c.start, c.num_logits, c.block_ids, self._engine_accept(c), c.group_block_ids,
                                c.request.lora_id, self.kv.state_slot(c.request),
                                # NOTE: the state before its drafts, kept for a rejection (runtime/recurrent_state.py)
                                c.num_tokens - c.num_drafts if c.num_drafts and self.kv.state_slots is not None else 0)
                  for c in scheduled.chunks]
        if copies := self.kv.take_state_copies():
            self.engine.copy_states(copies)
        run_before = self.engine.run_seconds
        tokens, logprobs = self._sample(scheduled, self.engine.execute(chunks))
        outputs = [self._output(self.tracked[request.request_id], new_tokens, logprobs[request.request_id])
                   for request, new_tokens in self.scheduler.update(scheduled, tokens)]
        outputs += self._advance_beams()
        if self.embeds:
            outputs += [self._embedded(c.request) for c in scheduled.chunks if c.samples]
        self._release_drafts()
        self.last_stats = StepStats(len(self.scheduler.running), len(self.scheduler.waiting), scheduled.num_tokens,
                                    len(scheduled.preempted), self.kv.pool.usage, time.perf_counter() - start,
                                    num_draft_tokens=sum(c.num_drafts for c in scheduled.chunks),
                                    num_accepted_draft_tokens=sum(len(t) - 1 for t in tokens),  # 1 token + accepted
                                    engine_seconds=self.engine.run_seconds - run_before)
        return outputs

    def _embedded(self, request: Request) -> RequestOutput:
        """The answer of a request to an embed engine: its prompt's embedding, once its prompt is computed."""
        self.scheduler.finish_requests([request], FinishReason.STOP)
        tracked = self.tracked.pop(request.request_id)
        return RequestOutput(request.request_id, [], "", True, FinishReason.STOP.value, [], request.num_prompt_tokens,
                             0, request.metrics, embedding=tracked.embedding)

    # ---- beam search (runtime/beam_search.py) --------------------------------------------------------------------
    def _advance_beams(self) -> list[RequestOutput]:
        """A round of every beam search whose live beams all have their rows; the final output of those it ends."""
        outputs = []
        for group in list(dict.fromkeys(self.beam_groups.values())):
            if not group.ready:
                continue
            step = group.select()
            for parent, child_id, token in step.forks:  # NOTE: before the parents take their own next tokens
                child, copies = self.scheduler.fork_beam(group.beams[parent], child_id, token)
                self.engine.kv.copy_blocks(copies)
                group.add(child, self._sampling_state(child), group.cum[child_id])
                self.beam_groups[child_id] = group
            for beam, token in step.extended:
                self.scheduler.extend_beam(group.beams[beam], token)
            self._drop_beams(group, step.dropped)
            if step.done:
                outputs.append(self._end_beam_search(group, FinishReason.STOP))
        return outputs

    def _drop_beams(self, group: BeamGroup, beam_ids: list[str]) -> None:
        self.scheduler.finish_requests(group.drop(beam_ids), FinishReason.STOP)
        for b in beam_ids:
            del self.beam_groups[b]

    def _end_beam_search(self, group: BeamGroup, reason: FinishReason) -> RequestOutput:
        """Finish every beam of the group; the client's output: the best answer, and every answer in `beams`."""
        self._drop_beams(group, [b.request_id for b in group.live()])
        tracked = self.tracked.pop(group.root)
        self.scheduler.end_beam_search(tracked.request)
        skip = tracked.request.sampling.skip_special_tokens

        def decode(tokens: tuple[int, ...]) -> str:  # an ending token's text is not the answer's, as without beams
            kept = tokens[:-1] if tokens and tokens[-1] in group.ending_ids else tokens
            return self.tokenizer.decode(kept, skip_special_tokens=skip)

        beams = group.answers(decode if self.tokenizer else None)
        best = beams[0] if beams and reason != FinishReason.ABORT else None
        return RequestOutput(group.root, list(best.token_ids) if best else [], best.text if best else "", True,
                             (best.finish_reason if best else reason).value, [], tracked.request.num_prompt_tokens,
                             len(best.token_ids) if best else 0, tracked.request.metrics, beams=beams)

    def _output(self, tracked: _Tracked, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """The delta for the tokens a step appended to the request (several when drafts were accepted)."""
        request = tracked.request
        text = ""
        for n, token in enumerate(tokens, start=1):
            stopped_by_token = n == len(tokens) and request.finish_reason == FinishReason.STOP and (
                token in request.sampling.stop_token_ids or token in request.eos_token_ids)
            if tracked.detokenizer is None or stopped_by_token:
                continue
            text += tracked.detokenizer.add(token)
            if tracked.detokenizer.finished_by_stop is not None:
                # NOTE: the text is cut at the stop string, so the reason is "stop" even when this very token also
                # reached max_tokens (update() already finished the request with "length"), as vLLM reports it.
                # Tokens after it (accepted drafts) are not part of the output.
                self.scheduler.finish_requests([request], FinishReason.STOP,
                                               truncate_to=request.num_output_tokens - (len(tokens) - n))
                tokens = tokens[:n]
                break
        new_logprobs = [lp for lp in logprobs[: len(tokens)] if lp is not None]
        prompt_logprobs, tracked.prompt_logprobs = tracked.prompt_logprobs, None
        if request.finished:
            return self._final_output(tracked, tokens, text, new_logprobs, prompt_logprobs)
        return RequestOutput(request.request_id, tokens, text, False, None, new_logprobs,
                             request.num_prompt_tokens, request.num_output_tokens, prompt_logprobs=prompt_logprobs)

    def _final_output(self, tracked: _Tracked, tokens: list[int], text: str, logprobs: list,
                      prompt_logprobs: list[TokenLogprobs | None] | None = None) -> RequestOutput:
        request = tracked.request
        if tracked.detokenizer is not None and tracked.detokenizer.finished_by_stop is None:
            text += tracked.detokenizer.flush()
        del self.tracked[request.request_id]
        return RequestOutput(request.request_id, tokens, text, True, request.finish_reason.value, logprobs,
                             request.num_prompt_tokens, request.num_output_tokens, request.metrics, prompt_logprobs)
