"""Merge sibling GEMMs (MatMuls that read the same activation with constant weights) into one wide GEMM + Split.

Q/K/V projections become one GEMM whose output is split for the attention op; gate and up projections likewise.
Per-projection bias Adds are merged into one Add on the wide output.

Only MatMuls with constant full-precision weights merge here. Quantized linears (weights behind a
DequantizeLinear, builder/quantized.py) are left alone: the target's quantized lowering merges them exactly
(builder/passes/lower_quant_cpu.py concatenates packed weights of siblings that share one quantized input).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from trtbuild.builder.graph import GraphView, topological_sort
from trtbuild.builder.passes.lora import is_lora_node
from trtbuild.plugins import paged_attention as pa


def _bias_of(view: GraphView, matmul: onnx.NodeProto) -> tuple[onnx.NodeProto, np.ndarray] | None:
    users = view.consumers.get(matmul.output[0], [])
    if len(users) == 1 and users[0].op_type == "Add":
        add = users[0]
        other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
        bias = view.constant(other)
        if bias is not None and bias.ndim == 1:
            return add, bias
    return None


def merge_sibling_gemms(model: onnx.ModelProto, groups: list[list[onnx.NodeProto]], name: str) -> int:
    """Replace each group of MatMuls (same input, constant [K, N_i] weights) by one MatMul + optional Add + Split."""
    view = GraphView(model)
    for group in groups:
        weights = [view.constant(n.input[1]) for n in group]
        biases = [_bias_of(view, n) for n in group]
        with_bias = all(b is not None for b in biases)
        if any(b is not None for b in biases) and not with_bias:
            biases = [None] * len(group)  # mixed: keep the per-projection Adds, merge only the GEMMs
        widths = [w.shape[1] for w in weights]
        base = group[0].name.rsplit(".", 1)[0] + f".{name}"
        view.add_initializer(base + ".weight", np.concatenate(weights, axis=1))
        new_nodes = [helper.make_node("MatMul", [group[0].input[0], base + ".weight"], [base + "_out"], name=base)]
        wide = base + "_out"
        if with_bias:
            view.add_initializer(base + ".bias", np.concatenate([b[1] for b in biases]))
            new_nodes.append(helper.make_node("Add", [wide, base + ".bias"], [base + "_biased"], name=base + "_bias"))
            wide = base + "_biased"
        view.add_initializer(base + ".split", np.array(widths, dtype=np.int64))
        outs = [b[0].output[0] if with_bias else n.output[0] for n, b in zip(group, biases, strict=True)]
        new_nodes.append(helper.make_node("Split", [wide, base + ".split"], outs, name=base + "_split", axis=-1))
        for n, b in zip(group, biases, strict=True):
            model.graph.node.remove(n)
            if with_bias:
                model.graph.node.remove(b[0])
        model.graph.node.extend(new_nodes)
    view.drop_unused_initializers()
    topological_sort(model.graph)
    return len(groups)


def _sibling_groups(model: onnx.ModelProto, size: int, accept) -> list[list[onnx.NodeProto]]:
    view = GraphView(model)
    by_input: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in model.graph.node:
        # NOTE: a LoRA branch's first MatMul reads the projections' input too (builder/passes/lora.py)
        shape = view.shape_of(node.input[1]) if node.op_type == "MatMul" and not is_lora_node(node) else None
        if shape is not None and len(shape) == 2:
            by_input[node.input[0]].append(node)
    return [g for g in by_input.values() if len(g) == size and accept(view, g)]


def _feeds(view: GraphView, tensor: str, op_type: str, depth: int = 8) -> bool:
    """Whether `tensor` reaches a node of `op_type` within `depth` hops (through reshapes, norms, RoPE).

    The walk stops at GEMMs: a projection feeds attention directly, while an MLP output reaches the next layer's
    attention only through that layer's own Q/K/V GEMMs.
    """
    frontier = [tensor]
    for _ in range(depth):
        nxt = []
        for t in frontier:
            for user in view.consumers.get(t, []):
                if user.op_type == op_type:
                    return True
                if user.op_type not in ("MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "MatMulIntegerToFloat"):
                    nxt.extend(o for o in user.output if o)
        frontier = nxt
    return False


def fuse_qkv(model: onnx.ModelProto) -> int:
    """Q, K and V projections of each layer -> one GEMM."""
    groups = _sibling_groups(model, 3, lambda v, g: all(_feeds(v, n.output[0], pa.OP_TYPE) for n in g))
    return merge_sibling_gemms(model, groups, "qkv")


def fuse_gate_up(model: onnx.ModelProto) -> int:
    """Gate and up projections of each SwiGLU MLP -> one GEMM."""
    groups = _sibling_groups(model, 2, lambda v, g: not any(_feeds(v, n.output[0], pa.OP_TYPE) for n in g))
    return merge_sibling_gemms(model, groups, "gate_up")
