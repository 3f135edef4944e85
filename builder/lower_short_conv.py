"""Lower `trtbuild::PagedShortConv` (plugins/short_conv.py) to standard ONNX ops, for machines without trtbuild's CPU
op library and for the standard-op reference that `trtbuild verify` builds.

Each token's L taps are the rows at its positions p - L + 1 .. p: a past one is gathered from the pool (its
`entries` slots as E x 2 x kv_heads rows of head_size values, one Gather), a new one from this step's x, and one before
the sequence's start is zero. Which source each tap takes, and where it lies, depends only on the batch layout, so
those indices are emitted once for every layer of the same pool, tables and kernel.
"""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import GraphBuilder
from trtbuild.plugins import short_conv as sc

_INT64_MAX = np.iinfo(np.int64).max


def _pool_dims(model: onnx.ModelProto, name: str) -> tuple[int, int, int, int, int]:
    """(slots, 2, kv_heads, tokens_per_block, head_size) of the pool graph input `name`."""
    pool = next(i for i in model.graph.input if i.name == name)
    return tuple(d.dim_value for d in pool.type.tensor_type.shape.dim[1:])


class _ShortConvLowering:
    def __init__(self, g: GraphBuilder, model: onnx.ModelProto) -> None:
        self.g, self.model = g, model
        self.meta: dict[tuple, dict[str, str]] = {}
        self.elem_types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}

    def c(self, value, hint: str = "c") -> str:
        return self.g.const(np.asarray(value), hint)

    def taps(self, node: onnx.NodeProto, kernel: int) -> dict[str, str]:
        """Per (token, tap): whether it reads the pool or x, its pool row index of slot 0's first row, and its x row."""
        key = tuple(node.input[i] for i in (sc.KV_CACHE, sc.BLOCK_TABLES, sc.PAST_LENGTHS, sc.QUERY_START_LOC))
        if key + (kernel,) in self.meta:
            return self.meta[key + (kernel,)]
        g, op, c = self.g, self.g.op, self.c
        slots, _, kv_heads, block_size, _ = _pool_dims(self.model, key[0])
        cache, tables, past, qsl = key
        g.scope = "short_conv_metadata/"
        t = op("Range", [c(0), op("Squeeze", [op("Slice", [qsl, c([-1]), c([_INT64_MAX])])]), c(1)])  # [T]
        t_col = op("Unsqueeze", [t, c([1])])  # [T, 1]
        seq = op("ReduceSum", [op("Cast", [op("GreaterOrEqual", [t_col, op("Unsqueeze", [
            op("Slice", [qsl, c([1]), c([_INT64_MAX])]), c([0])])])], to=onnx.TensorProto.INT64), c([1])], keepdims=1)
        seq_past = op("Gather", [past, seq])  # [T, 1]
        position = op("Add", [seq_past, op("Sub", [t_col, op("Gather", [qsl, seq])])])  # [T, 1]
        offsets = c(np.arange(1 - kernel, 1, dtype=np.int64)[None, :], "tap_offsets")  # [1, L]
        q = op("Add", [position, offsets])  # [T, L]: each tap's position
        from_pool = op("And", [op("GreaterOrEqual", [q, c(0)]), op("Less", [q, seq_past])])
        from_x = op("GreaterOrEqual", [q, seq_past])
        pooled_q = op("Where", [from_pool, q, c(0)])
        width = op("Slice", [op("Shape", [tables]), c([1]), c([2])])  # [1]
        block = op("Gather", [op("Reshape", [tables, c([-1])]),
                              op("Add", [op("Mul", [seq, width]), op("Div", [pooled_q, c(block_size)])])])
        block = op("Where", [from_pool, block, c(0)])  # NOTE: a table entry outside the past may hold anything
        rows_per_slot = 2 * kv_heads
        first_row = op("Add", [op("Mul", [op("Mul", [block, c(slots * rows_per_slot)]), c(block_size)]),
                               op("Mod", [pooled_q, c(block_size)])])  # [T, L]: slot 0, K, head 0's row
        x_row = op("Max", [op("Add", [t_col, offsets]), c(0)])  # [T, L]
        self.meta[key + (kernel,)] = m = dict(from_pool=op("Unsqueeze", [from_pool, c([2])]),
                                              from_x=op("Unsqueeze", [from_x, c([2])]), first_row=first_row,
                                              x_row=x_row)
        return m

    def lower(self, node: onnx.NodeProto) -> None:
        g, op, c = self.g, self.g.op, self.c
        hidden, kernel = next(tuple(i.dims) for i in self.model.graph.initializer if i.name == node.input[sc.WEIGHT])
        slots, _, kv_heads, block_size, d = _pool_dims(self.model, node.input[sc.KV_CACHE])
        layer = next(a.i for a in node.attribute if a.name == "layer_idx")
        entries = sc.entries_per_row(hidden, kv_heads, d)
        m = self.taps(node, kernel)
        g.scope = node.name + "/"
        x = node.input[sc.X]
        half = self.elem_types.get(node.input[sc.KV_CACHE]) == onnx.TensorProto.FLOAT16
        if half:  # this step's rows as the float16 pool will hold them
            x = op("Cast", [op("Cast", [x], to=onnx.TensorProto.FLOAT16)], to=onnx.TensorProto.FLOAT)
        pieces = entries * 2 * kv_heads
        rows = op("Add", [op("Unsqueeze", [m["first_row"], c([2])]),
                          c((layer * 2 * kv_heads + np.arange(pieces, dtype=np.int64)) * block_size, "piece_rows")])
        pool_rows = op("Reshape", [node.input[sc.KV_CACHE], c([-1, d])])  # aliases the pool
        past = op("Gather", [pool_rows, rows])  # [T, L, pieces, D]
        past = op("Cast", [past], to=onnx.TensorProto.FLOAT) if half else past
        past = op("Slice", [op("Reshape", [past, c([0, 0, -1])]), c([0]), c([hidden]), c([2])])  # [T, L, H]
        new = op("Gather", [x, m["x_row"]], axis=0)  # [T, L, H]
        zero = c(np.float32(0.0))
        taps = op("Where", [m["from_pool"], past, op("Where", [m["from_x"], new, zero])])
        y = op("ReduceSum", [op("Mul", [taps, op("Transpose", [node.input[sc.WEIGHT]], perm=[1, 0])]), c([1])],
               keepdims=0)  # [T, L, H] x [L, H] summed over the taps
        bias = node.input[sc.BIAS] if len(node.input) > sc.BIAS else ""
        op("Add", [y, bias], outputs=[node.output[0]]) if bias else op("Identity", [y], outputs=[node.output[0]])
        padded = op("Pad", [node.input[sc.X], c([0, 0, 0, pieces * d - hidden])])
        op("Transpose", [op("Reshape", [padded, c([-1, entries, 2, kv_heads, d])])], perm=[1, 2, 0, 3, 4],
           outputs=[node.output[1]])


def lower_short_convs(model: onnx.ModelProto, g: GraphBuilder) -> int:
    """Replace every PagedShortConv node of `model` by standard ops written into `g` (the caller adds g's nodes and
    initializers to the model); returns how many."""
    targets = [n for n in model.graph.node if n.domain == sc.DOMAIN and n.op_type == sc.OP_TYPE]
    lowering = _ShortConvLowering(g, model)
    for node in targets:
        lowering.lower(node)
        model.graph.node.remove(node)
    return len(targets)
