"""LoRA branches (builder/lora.py) through the GEMM fusion passes.

The network writes each adapted linear as GEMM -> Add(., delta) -> [bias Add], the delta its own small
MatMul -> Mul(mask) -> MatMul from the linear's input. The branch's nodes carry the names `<linear>.lora_a`,
`.lora_mask`, `.lora_b` and `.lora_add`: sibling GEMMs are grouped without the branch's first MatMul (which reads
the same activation), and once siblings are one wide GEMM + Split, their deltas are concatenated and added before
the Split, so that what reads the Split's outputs (the SwiGLU pattern, RoPE and attention) finds the form it
expects. The network adapts a layer's q / k / v, and its gate / up, all or none (zero tables where an adapter
leaves one alone), so every such Split hoists.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trtbuild.builder.graph import GraphView, node_attrs, topological_sort

LORA_ADD = ".lora_add"  # the suffix of the Add that adds a linear's (or fused siblings') delta
LORA_NODE_SUFFIXES = (".lora_a", ".lora_mask", ".lora_b", LORA_ADD)


def is_lora_node(node: onnx.NodeProto) -> bool:
    return node.name.endswith(LORA_NODE_SUFFIXES)


def is_lora_add(node: onnx.NodeProto) -> bool:
    return node.op_type == "Add" and node.name.endswith(LORA_ADD)


def hoist_lora_adds(model: onnx.ModelProto) -> int:
    """Split(wide) -> out_i -> Add(out_i, delta_i) for every output i  =>  Split(Add(wide, Concat(delta_i)));
    returns how many Splits changed."""
    view = GraphView(model)
    hoisted = 0
    for split in [n for n in model.graph.node if n.op_type == "Split"]:
        if node_attrs(split).get("axis", 0) not in (-1, 1):
            continue
        adds = []
        for out in split.output:
            users = view.consumers.get(out, [])
            if len(users) != 1 or not is_lora_add(users[0]) or out in view.graph_outputs:
                break
            adds.append(users[0])
        if len(adds) != len(split.output):
            continue
        deltas = [a.input[1] if a.input[0] == out else a.input[0] for a, out in zip(adds, split.output, strict=True)]
        base = split.name.removesuffix("_split")
        concat = helper.make_node("Concat", deltas, [base + "_lora_delta"], name=base + ".lora_concat", axis=-1)
        add = helper.make_node("Add", [split.input[0], base + "_lora_delta"], [base + "_lora_out"],
                               name=base + LORA_ADD)
        split.input[0] = base + "_lora_out"
        del split.output[:]
        split.output.extend(a.output[0] for a in adds)
        for a in adds:
            model.graph.node.remove(a)
        model.graph.node.extend([concat, add])
        hoisted += 1
    if hoisted:
        topological_sort(model.graph)
    return hoisted
