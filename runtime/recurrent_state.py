"""The states of recurrent layers (Qwen3.5's gated DeltaNet, plugins/gated_delta.py; Granite 4.0-H's Mamba2,
plugins/mamba2.py): one slot per live sequence, holding that sequence's state in every such layer after its computed
tokens.

Unlike K/V, a recurrent state is not a row per token: it is one matrix per head that every token rewrites. So
it cannot be shared between sequences or rolled back, and it is kept apart from the paged pool: the KV cache manager
gives a request a slot with its first blocks and takes it back with them (runtime/kv_cache_manager.py). What follows:
a preempted request recomputes (its slot is freed), a prefix cannot be reused (the state after it is not kept), a
beam's fork recomputes its tokens, and drafts cannot be verified (the state would have to return to the last
accepted token). The engine's GatedDeltaNet / Mamba2Scan nodes read and overwrite their sequences' slots in place;
a sequence without a past starts from zero, whatever its slot held before.
"""

from __future__ import annotations

import numpy as np

from trtbuild.configs import ModelConfig


class RecurrentStateStorage:
    """states[slot, recurrent layer, value head, key dim, value dim] float32 (the engine's `recurrent_state`)."""

    def __init__(self, model: ModelConfig, num_slots: int) -> None:
        # NOTE: np.zeros maps its pages lazily: slots no sequence has used take no memory
        self.states = np.zeros((num_slots, len(model.recurrent_layers), *model.recurrent_state_shape),
                               dtype=np.float32)

    @property
    def num_slots(self) -> int:
        return self.states.shape[0]


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
