"""The CPU lowering of the MLP's SwiGLU onto trtbuild::SwiGLU (cpu_ops/swiglu.cc): Split of the fused gate/up
output into halves, Sigmoid of the gate, gate * sigmoid, times up, become one node that reads the fused output."""

from __future__ import annotations

import onnx

from trtbuild.builder.graph import GraphView, node_attrs, other_input, use_opset
from trtbuild.plugins import swiglu as sw


def _match(view: GraphView, split: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str] | None:
    """(the nodes the SwiGLU replaces, its output) when `split` halves the last axis into gate and up, and gate
    goes only to silu (Sigmoid and Mul) whose product goes only to one Mul with up."""
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 2 or \
            node_attrs(split).get("axis", 0) != -1 or len(split.input) != 2:
        return None
    sizes = view.constant(split.input[1])
    if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1]:
        return None
    gate, up = split.output
    users = view.consumers.get(gate, [])
    sigmoid = next((n for n in users if n.op_type == "Sigmoid"), None)
    silu = next((n for n in users if n.op_type == "Mul"), None)
    if len(users) != 2 or gate in view.graph_outputs or sigmoid is None or silu is None or \
            other_input(silu, gate) != sigmoid.output[0] or view.only_consumer(sigmoid.output[0]) is not silu:
        return None
    product = view.only_consumer(silu.output[0])
    if product is None or product.op_type != "Mul" or other_input(product, silu.output[0]) != up or \
            view.only_consumer(up) is not product:
        return None
    return [split, sigmoid, silu, product], product.output[0]


def lower_swiglu(model: onnx.ModelProto) -> int:
    """Replace each SwiGLU pattern of `model` in place; returns how many."""
    view = GraphView(model)
    found = [m for node in model.graph.node if (m := _match(view, node)) is not None]
    for (split, *rest), output in found:
        fused = onnx.helper.make_node(sw.OP_TYPE, [split.input[0]], [output], name=f"{split.name}_swiglu",
                                      domain=sw.DOMAIN)
        at = list(model.graph.node).index(split)
        for node in (split, *rest):
            model.graph.node.remove(node)
        model.graph.node.insert(at, fused)
    if found:
        view.drop_unused_initializers()
        use_opset(model, sw.DOMAIN)
    return len(found)
