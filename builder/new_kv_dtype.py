"""The CPU engine's `new_kv` output in its KV pool's element type: with a float16 pool, every layer's new K and V
are cast to float16 as they are made, so that the step's K/V held until the output is stacked (each layer's, then
the stacked copy) take half the memory. The runtime stores float16 rows as they are; the values are those it would
have rounded to (the native attention already attends to float16-rounded new K/V)."""

from __future__ import annotations

import onnx
from onnx import helper

from trtbuild.builder.graph import GraphView

NEW_KV = "new_kv"


def new_kv_in_pool_dtype(model: onnx.ModelProto) -> int:
    """In place: a Cast to float16 after each producer of the stacked `new_kv` (Reshape of a Concat) when the
    `kv_cache` input is float16, and the output declared float16; returns how many Casts were added (0: a float32
    or quantized pool, whose runtime writes take float32)."""
    pool = next((i for i in model.graph.input if i.name == "kv_cache"), None)
    if pool is None or pool.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16:
        return 0
    view = GraphView(model)
    reshape = view.producer.get(NEW_KV)
    stacked = view.producer.get(reshape.input[0]) if reshape is not None and reshape.op_type == "Reshape" else None
    if stacked is None or stacked.op_type != "Concat":
        raise ValueError(f"{NEW_KV} is not a Reshape of a Concat of the layers' K/V; the network changed its output")
    casts = []
    for i, layer_kv in enumerate(stacked.input):
        half = f"{layer_kv}_float16"
        casts.append(helper.make_node("Cast", [layer_kv], [half], name=f"new_kv_float16_{i}",
                                      to=onnx.TensorProto.FLOAT16))
        stacked.input[i] = half
    # NOTE: each Cast goes right after its producer, so that the float32 K/V are freed once the layer has attended
    nodes = list(model.graph.node)
    position = {n.output[j]: k for k, n in enumerate(nodes) for j in range(len(n.output))}
    for cast in sorted(casts, key=lambda c: position[c.input[0]], reverse=True):
        nodes.insert(position[cast.input[0]] + 1, cast)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    output = next(o for o in model.graph.output if o.name == NEW_KV)
    output.type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    return len(casts)
