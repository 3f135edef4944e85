"""Fuse a residual Add and the RMSNorm that reads it into ONNX Runtime's SkipSimplifiedLayerNormalization.

The fused node returns both the normalized tensor and the sum, so the residual stream is read and written once.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trtbuild.builder.graph import MS_DOMAIN, GraphView, topological_sort, use_opset


def fuse_add_rmsnorm(model: onnx.ModelProto) -> int:
    view = GraphView(model)
    fused = 0
    for norm in [n for n in model.graph.node if n.op_type == "RMSNormalization"]:
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        if attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1:
            continue
        add = view.producer.get(norm.input[0])
        if add is None or add.op_type != "Add" or any(i in view.initializers for i in add.input):
            continue
        fused_node = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=norm.name + "_skip", domain=MS_DOMAIN,
            epsilon=attrs.get("epsilon", 1e-5),
        )
        model.graph.node.remove(norm)
        model.graph.node.remove(add)
        model.graph.node.append(fused_node)
        fused += 1
    topological_sort(model.graph)
    if fused:
        use_opset(model, MS_DOMAIN)
    return fused
