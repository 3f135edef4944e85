"""The CPU lowering of the MLP's gated activation onto trtbuild::SwiGLU / trtbuild::GeGLU (cpu_ops/swiglu.cc):
Split of the fused gate/up output into halves, the gate's activation (silu as Sigmoid and Mul; gelu as
Gelu(approximate="tanh")), times up, become one node that reads the fused output."""

from __future__ import annotations

import onnx

from trtbuild.builder.graph import GraphView, node_attrs, other_input, use_opset
from trtbuild.plugins import swiglu as sw


def _activation(view: GraphView, gate: str) -> tuple[list[onnx.NodeProto], str, str] | None:
    """(the activation's nodes, its output, the fused op type) when `gate` goes only to silu (Sigmoid and Mul) or
    only to a tanh-approximated Gelu. NOTE: an exact (erf) Gelu is left alone: GeGLU computes the tanh form."""
    users = view.consumers.get(gate, [])
    if gate in view.graph_outputs:
        return None
    if len(users) == 1 and users[0].op_type == "Gelu" and users[0].domain in ("", "ai.onnx"):
        approximate = node_attrs(users[0]).get("approximate", b"none")
        return ([users[0]], users[0].output[0], sw.GEGLU_OP_TYPE) if approximate == b"tanh" else None
    sigmoid = next((n for n in users if n.op_type == "Sigmoid"), None)
    silu = next((n for n in users if n.op_type == "Mul"), None)
    if len(users) != 2 or sigmoid is None or silu is None or other_input(silu, gate) != sigmoid.output[0] or \
            view.only_consumer(sigmoid.output[0]) is not silu:
        return None
    return [sigmoid, silu], silu.output[0], sw.OP_TYPE


def _match(view: GraphView, split: onnx.NodeProto) -> tuple[list[onnx.NodeProto], str, str] | None:
    """(the nodes the fused op replaces, its output, its op type) when `split` halves the last axis into gate and
    up, the gate goes only to its activation, and that goes only to one Mul with up."""
    if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 2 or \
            node_attrs(split).get("axis", 0) != -1 or len(split.input) != 2:
        return None
    sizes = view.constant(split.input[1])
    if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1]:
        return None
    gate, up = split.output
    if (found := _activation(view, gate)) is None:
        return None
    nodes, act, op_type = found
    product = view.only_consumer(act)
    if product is None or product.op_type != "Mul" or other_input(product, act) != up or \
            view.only_consumer(up) is not product:
        return None
    return [split, *nodes, product], product.output[0], op_type


def lower_swiglu(model: onnx.ModelProto) -> int:
    """Replace each SwiGLU and GeGLU pattern of `model` in place; returns how many."""
    view = GraphView(model)
    found = [m for node in model.graph.node if (m := _match(view, node)) is not None]
    for (split, *rest), output, op_type in found:
        fused = onnx.helper.make_node(op_type, [split.input[0]], [output], name=f"{split.name}_{op_type.lower()}",
                                      domain=sw.DOMAIN)
        at = list(model.graph.node).index(split)
        for node in (split, *rest):
            model.graph.node.remove(node)
        model.graph.node.insert(at, fused)
    if found:
        view.drop_unused_initializers()
        use_opset(model, sw.DOMAIN)
    return len(found)
