"""Draft-target speculative decoding: a smaller engine with the same tokenizer drafts greedily for the target.

The draft engine keeps its own paged KV pool, managed by a second `KVCacheManager` (the same block-manager code as
the target's, so prefix reuse works there too). Per request the proposer tracks `_DraftSeq`: how many of the
request's tokens the draft has in its cache (`num_computed_tokens`, a prefix of `token_ids`) and which drafts it fed
after them (`fed_drafts`, speculative). Each round:
1. sync: the drafts the target accepted are tokens whose K/V the draft already holds, so the computed count moves past
   them; K/V of rejected drafts lie past it and are overwritten later. Requests the target no longer runs
   (finished, aborted, preempted) free their draft blocks (`release`).
2. K batched draft steps: step 0 feeds every request's uncomputed tokens (catch-up: a prompt, the accepted and bonus
   tokens) and takes the argmax of its last row; steps 1..K-1 feed one draft per request. Requests that want fewer
   drafts leave the batch early.

Adaptive K (per request): drafts = clamp(round(K * ema) + 1, 1, K) (halves round up), where ema is an exponential
moving average (weight EMA_WEIGHT on the newest step) of the fraction of a step's drafts that the target accepted,
starting at 1.
A request whose drafts keep being rejected drafts one token per step (from ema < 1 / (2K)); one that keeps agreeing
drafts K. NOTE: not ceil(K * ema) + 1: an average that only approaches 0 would never get below 2 drafts.

A draft model with recurrent layers (a Qwen3.5 drafting for a larger one) cannot drop the drafts it fed from its
state: its catch-up step also keeps the state before the newest token in the request's draft checkpoint
(runtime/recurrent_state.py), and the next round restores it and feeds every token after it again, the drafts the
target accepted among them.

Greedy drafts are a deterministic q (one-hot), which `speculative.verify` assumes for both greedy and sampled
targets, so outputs keep the target's distribution whatever the draft model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trtbuild.builder.engine_dir import EngineInfo, read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.recurrent_state import DRAFT_CHECKPOINT, StateCopy
from trtbuild.runtime.request import Request
from trtbuild.runtime.speculative import Proposer, SpeculativeConfig

EMA_WEIGHT = 0.5  # weight of the newest step's acceptance rate in a request's average


@dataclass
class _DraftSeq:
    """A request as the draft's KV manager sees it (the fields KVCacheManager reads): its confirmed tokens (the
    request's own list, read only), the draft's computed count, hashes of its full blocks."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    lora_id: int = 0  # the draft engine runs the base model: its drafts are verified under the request's adapter
    fed_drafts: list[int] = field(default_factory=list)  # drafts whose K/V follow the computed tokens
    acceptance: float = 1.0  # EMA of accepted / drafted per verified step
    seen_drafted: int = 0  # the request's metrics when last synced
    seen_accepted: int = 0
    kept_state: int = 0  # recurrent drafts: tokens after which its draft checkpoint holds the state (0: none)


def check_same_tokenizer(target: EngineInfo, draft: EngineInfo) -> None:
    """Refuse a draft engine whose tokens mean something else than the target's (tokenizer.json, vocab, eos)."""
    problems = []
    if target.model.vocab_size != draft.model.vocab_size:
        problems.append(f"vocab size {draft.model.vocab_size} vs {target.model.vocab_size}")
    if tuple(target.model.eos_token_ids) != tuple(draft.model.eos_token_ids):
        problems.append(f"eos token ids {list(draft.model.eos_token_ids)} vs {list(target.model.eos_token_ids)}")
    vocabs = [_token_ids(e.path / "tokenizer.json") for e in (target, draft)]
    if vocabs[0] != vocabs[1]:
        problems.append("tokenizer.json maps tokens to other ids" if all(vocabs) else "only one has a tokenizer.json")
    if problems:
        raise ConfigError("draft_engine_dir", f"{draft.path} cannot draft for {target.path}: their tokenizers differ "
                                              f"({'; '.join(problems)}); use a draft model with the target's tokenizer")


def _token_ids(path: Path) -> tuple | None:
    """What a token id means in a tokenizer.json: its vocabulary and added tokens. NOTE: not the file's bytes: the
    tokenizer that `convert` rebuilds from a GGUF file spells its merges otherwise than the HF folder's file, and
    merges decide how text splits, not what an id is."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        added = sorted((t["id"], t["content"]) for t in data.get("added_tokens") or ())
        return data["model"].get("type"), data["model"].get("vocab"), added
    except (ValueError, KeyError, TypeError, AttributeError):
        return (path.read_bytes(),)


def adaptive_num_drafts(max_drafts: int, acceptance: float) -> int:
    """round(K * acceptance) + 1, within 1..K (see the module docstring)."""
    return max(1, min(max_drafts, math.floor(max_drafts * acceptance + 0.5) + 1))


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, target: EngineInfo, num_threads: int | None, kv_tokens: int
                 ) -> None:
        """`kv_tokens`: tokens the draft's KV pool holds (NOTE: beside the target's KV budget; the draft's bytes per
        token are its layers' share)."""
        draft = read_engine_config(Path(config.draft_engine_dir), expect_target="cpu")
        check_same_tokenizer(target, draft)
        num_blocks = -(-kv_tokens // draft.build.tokens_per_block)
        # NOTE: its threads do not spin between calls: spinning draft threads took the cores from the target's
        # calls (SmolLM2 batch 1 on 2 cores: the target's engine time 1.8x, the whole run 40% slower)
        self.engine = CpuEngine(draft, num_threads=num_threads, num_blocks=num_blocks, spinning=False)
        self.recurrent = bool(draft.model.recurrent_layers)
        if self.recurrent:
            if not self.engine.can_checkpoint_states:
                raise ConfigError("draft_engine_dir", f"{draft.path} was built before its recurrent layers could keep "
                                                      "their state part-way, which drafting needs; rebuild it")
            self.engine.allocate_draft_checkpoints()
        self.kv = KVCacheManager.for_groups(draft.kv_cache_groups, num_blocks, draft.build.tokens_per_block,
                                            num_state_slots=draft.build.max_batch_size if self.recurrent else 0)
        self.max_drafts = config.num_speculative_tokens
        self.seqs: dict[str, _DraftSeq] = {}
        self.num_steps = 0  # draft engine steps run (each may be several engine calls)
        self.num_prefix_cached_tokens = 0  # tokens the draft took from its prefix cache instead of computing

    @property
    def max_seq_len(self) -> int:
        return self.engine.info.build.max_seq_len

    def warm_up(self, max_batch_size: int, max_num_tokens: int) -> None:
        """The draft pool faulted in and one step of the largest batch it will run, as the target's warm-up."""
        build = self.engine.info.build
        self.engine.kv.reserve()
        self.engine.warm_up(min(max_batch_size, build.max_batch_size), min(max_num_tokens, build.max_num_tokens))

    def release(self, live_request_ids: Collection[str]) -> None:
        for rid in [rid for rid in self.seqs if rid not in live_request_ids]:
            self.kv.free(self.seqs.pop(rid))

    def _synced(self, request: Request) -> _DraftSeq:
        """The request's draft state, caught up with what the target decided since the last round."""
        seq = self.seqs.get(request.request_id)
        if seq is None:
            seq = self.seqs[request.request_id] = _DraftSeq(request.request_id, request.token_ids)
            seq.seen_drafted = request.metrics.num_draft_tokens
            seq.seen_accepted = request.metrics.num_accepted_draft_tokens
        tokens, n = request.token_ids, seq.num_computed_tokens
        accepted = 0
        while accepted < len(seq.fed_drafts) and n + accepted < len(tokens) \
                and tokens[n + accepted] == seq.fed_drafts[accepted]:
            accepted += 1
        if self.recurrent and seq.kept_state:  # back to the state before the newest token of the last catch-up
            self.engine.copy_states([StateCopy(self.kv.state_slot(seq), DRAFT_CHECKPOINT, save=False)])
            n, accepted = seq.kept_state, 0
        seq.fed_drafts = []
        # NOTE: the newest token is always fed again so its row gives the next draft (its K/V is rewritten as is).
        seq.num_computed_tokens = min(n + accepted, len(tokens) - 1)
        drafted = request.metrics.num_draft_tokens - seq.seen_drafted
        if drafted:
            rate = (request.metrics.num_accepted_draft_tokens - seq.seen_accepted) / drafted
            seq.acceptance = (1 - EMA_WEIGHT) * seq.acceptance + EMA_WEIGHT * rate
        seq.seen_drafted = request.metrics.num_draft_tokens
        seq.seen_accepted = request.metrics.num_accepted_draft_tokens
        return seq

    def propose_batch(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """Up to max_tokens[i] greedy drafts for each request, from K batched draft steps."""
        drafts: list[list[int]] = [[] for _ in requests]
        want, seqs = [], []
        for request, limit in zip(requests, max_tokens, strict=True):
            seq = self._synced(request)
            if seq.num_computed_tokens == 0 and not self.kv.block_table(seq):  # new here: reuse cached blocks
                prefix = self.kv.computed_prefix(seq)
                if prefix and self.kv.allocate(seq, len(prefix) * self.kv.block_size, prefix):
                    seq.num_computed_tokens = len(prefix) * self.kv.block_size
                    self.num_prefix_cached_tokens += seq.num_computed_tokens
            seqs.append(seq)
            want.append(min(limit, adaptive_num_drafts(self.max_drafts, seq.acceptance),
                            self.max_seq_len - len(request.token_ids)))
        active = [i for i, n in enumerate(want) if n > 0]
        while active:
            feeds = {}
            for i in active:
                seq = seqs[i]
                known = seq.token_ids + drafts[i]
                start = seq.num_computed_tokens + len(seq.fed_drafts)
                if self.kv.allocate(seq, len(known)):  # else the draft pool is full: this request stops drafting
                    feeds[i] = (start, known[start:])
            if not feeds:
                break
            for i, row in self._run(seqs, feeds).items():
                seq, (start, tokens) = seqs[i], feeds[i]
                # the fed tokens that are the request's own come first (only while no draft was fed yet)
                confirmed = min(max(len(seq.token_ids) - start, 0), len(tokens))
                if confirmed:
                    seq.num_computed_tokens = start + confirmed
                seq.fed_drafts.extend(tokens[confirmed:])
                drafts[i].append(int(np.argmax(row)))
            for i in feeds:
                self.kv.cache_full_blocks(seqs[i])
                self.kv.release_outside_window(seqs[i])
            active = [i for i in feeds if len(drafts[i]) < want[i]]
        return drafts

    def _keep_state(self, seq: _DraftSeq, start: int, num_tokens: int) -> int:
        """Recurrent drafts: how many of a piece's tokens [start, start + num_tokens) come before the request's
        newest confirmed token, when the state there is to be kept (runtime/recurrent_state.py); else 0."""
        keep = len(seq.token_ids) - 1
        if not self.recurrent or not start < keep <= start + num_tokens:
            return 0
        seq.kept_state = keep
        return keep - start

    def _run(self, seqs: list[_DraftSeq], feeds: dict[int, tuple[int, list[int]]]) -> dict[int, np.ndarray]:
        """One draft step: each request's fed tokens, packed into engine calls within the draft engine's limits (a
        long catch-up is split, its earlier pieces without logits); the last logits row of each request."""
        build = self.engine.info.build
        self.num_steps += 1
        rows: dict[int, np.ndarray] = {}
        batch: list[tuple[int, SequenceChunk]] = []
        used = 0

        def flush() -> None:
            nonlocal batch, used
            if batch:
                logits = self.engine.step([c for _, c in batch])
                with_rows = [i for i, c in batch if c.num_logits]
                rows.update(zip(with_rows, logits, strict=True))
            batch, used = [], 0

        for i, (start, tokens) in feeds.items():
            block_ids, *others = self.kv.block_tables(seqs[i])
            done = 0
            while done < len(tokens):
                if used == build.max_num_tokens or len(batch) == build.max_batch_size:
                    flush()
                take = min(len(tokens) - done, build.max_num_tokens - used)
                last = done + take == len(tokens)
                batch.append((i, SequenceChunk(seqs[i].request_id, tokens[done : done + take], start + done,
                                               int(last), block_ids, group_block_ids=tuple(others),
                                               state_slot=self.kv.state_slot(seqs[i]),
                                               state_checkpoint=self._keep_state(seqs[i], start + done, take))))
                used += take
                done += take
                if not last:
                    flush()  # NOTE: the next piece attends to this one's K/V, written when its call returns
        flush()
        return rows
