"""LoRA slots: an engine built with room for adapters that it loads and unloads while it runs (vLLM's
`--max-loras` / `--max-lora-rank`, TensorRT-LLM's LoRA cache), instead of adapters built in (builder/lora.py).

The network is the built-in one over `max_loras` adapters of rank `max_lora_rank` adapting every linear of every
layer, but each table is an engine input instead of a weight: the runtime holds the tables (zero at start, zero
again for an empty slot) and writes an adapter into slot s when it is loaded. Slot s owns columns s R .. s R + R of
every table (R: max_lora_rank); an adapter of a lower rank leaves the rest zero. The tables come in two layouts,
named in the engine file's metadata (SLOTS_METADATA) so that the runtime needs nothing else to write them:

    stacked  (the network's form, builder/network.py):  a [in, S R],  b [S R, out]           one linear
    packed   (trtbuild::LoraAdd, builder/native_lora.py): A [S, C R, K], Bt [S, R, N]        C fused siblings

NOTE: float32 tables, whatever the base weights: exact for any adapter, and one layout for both forms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from trtbuild.configs import ModelConfig

if TYPE_CHECKING:  # NOTE: the runtime reads and writes slot tables without torch or onnx
    import onnx

    from trtbuild.builder.lora import LoraAdapter, LoraTables

SLOTS_METADATA = "trtbuild.lora_slots"
STACKED, PACKED = "stacked", "packed"


@dataclass(frozen=True)
class SlotTable:
    """One pair of engine inputs holding every slot's weights for one linear (stacked) or fused siblings (packed)."""

    a: str
    b: str
    layout: str  # STACKED or PACKED
    linears: tuple[str, ...]  # checkpoint prefixes (`transformer.layers.0.attention.q`), in the table's order
    splits: tuple[int, ...]  # each linear's output columns


def stacked_tables(tables: LoraTables) -> list[SlotTable]:
    return [SlotTable(f"{p}.lora_a", f"{p}.lora_b", STACKED, (p,), (tables.shape(p)[0],)) for p in tables.prefixes]


def read_slot_tables(model: onnx.ModelProto) -> list[SlotTable]:
    entry = next((e.value for e in model.metadata_props if e.key == SLOTS_METADATA), None)
    return [] if entry is None else parse_slot_tables(entry)


def parse_slot_tables(value: str) -> list[SlotTable]:
    return [SlotTable(t["a"], t["b"], t["layout"], tuple(t["linears"]), tuple(t["splits"])) for t in json.loads(value)]


def write_slot_tables(model: onnx.ModelProto, tables: list[SlotTable]) -> None:
    for entry in [e for e in model.metadata_props if e.key == SLOTS_METADATA]:
        model.metadata_props.remove(entry)
    entry = model.metadata_props.add()
    entry.key, entry.value = SLOTS_METADATA, json.dumps([asdict(t) for t in tables])


def engine_rows(adapter: LoraAdapter, config: ModelConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The adapter's (A, B) per linear with B's rows in the engine's order (a partial or interleaved rotary
    model's q / k rows are reordered, as the base weights were: builder/rope.py)."""
    import torch

    from trtbuild.builder.rope import EngineRotaryRows, reorders_rotary_rows

    if not reorders_rotary_rows(config):
        return adapter.weights
    b = EngineRotaryRows({f"{p}.lora_b": torch.from_numpy(w[1]) for p, w in adapter.weights.items()}, config)
    return {p: (w[0], b[f"{p}.lora_b"].numpy()) for p, w in adapter.weights.items()}


def write_slot(arrays: Mapping[str, np.ndarray], tables: list[SlotTable], slot: int, rank: int,
               weights: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write one adapter's `weights` (engine_rows) into `slot` (0-based) of the engine's tables `arrays` (input
    name -> array), in place; every linear it leaves alone, and everything past its ranks, becomes zero. `rank`:
    the engine's max_lora_rank."""
    cols = slice(slot * rank, slot * rank + rank)
    for t in tables:
        a, b = arrays[t.a], arrays[t.b]
        if t.layout == STACKED:
            a[:, cols], b[cols] = 0, 0
            if t.linears[0] in weights:
                wa, wb = weights[t.linears[0]]
                a[:, cols.start : cols.start + wa.shape[0]] = wa.T
                b[cols.start : cols.start + wa.shape[0]] = wb.T
            continue
        a[slot], b[slot] = 0, 0
        columns = np.cumsum([0, *t.splits])
        for j, linear in enumerate(t.linears):
            if linear in weights:
                wa, wb = weights[linear]
                a[slot, j * rank : j * rank + wa.shape[0]] = wa
                b[slot, : wa.shape[0], columns[j] : columns[j + 1]] = wb.T
