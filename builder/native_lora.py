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
from onnx import helper

from trtbuild.builder.graph import GraphView, drop_dead_nodes, topological_sort, use_opset
from trtbuild.builder.passes.lora import LORA_ADD, is_lora_add
from trtbuild.builder.weight_file import make_initializer
from trtbuild.configs import LORA_IDS_INPUT
from trtbuild.plugins import lora as lp


def _branch(view: GraphView, delta: str) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(x, lora_a [K, R_total], lora_b [R_total, N]) of the branch whose output is `delta`."""
    b = view.producer.get(delta)
    mask = view.producer.get(b.input[0]) if b is not None and b.name.endswith(".lora_b") else None
    a = view.producer.get(mask.input[0]) if mask is not None and mask.name.endswith(".lora_mask") else None
    if a is None or not a.name.endswith(".lora_a"):
        return None
    wa, wb = view.constant(a.input[1]), view.constant(b.input[1])
    return None if wa is None or wb is None else (a.input[0], wa, wb)


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
    lowered = 0
    for add in [n for n in model.graph.node if is_lora_add(n)]:
        concat = view.producer.get(add.input[1])
        deltas = list(concat.input) if concat is not None and concat.name.endswith(".lora_concat") else [add.input[1]]
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
        drop_dead_nodes(model)
        GraphView(model).drop_unused_initializers()
        topological_sort(model.graph)
        use_opset(model, lp.DOMAIN)
    return lowered
