"""Bias adds folded into the native linears that compute them (trtbuild::BlockQuantMatMul, DenseMatMul): a Qwen2
layer's q, k and v biases are three Adds after the fused q+k+v linear's Split, each a node of its own and a pass
over its output; the kernels add a bias as they store their results, for free."""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import GraphView, node_attrs, other_input
from trtbuild.builder.passes.lora import is_lora_add
from trtbuild.plugins import block_quant_matmul as bq
from trtbuild.plugins import dense_matmul as dm
from trtbuild.plugins import lora as lp

BIAS_INPUT = {bq.OP_TYPE: 3, dm.OP_TYPE: 2}  # the optional bias input of each op (plugins/README.md)


def _bias_add(view: GraphView, tensor: str) -> tuple[onnx.NodeProto, np.ndarray] | None:
    """The Add that is `tensor`'s only consumer and adds a 1-D float constant to it, and that constant."""
    add = view.only_consumer(tensor)
    if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or \
            add.output[0] in view.graph_outputs:
        return None
    other = other_input(add, tensor)
    t = view.initializers.get(other) if other is not None else None
    if t is None or t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 1:
        return None
    return add, view.constant(other)


def _pieces(view: GraphView, y: str, n: int) -> list[tuple[str, int]] | None:
    """(tensor, width) of the linear's output as its consumers see it: itself, or the outputs of the Split that is
    its only consumer (None when a split cannot be read); after its LoRA delta's Add, if it has one (a bias adds
    the same before or after it: builder/lora.py)."""
    lora = view.only_consumer(y)
    if lora is not None and lora.input[0] == y and (is_lora_add(lora) or lora.op_type == lp.OP_TYPE):
        y = lora.output[0]
    split = view.only_consumer(y)
    if split is not None and split.op_type == "Split" and len(split.input) == 2:
        sizes = view.constant(split.input[1])
        if sizes is None or node_attrs(split).get("axis", 0) != -1 or int(np.sum(sizes)) != n or \
                len(sizes) != len(split.output):
            return None
        return list(zip(split.output, (int(s) for s in sizes), strict=True))
    return [(y, n)]


def fold_linear_biases(model: onnx.ModelProto) -> int:
    """Fold bias Adds into the native linears of `model` in place; returns how many linears took a bias."""
    view = GraphView(model)
    folded = 0
    for node in list(model.graph.node):
        index = BIAS_INPUT.get(node.op_type) if node.domain == bq.DOMAIN else None
        if index is None or (len(node.input) > index and node.input[index]):
            continue
        n = node_attrs(node)["N"]
        pieces = _pieces(view, node.output[0], n)
        adds = [_bias_add(view, tensor) for tensor, _ in pieces] if pieces else []
        if not any(adds) or any(a is not None and a[1].shape != (w,) for a, (_, w) in zip(adds, pieces, strict=True)):
            continue
        bias = np.concatenate([a[1] if a is not None else np.zeros(w, np.float32)
                               for a, (_, w) in zip(adds, pieces, strict=True)]).astype(np.float32)
        name = f"{node.output[0]}.bias"
        view.add_initializer(name, bias)
        if len(node.input) > index:  # an empty slot before the op's other optional inputs
            node.input[index] = name
        else:
            node.input.append(name)
        for a, (tensor, _) in zip(adds, pieces, strict=True):
            if a is not None:
                view.rename_uses(a[0].output[0], tensor)
                model.graph.node.remove(a[0])
        folded += 1
        view = GraphView(model)
    if folded:
        view.drop_unused_initializers()
    return folded
