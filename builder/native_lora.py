"""The CPU lowering of LoRA branches (builder/lora.py) onto trtbuild::LoraAdd (cpu_ops/lora.cc, plugins/lora.py).

The network's form of an adapted linear multiplies by every adapter's columns and masks the ones the token does
not use: its cost grows with the adapters an engine holds, and a layer takes ~30 small nodes. Each branch here,

    Add(y, MatMul(Mul(MatMul(x, lora_a), mask), lora_b))                      one linear
    Add(wide, Concat(MatMul(Mul(MatMul(x, lora_a_j), mask), lora_b_j) ...))   fused siblings (builder/passes/lora.py)

becomes one LoraAdd(y, x, lora_ids, A, Bt) that reads only each token's adapter. The adapters' columns are read
from the mask table (`lora_table`: row s + 1 is one over adapter s's). Branches whose widths are not multiples of
16 keep the network's form.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from trtbuild.builder.graph import GraphView, drop_dead_nodes, topological_sort, use_opset
from trtbuild.builder.lora_slots import PACKED, SlotTable, read_slot_tables, write_slot_tables
from trtbuild.builder.passes.lora import LORA_ADD, is_lora_add
from trtbuild.builder.weight_file import make_initializer
from trtbuild.configs import LORA_IDS_INPUT
from trtbuild.plugins import lora as lp


def _branch_nodes(view: GraphView, delta: str) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    """The (x @ lora_a, h @ lora_b) MatMuls of the branch whose output is `delta`."""
    b = view.producer.get(delta)
    mask = view.producer.get(b.input[0]) if b is not None and b.name.endswith(".lora_b") else None
    a = view.producer.get(mask.input[0]) if mask is not None and mask.name.endswith(".lora_mask") else None
    return None if a is None or not a.name.endswith(".lora_a") else (a, b)


def _branch(view: GraphView, delta: str) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(x, lora_a [K, R_total], lora_b [R_total, N]) of the branch whose output is `delta`."""
    nodes = _branch_nodes(view, delta)
    if nodes is None:
        return None
    wa, wb = view.constant(nodes[0].input[1]), view.constant(nodes[1].input[1])
    return None if wa is None or wb is None else (nodes[0].input[0], wa, wb)


def _slot_branch(view: GraphView, delta: str, tables: dict[str, SlotTable]) -> tuple[str, SlotTable] | None:
    """(x, its stacked table) of a LoRA slot engine's branch (builder/lora_slots.py)."""
    nodes = _branch_nodes(view, delta)
    table = tables.get(nodes[0].input[1]) if nodes is not None else None
    return None if table is None else (nodes[0].input[0], table)


def _input_shape(model: onnx.ModelProto, name: str) -> list[int]:
    return [d.dim_value for d in next(v for v in model.graph.input if v.name == name).type.tensor_type.shape.dim]


def _offsets(view: GraphView) -> np.ndarray | None:
    """Each adapter's first column in the stacked tables, and their end: from the mask table's rows."""
    table = view.constant("lora_table")
    if table is None:
        return None
    return np.array([0, *np.cumsum(table[1:].sum(axis=1).astype(np.int64))])


def lower_lora(model: onnx.ModelProto) -> int:
    """Replace the LoRA branches of `model` by LoraAdd nodes, in place; returns how many."""
    view = GraphView(model)
    offsets = _offsets(view)
    if offsets is None:
        return 0
    if slot_tables := read_slot_tables(model):
        return _lower_slots(model, view, len(offsets) - 1, slot_tables)
    lowered = 0
    for add in [n for n in model.graph.node if is_lora_add(n)]:
        deltas = _deltas(view, add)
        branches = [_branch(view, d) for d in deltas]
        if any(b is None for b in branches) or len({b[0] for b in branches}) != 1:
            continue
        x, k = branches[0][0], branches[0][1].shape[0]
        splits = [b[2].shape[1] for b in branches]
        if k % 16 or any(s % 16 for s in splits):
            continue
        a, bt = lp.pack([b[1] for b in branches], [b[2] for b in branches], offsets)
        name = add.name.removesuffix(LORA_ADD)
        for tensor in (make_initializer(view.staging, name + ".lora_A", a),
                       make_initializer(view.staging, name + ".lora_Bt", bt)):
            view.attach(tensor)
        node = helper.make_node(lp.OP_TYPE, [add.input[0], x, LORA_IDS_INPUT, name + ".lora_A", name + ".lora_Bt"],
                                list(add.output), name=name + ".lora", domain=lp.DOMAIN, K=k, N=sum(splits),
                                R=bt.shape[1], splits=splits)
        model.graph.node.remove(add)
        model.graph.node.append(node)
        lowered += 1
    if lowered:
        _finish(model)
    return lowered


def _deltas(view: GraphView, add: onnx.NodeProto) -> list[str]:
    """The LoRA deltas that `add` adds: one branch's, or fused siblings' (concatenated)."""
    concat = view.producer.get(add.input[1])
    return list(concat.input) if concat is not None and concat.name.endswith(".lora_concat") else [add.input[1]]


def _finish(model: onnx.ModelProto) -> None:
    drop_dead_nodes(model)
    GraphView(model).drop_unused_initializers()
    topological_sort(model.graph)
    use_opset(model, lp.DOMAIN)


def _lower_slots(model: onnx.ModelProto, view: GraphView, slots: int, tables: list[SlotTable]) -> int:
    """lower_lora for a LoRA slot engine: each lowered branch's stacked tables (engine inputs) become the packed
    inputs its LoraAdd reads, float32 [slots, blocks x R, K] and [slots, R, N], and the engine file's slot
    metadata says so."""
    by_input, rank = {t.a: t for t in tables}, _input_shape(model, tables[0].a)[1] // slots
    replaced, packed = set(), []
    for add in [n for n in model.graph.node if is_lora_add(n)]:
        branches = [_slot_branch(view, d, by_input) for d in _deltas(view, add)]
        if any(b is None for b in branches) or len({b[0] for b in branches}) != 1:
            continue
        x, k = branches[0][0], _input_shape(model, branches[0][1].a)[0]
        splits = [b[1].splits[0] for b in branches]
        if k % 16 or any(s % 16 for s in splits):
            continue
        name = add.name.removesuffix(LORA_ADD)
        table = SlotTable(name + ".lora_A", name + ".lora_Bt", PACKED, tuple(b[1].linears[0] for b in branches),
                          tuple(splits))
        model.graph.input.extend([
            helper.make_tensor_value_info(table.a, TensorProto.FLOAT, [slots, len(splits) * rank, k]),
            helper.make_tensor_value_info(table.b, TensorProto.FLOAT, [slots, rank, sum(splits)])])
        node = helper.make_node(lp.OP_TYPE, [add.input[0], x, LORA_IDS_INPUT, table.a, table.b], list(add.output),
                                name=name + ".lora", domain=lp.DOMAIN, K=k, N=sum(splits), R=rank, splits=splits)
        model.graph.node.remove(add)
        model.graph.node.append(node)
        replaced.update(b[1] for b in branches)
        packed.append(table)
    if packed:
        gone = {name for t in replaced for name in (t.a, t.b)}
        for value in [v for v in model.graph.input if v.name in gone]:
            model.graph.input.remove(value)
        write_slot_tables(model, [t for t in tables if t not in replaced] + packed)
        _finish(model)
    return len(packed)
