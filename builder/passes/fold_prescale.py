"""Fold the pre-quant scale Mul of quantized linears (AWQ / SmoothQuant, `x * s` per input channel) into the
constant that produced x, so the engine runs one elementwise op less per site. Both folds are exact algebra:

  norm    x = RMSNorm(h, gamma): x * s = RMSNorm(h, gamma * s). Only when every reader of x multiplies it by the
          same s (q/k/v and gate/up of a `shared_input_scales` checkpoint; siblings with their own scales keep
          their Muls).
  swiglu  x = silu(gate) * up, up = h @ W with W constant, or DequantizeLinear(W, scales) with one scale per output
          column (int4 per group, int8 per channel): x * s scales up's column c by s[c], which is folded into those
          scales (or into W). An fp8 weight has one scale per tensor and keeps the Mul.

The Mul's readers then read the producer directly; nothing else in the graph changes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from trtbuild.builder.graph import GraphView, topological_sort


def _scale_of(view: GraphView, mul: onnx.NodeProto, x: str) -> np.ndarray | None:
    """The constant 1-D s of `mul` = Mul(x, s), or None."""
    if mul.op_type != "Mul" or len(mul.input) != 2 or x not in mul.input:
        return None
    s = view.constant(mul.input[1] if mul.input[0] == x else mul.input[0])
    return s if s is not None and s.ndim == 1 and s.dtype == np.float32 else None


def _common_scale(view: GraphView, x: str) -> tuple[list[onnx.NodeProto], np.ndarray] | None:
    """The readers of x when all are Mul(x, s) with bit-identical s, and that s."""
    readers = view.consumers.get(x, [])
    scales = [_scale_of(view, m, x) for m in readers]
    if not readers or x in view.graph_outputs or any(s is None for s in scales):
        return None
    if any(s.tobytes() != scales[0].tobytes() for s in scales[1:]):
        return None
    return readers, scales[0]


def _set_constant(view: GraphView, name: str, value: np.ndarray) -> None:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(view.initializers[name].data_type)
    view.replace_initializer(name, value.astype(dtype, copy=False))


def _fold_into_norm(view: GraphView, norm: onnx.NodeProto, s: np.ndarray) -> bool:
    gamma = view.constant(norm.input[1]) if len(norm.input) > 1 else None
    if gamma is None or gamma.shape != s.shape or view.only_consumer(norm.input[1]) is None:
        return False
    _set_constant(view, norm.input[1], gamma * s)
    return True


def _fold_into_up(view: GraphView, swiglu: onnx.NodeProto, s: np.ndarray) -> bool:
    """swiglu = Mul(silu(gate), up): fold s into the output columns of the linear that made `up`."""
    for up in swiglu.input:
        matmul = view.producer.get(up)
        if matmul is None or matmul.op_type != "MatMul" or view.only_consumer(up) is None:
            continue
        weight = matmul.input[1]
        shape = view.shape_of(weight)
        if shape is not None:  # full-precision [K, N]
            if len(shape) == 2 and shape[1] == s.size and view.only_consumer(weight) is not None:
                _set_constant(view, weight, view.constant(weight) * s)
                return True
            continue
        dq = view.producer.get(weight)
        if dq is None or dq.op_type != "DequantizeLinear" or view.only_consumer(dq.input[1]) is None:
            continue
        scales = view.constant(dq.input[1])
        axis = next((helper.get_attribute_value(a) for a in dq.attribute if a.name == "axis"), 1)
        per_column = scales is not None and scales.shape[-1] == s.size and (
            (scales.ndim == 1 and axis in (1, -1)) or (scales.ndim == 2 and axis == 0))  # per channel | per group
        if per_column:
            _set_constant(view, dq.input[1], scales * s)
            return True
    return False


def fold_prescale(model: onnx.ModelProto) -> int:
    """Fold every pre-quant scale Mul that one of the two rules covers; returns how many Muls were removed."""
    view = GraphView(model)
    folded = 0
    for producer in list(model.graph.node):
        if producer.op_type not in ("RMSNormalization", "Mul"):
            continue
        x = producer.output[0]
        found = _common_scale(view, x)
        if found is None:
            continue
        readers, s = found
        ok = (_fold_into_norm(view, producer, s) if producer.op_type == "RMSNormalization"
              else _fold_into_up(view, producer, s))
        if not ok:
            continue
        for mul in readers:
            view.rename_uses(mul.output[0], x)
            model.graph.node.remove(mul)
        view = GraphView(model)
        folded += len(readers)
    topological_sort(model.graph)
    return folded
