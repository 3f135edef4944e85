"""The LoRA adapters a running engine serves, by name: built in (fixed when it was built, builder/lora.py) or
loaded into its slots while it runs (builder/lora_slots.py), as vLLM's /v1/load_lora_adapter loads them.

A request names an adapter; the engine's `lora_ids` count them from 1 (0: the base model). A slot engine's id
is its slot + 1, and a slot is reused by the next adapter loaded after an unload. So each load gets a `key` of
its own: the prefix cache chains a request's blocks from it (a reused slot never matches the K/V of the adapter
before), and a request made before an unload is refused when it reaches the engine, not run under the next one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trtbuild.builder.lora_slots import SLOTS_METADATA, SlotTable, engine_rows, parse_slot_tables, write_slot
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.configs.build_config import NO_LORA_ADAPTERS, unknown_lora
from trtbuild.errors import EngineCompatibilityError, TrtbuildError

if TYPE_CHECKING:
    from trtbuild.builder.engine_dir import EngineInfo
    from trtbuild.builder.lora import LoraAdapter

NO_SLOTS = ("it was built without LoRA slots: its adapters are built in (`trtbuild build --lora NAME=PATH`); "
            "build it with `--max-loras N --max-lora-rank R` to load adapters while it runs")

NONE_LOADED = "it has none loaded (POST /v1/load_lora_adapter, `trtbuild serve --lora-modules NAME=PATH`)"


class LoraLoadError(TrtbuildError):
    """An adapter that cannot be loaded or unloaded (the request's fault: what to do is in the message)."""


class LoraSlotArrays:
    """A slot engine's LoRA tables as the runtime holds them: zero-initialized float32 arrays, fed to every
    engine call in place (ONNX Runtime reads a contiguous numpy input without copying it)."""

    def __init__(self, tables: list[SlotTable], shapes: dict[str, list[int]], build: BuildConfig) -> None:
        self.tables, self.rank, self.num_slots = tables, build.max_lora_rank, build.max_loras
        self.arrays = {name: np.zeros(shapes[name], np.float32) for t in tables for name in (t.a, t.b)}

    @classmethod
    def of(cls, session: Any, info: EngineInfo) -> LoraSlotArrays | None:
        """The tables of an ONNX Runtime session over a slot engine; None for an engine without slots."""
        if not info.build.max_loras:
            return None
        meta = session.get_modelmeta().custom_metadata_map.get(SLOTS_METADATA)
        if meta is None:
            raise EngineCompatibilityError(f"{info.path} was built with LoRA slots but its engine file does not say "
                                           "where they are; rebuild the engine.")
        shapes = {i.name: i.shape for i in session.get_inputs()}
        return cls(parse_slot_tables(meta), shapes, info.build)

    def write(self, slot: int, weights: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Put an adapter's weights (builder/lora_slots.py: engine_rows) in `slot` (0-based); {} empties it."""
        write_slot(self.arrays, self.tables, slot, self.rank, weights)


@dataclass
class _Slot:
    name: str
    key: int
    draining: bool = False  # unloaded: no new request may name it; freed once no request runs under it


class LoraAdapters:
    """Names <-> lora ids of the adapters an engine serves. Invariants: a live name is in exactly one slot; a
    draining slot has no name a request can ask for, and holds its weights until `release` sees it unused; every
    load has a key no other load had. Loads, unloads and releases run between engine steps (the engine loop's
    thread); `prepare` and the lookups are safe from any thread."""

    def __init__(self, build: BuildConfig, model: ModelConfig, arrays: LoraSlotArrays | None) -> None:
        self.model, self.arrays = model, arrays
        self.slots: list[_Slot | None] = ([None] * arrays.num_slots if arrays is not None else
                                          [_Slot(n, i + 1) for i, n in enumerate(build.lora_names)])
        self._keys = itertools.count(len(self.slots) + 1)

    @property
    def dynamic(self) -> bool:
        return self.arrays is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters a request may name now."""
        return tuple(s.name for s in self.slots if s is not None and not s.draining)

    @property
    def max_loras(self) -> int:
        return len(self.slots)

    def id_of(self, name: str | None) -> tuple[int, int]:
        """(lora id, key) of adapter `name` (0, 0: None, the base model); ValueError for a name it lacks."""
        if name is None:
            return 0, 0
        for i, slot in enumerate(list(self.slots)):  # NOTE: a copy: the loop thread may change a slot meanwhile
            if slot is not None and not slot.draining and slot.name == name:
                return i + 1, slot.key
        raise unknown_lora(self.names, name, none=NONE_LOADED if self.dynamic else NO_LORA_ADAPTERS)

    def name_of(self, lora_id: int) -> str | None:
        """The adapter in slot `lora_id` - 1 (draining ones included; None: the base model or an empty slot)."""
        slot = self.slots[lora_id - 1] if 0 < lora_id <= len(self.slots) else None
        return None if slot is None else slot.name

    def holds(self, lora_id: int, key: int) -> bool:
        """Whether `lora_id` still runs the load `key` that a request was made under (no unload since)."""
        if lora_id == 0:
            return True
        slot = self.slots[lora_id - 1]
        return slot is not None and slot.key == key and not slot.draining

    # ---- loading (slot engines) --------------------------------------------------------------------------------
    def prepare(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check the adapter at `path` for this engine (any thread: disk reads, no engine state)."""
        from trtbuild.builder.lora import LoraError, read_adapter

        self._require_slots("load")
        try:
            adapter = read_adapter(name, Path(path), self.model)
        except LoraError as e:
            raise LoraLoadError(e.message) from None
        if adapter.rank > self.arrays.rank:
            raise LoraLoadError(f"LoRA adapter {name!r} has rank {adapter.rank}, above the engine's max_lora_rank "
                                f"{self.arrays.rank}; rebuild it with `--max-lora-rank {adapter.rank}` or more.")
        return adapter

    def install(self, adapter: LoraAdapter) -> int:
        """Put a prepared adapter in a free slot (between engine steps); returns its lora id."""
        self._require_slots("load")
        if any(s is not None and s.name == adapter.name for s in self.slots):
            raise LoraLoadError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload it first "
                                "(POST /v1/unload_lora_adapter) or choose another name.")
        free = next((i for i, s in enumerate(self.slots) if s is None), None)
        if free is None:
            finishing = " and adapters still finishing their requests" if len(self.names) < len(self.slots) else ""
            raise LoraLoadError(f"all {len(self.slots)} LoRA slots hold adapters ({', '.join(self.names)}"
                                f"{finishing}); unload one, or rebuild the engine with a larger `--max-loras`.")
        self.arrays.write(free, engine_rows(adapter, self.model))
        self.slots[free] = _Slot(adapter.name, next(self._keys))
        return free + 1

    def unload(self, name: str) -> None:
        """Stop serving `name` (between engine steps): new requests cannot name it; its slot is freed by `release`
        once the requests already under it have finished."""
        self._require_slots("unload")
        slot = next((s for s in self.slots if s is not None and s.name == name and not s.draining), None)
        if slot is None:
            raise LoraLoadError(f"no LoRA adapter {name!r} is loaded; loaded: {', '.join(self.names) or 'none'}.")
        slot.draining = True

    def release(self, in_use: set[int]) -> None:
        """Free the draining slots that no unfinished request (lora ids `in_use`) runs under."""
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.draining and i + 1 not in in_use:
                self.arrays.write(i, {})
                self.slots[i] = None

    def _require_slots(self, what: str) -> None:
        if not self.dynamic:
            raise LoraLoadError(f"this engine cannot {what} LoRA adapters: {NO_SLOTS}.")
