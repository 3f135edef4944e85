"""The states of recurrent layers (Qwen3.5's gated DeltaNet, plugins/gated_delta.py; Granite 4.0-H's Mamba2,
plugins/mamba2.py): one slot per live sequence, holding that sequence's state in every such layer after its computed
tokens, and snapshots of states kept after full blocks for prefix reuse.

Unlike K/V, a recurrent state is not a row per token: it is one matrix per head that every token rewrites. So it
cannot be shared between sequences or rolled back token by token, and it is kept apart from the paged pool: the KV
cache manager gives a request a slot with its first blocks and takes it back with them (runtime/kv_cache_manager.py).
What follows: a preempted request recomputes (its slot is freed) and a beam's fork recomputes its tokens. The
engine's GatedDeltaNet / Mamba2Scan nodes read and overwrite their sequences' slots in place; a sequence without a
past starts from zero, whatever its slot held before.

Speculative drafts are verified against a draft checkpoint: a step whose chunk ends in drafts also writes the
state after the chunk's known tokens (before its drafts) into the slot's checkpoint (the nodes' state_checkpoints
input; a second row per slot, allocated only for speculative decoding). When the target rejects a draft, the
checkpoint is copied back into the slot (`StateCopy` from DRAFT_CHECKPOINT) and the accepted drafts are computed
again at the head of the request's next chunk, beside its next drafts; when it accepts them all, the slot is
already right. So a rejection costs a copy of the state and a few more tokens in the next step, not a step.

A prefix is reused through snapshots (as llama.cpp's server keeps context checkpoints): the state after a request's
last full block of known tokens is copied out of its slot (`StateCopy`, save) after the step that computed it, and a
later request whose leading blocks are cached up to such a block copies it into its own slot (restore) instead of
computing them. A request whose leading blocks are cached beyond any kept state (a system prompt other requests
sent) also keeps the state where it leaves them, for the requests after it. Snapshots live beside the running
slots, never read by the engine's nodes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtbuild.configs import ModelConfig
from trtbuild.runtime.memory import DEFAULT_FRACTION, available_memory_bytes, require_memory

log = logging.getLogger(__name__)


DRAFT_CHECKPOINT = -1  # StateCopy.snapshot of a rollback: the slot's draft checkpoint


@dataclass(frozen=True)
class StateCopy:
    """A state moved between a running sequence's slot and a snapshot: saved (slot -> snapshot) after the step that
    computed the snapshot's prefix, or restored (snapshot -> slot) before a request that reuses the prefix runs; or
    restored from the slot's draft checkpoint (snapshot DRAFT_CHECKPOINT) after a step whose drafts were rejected.
    Copies apply in the order they were made, all before the next step."""

    slot: int
    snapshot: int
    save: bool


def checkpoint_feed(state_slots: Sequence[int], keep_after: Sequence[int], first_checkpoint: int) -> np.ndarray:
    """The recurrent nodes' state_checkpoints [B, 2] of a step: (n, first_checkpoint + slot) for a sequence whose
    state is kept after its first n new tokens (`keep_after`, 0: not kept), (0, -1) for the others."""
    rows = [(n, first_checkpoint + slot) if n else (0, -1) for slot, n in zip(state_slots, keep_after, strict=True)]
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


def state_bytes(model: ModelConfig) -> int:
    """Bytes of one sequence's states, every recurrent layer's (float32)."""
    return 4 * len(model.recurrent_layers) * int(np.prod(model.recurrent_state_shape))


def default_snapshots(model: ModelConfig, running: int, available: int) -> int:
    """States kept unless asked: two per running sequence (after its prompt and its answer) and 8 more (finished
    conversations' next turns, shared system prompts), within DEFAULT_FRACTION of `available` memory bytes."""
    return max(1, min(2 * running + 8, int(DEFAULT_FRACTION * available) // state_bytes(model)))


def allocate_snapshots(engine: Any, model: ModelConfig, running: int, asked: int | None,
                       gpu_memory: int | None = None, draft_checkpoints: bool = False) -> int:
    """Give `engine` (CpuEngine, CudaEngine) room for the states it keeps (RuntimeConfig.max_state_snapshots, or
    default_snapshots of the free `gpu_memory` bytes where they live on a GPU, else of host memory) beside its
    `running` slots, and a draft checkpoint per slot for speculative decoding; returns the number of snapshots. In
    host memory, where all of them are resident only once written, a number that memory cannot hold is refused now,
    rather than the server being killed when requests fill them."""
    available = available_memory_bytes() if gpu_memory is None else gpu_memory
    snapshots = default_snapshots(model, running, available) if asked is None else asked
    if not snapshots:
        log.info("prefix caching is off: %s's recurrent layers need a kept state to reuse a prefix, and "
                 "--max-state-snapshots is 0 (or --no-prefix-caching)", model.architecture)
    slots = 2 * running if draft_checkpoints else running
    if gpu_memory is None:
        require_memory((slots + snapshots) * state_bytes(model),
                       f"{model.architecture}'s recurrent states ({running} running sequences'"
                       f"{', their draft checkpoints' if draft_checkpoints else ''} and {snapshots} kept for prefix "
                       "reuse)",
                       "lower --max-state-snapshots, or rebuild the engine with a smaller --max-batch-size.")
    if draft_checkpoints:
        engine.allocate_draft_checkpoints()
    engine.allocate_state_snapshots(snapshots)
    return snapshots


class RecurrentStateStorage:
    """states[slot, recurrent layer, value head, key dim, value dim] float32 (the engine's `recurrent_state`): the
    running slots, then (with draft checkpoints) slot s's checkpoint at num_slots + s; and snapshots of the same shape
    (no slot of the engine's)."""

    def __init__(self, model: ModelConfig, num_slots: int) -> None:
        # NOTE: np.zeros maps its pages lazily: slots (and snapshots) no sequence has used take no memory
        self.num_slots = num_slots
        self.states = np.zeros((num_slots, len(model.recurrent_layers), *model.recurrent_state_shape),
                               dtype=np.float32)
        self.snapshots = self.states[:0]

    @property
    def has_checkpoints(self) -> bool:
        return self.states.shape[0] > self.num_slots

    def allocate_checkpoints(self) -> None:
        """A draft checkpoint per slot, after the slots (speculative decoding; empty slots' states are dropped)."""
        self.states = np.zeros((2 * self.num_slots, *self.states.shape[1:]), dtype=np.float32)

    def checkpoint_feed(self, chunks: Sequence[Any]) -> np.ndarray:
        """The state_checkpoints input of a step's chunks (runtime/engine.py's SequenceChunk)."""
        if not self.has_checkpoints and any(c.state_checkpoint for c in chunks):
            raise ValueError("a chunk keeps its state for drafts, but the engine has no draft checkpoints "
                             "(allocate_draft_checkpoints)")
        return checkpoint_feed([c.state_slot for c in chunks], [c.state_checkpoint for c in chunks], self.num_slots)

    def allocate_snapshots(self, num_snapshots: int) -> None:
        self.snapshots = np.zeros((num_snapshots, *self.states.shape[1:]), dtype=np.float32)

    def copy(self, copies: Sequence[StateCopy]) -> None:
        for c in copies:
            if c.snapshot == DRAFT_CHECKPOINT:
                self.states[c.slot] = self.states[self.num_slots + c.slot]
            elif c.save:
                self.snapshots[c.snapshot] = self.states[c.slot]
            else:
                self.states[c.slot] = self.snapshots[c.snapshot]


class StateSlots:
    """Which request holds which slot; slots are taken lowest first."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots))
        self.held: dict[str, int] = {}

    def take(self, request_id: str) -> bool:
        """Give `request_id` a slot unless it holds one; False when none is free."""
        if request_id in self.held:
            return True
        if not self.free:
            return False
        self.held[request_id] = self.free.pop(0)
        return True

    def release(self, request_id: str) -> None:
        if (slot := self.held.pop(request_id, None)) is not None:
            self.free.insert(np.searchsorted(self.free, slot), slot)

    def slot(self, request_id: str) -> int:
        """The request's slot, -1 when it holds none."""
        return self.held.get(request_id, -1)


class StateSnapshots:
    """Which snapshot holds the state after which prefix: by the chained hash of the prefix's last full block
    (runtime/block_pool.py), least recently used first. Invariant: every snapshot is free or holds one prefix."""

    def __init__(self, num_snapshots: int) -> None:
        self.free = list(range(num_snapshots))
        self.kept: OrderedDict[int, int] = OrderedDict()  # prefix hash -> snapshot

    def __contains__(self, prefix_hash: int) -> bool:
        return prefix_hash in self.kept

    def find(self, prefix_hash: int) -> int:
        """The snapshot of the state after the prefix (now the most recently used), -1 when none is kept."""
        if prefix_hash not in self.kept:
            return -1
        self.kept.move_to_end(prefix_hash)
        return self.kept[prefix_hash]

    def keep(self, prefix_hash: int) -> int | None:
        """A snapshot to save the state after the prefix into: a free one, else the least recently used one's; None
        when that prefix's state is kept already."""
        if prefix_hash in self.kept:
            self.kept.move_to_end(prefix_hash)
            return None
        if not self.free:
            _, evicted = self.kept.popitem(last=False)
            self.free.append(evicted)
        snapshot = self.free.pop(0)
        self.kept[prefix_hash] = snapshot
        return snapshot

    def drop(self, prefix_hash: int) -> None:
        if (snapshot := self.kept.pop(prefix_hash, None)) is not None:
            self.free.append(snapshot)

    def clear(self) -> None:
        self.free.extend(self.kept.values())
        self.kept.clear()
