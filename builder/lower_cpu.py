"""Lower `trtbuild::PagedAttention` to standard ONNX ops that ONNX Runtime's CPU provider runs.

ONNX Runtime has no CPU kernel for paged attention, so each node becomes gathers over the paged pool plus a dense
masked attention over [batch, max_query_len, max_context_len]. Index arithmetic that depends only on the batch
layout (block tables, lengths) is emitted once and shared by every layer. The gathers read O(context tokens) of
the pool, never the whole pool.
"""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import GraphBuilder, GraphView, topological_sort
from trtbuild.plugins import paged_attention as pa


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    raise KeyError(f"{node.name} lacks attribute {name}")


class _Lowering:
    def __init__(self, g: GraphBuilder) -> None:
        self.g = g
        self.meta: dict[tuple, dict[str, str]] = {}

    def c(self, value, hint: str = "c") -> str:
        return self.g.const(np.asarray(value), hint)

    def metadata(self, node: onnx.NodeProto, block_size: int) -> dict[str, str]:
        """Batch-layout indices shared by all layers (keyed by the metadata inputs they come from)."""
        key = (node.input[pa.KV_CACHE], node.input[pa.BLOCK_TABLES], node.input[pa.PAST_LENGTHS],
               node.input[pa.QUERY_START_LOC], block_size)
        if key in self.meta:
            return self.meta[key]
        g, op, c = self.g, self.g.op, self.c
        g.scope = "paged_attention_metadata/"
        cache, tables, past, qsl = key[:4]
        starts = op("Slice", [qsl, c([0]), c([-1])])  # [B]
        q_lens = op("Sub", [op("Slice", [qsl, c([1]), c([np.iinfo(np.int64).max])]), starts])
        ctx_lens = op("Add", [past, q_lens])
        max_q = op("ReduceMax", [q_lens, c([0])], keepdims=1)
        max_ctx = op("ReduceMax", [ctx_lens, c([0])], keepdims=1)
        i = op("Range", [c(0), op("Squeeze", [max_q]), c(1)])  # [Sq]
        j = op("Range", [c(0), op("Squeeze", [max_ctx]), c(1)])  # [L]
        col = lambda x: op("Unsqueeze", [x, c([1])])  # noqa: E731  [B] -> [B, 1]
        row = lambda x: op("Unsqueeze", [x, c([0])])  # noqa: E731  [n] -> [1, n]
        starts_c, past_c, ctx_c = col(starts), col(past), col(ctx_lens)
        # query gather: q_index[b, i] = starts[b] + i (clamped to 0 on padding rows)
        q_valid = op("Less", [row(i), col(q_lens)])
        q_index = op("Where", [q_valid, op("Add", [starts_c, row(i)]), c(0)])
        # context gather: positions j < past come from the pool, the rest from this step's new tokens
        past_valid = op("Less", [row(j), past_c])
        block_col = op("Div", [j, c(block_size)])
        slots = op("Add", [op("Mul", [op("Gather", [tables, block_col], axis=1), c(block_size)]),
                           row(op("Mod", [j, c(block_size)]))])
        slots = op("Where", [past_valid, slots, c(0)])
        new_valid = op("And", [op("Not", [past_valid]), op("Less", [row(j), ctx_c])])
        new_index = op("Where", [new_valid, op("Add", [starts_c, op("Sub", [row(j), past_c])]), c(0)])
        # causal mask [B, 1, 1, Sq, L]: key j is visible to query i of sequence b iff j <= past[b] + i and j < ctx[b]
        i_col = op("Unsqueeze", [i, c([0, 2])])  # [1, Sq, 1]
        j_row = op("Unsqueeze", [j, c([0, 1])])  # [1, 1, L]
        visible = op("And", [op("LessOrEqual", [j_row, op("Add", [op("Unsqueeze", [past, c([1, 2])]), i_col])]),
                             op("Less", [j_row, op("Unsqueeze", [ctx_lens, c([1, 2])])])])
        mask = op("Where", [visible, c(np.float32(0.0)), c(np.float32(-np.inf))])
        mask = op("Unsqueeze", [mask, c([1, 2])])
        # unpack: packed token t of sequence s(t) sits at row s(t) * Sq + (t - starts[s(t)]) of [B * Sq]
        num_tokens = op("Squeeze", [op("Slice", [qsl, c([-1]), c([np.iinfo(np.int64).max])])])  # T = qsl[B]
        t = op("Range", [c(0), num_tokens, c(1)])
        seq_of_t = op("ReduceSum", [op("Cast", [op("GreaterOrEqual", [op("Unsqueeze", [t, c([1])]),
                                                                        row(op("Slice", [qsl, c([1]), c([2**62])]))])],
                                                to=onnx.TensorProto.INT64), c([1])], keepdims=0)
        out_index = op("Add", [op("Mul", [seq_of_t, max_q]), op("Sub", [t, op("Gather", [starts, seq_of_t])])])
        cache_shape = op("Shape", [cache])
        slots_per_pool = op("Mul", [op("Slice", [cache_shape, c([2]), c([3])]),
                                    op("Slice", [cache_shape, c([3]), c([4])])])
        m = dict(q_index=q_index, past_valid=op("Unsqueeze", [past_valid, c([2, 3])]), slots=slots,
                 new_index=new_index, mask=mask, out_index=out_index, slots_per_pool=slots_per_pool,
                 batch_x_sq=op("Mul", [op("Shape", [past]), max_q]))
        self.meta[key] = m
        return m

    def rope(self, x: str, positions: str, cos: str, sin: str, half: int) -> str:
        op, c = self.g.op, self.c
        cos_t = op("Unsqueeze", [op("Gather", [cos, positions]), c([1])])  # [T, 1, D/2]
        sin_t = op("Unsqueeze", [op("Gather", [sin, positions]), c([1])])
        x1, x2 = op("Split", [x, c([half, half])], num_outputs=2, axis=-1)
        return op("Concat", [op("Sub", [op("Mul", [x1, cos_t]), op("Mul", [x2, sin_t])]),
                             op("Add", [op("Mul", [x2, cos_t]), op("Mul", [x1, sin_t])])], axis=-1)

    def lower(self, node: onnx.NodeProto) -> None:
        g, op, c = self.g, self.g.op, self.c
        layer, heads, kv_heads = _attr(node, "layer_idx"), _attr(node, "num_heads"), _attr(node, "num_kv_heads")
        d, block_size, scale = _attr(node, "head_size"), _attr(node, "tokens_per_block"), _attr(node, "scale")
        group = heads // kv_heads
        m = self.metadata(node, block_size)
        g.scope = node.name + "/"
        q = op("Reshape", [node.input[pa.Q], c([0, heads, d])])
        k = op("Reshape", [node.input[pa.K], c([0, kv_heads, d])])
        v = op("Reshape", [node.input[pa.V], c([0, kv_heads, d])], outputs=[node.output[2]])
        if _attr(node, "rotary"):
            pos, cos, sin = (node.input[i] for i in (pa.POSITION_IDS, pa.ROPE_COS, pa.ROPE_SIN))
            q = self.rope(q, pos, cos, sin, d // 2)
            k = self.rope(k, pos, cos, sin, d // 2)
        op("Identity", [k], outputs=[node.output[1]])
        k = node.output[1]
        pool = op("Reshape", [node.input[pa.KV_CACHE], c([-1, kv_heads, d])])  # aliases the pool, no copy
        context = []
        for which, new in ((0, k), (1, v)):
            offset = op("Mul", [m["slots_per_pool"], c([2 * layer + which])])
            from_pool = op("Gather", [pool, op("Add", [m["slots"], offset])])  # [B, L, KVH, D]
            from_step = op("Gather", [new, m["new_index"]])
            context.append(op("Where", [m["past_valid"], from_pool, from_step]))
        k_ctx, v_ctx = context
        q_b = op("Gather", [op("Mul", [q, c(np.float32(scale))]), m["q_index"]])  # [B, Sq, H, D]
        q_b = op("Reshape", [q_b, c([0, 0, kv_heads, group, d])])
        q_b = op("Transpose", [q_b], perm=[0, 2, 3, 1, 4])  # [B, KVH, G, Sq, D]
        k_t = op("Unsqueeze", [op("Transpose", [k_ctx], perm=[0, 2, 3, 1]), c([2])])  # [B, KVH, 1, D, L]
        v_t = op("Unsqueeze", [op("Transpose", [v_ctx], perm=[0, 2, 1, 3]), c([2])])  # [B, KVH, 1, L, D]
        probs = op("Softmax", [op("Add", [op("MatMul", [q_b, k_t]), m["mask"]])], axis=-1)
        out = op("Transpose", [op("MatMul", [probs, v_t])], perm=[0, 3, 1, 2, 4])  # [B, Sq, KVH, G, D]
        out = op("Reshape", [out, op("Concat", [m["batch_x_sq"], c([heads * d])], axis=0)])
        op("Gather", [out, m["out_index"]], outputs=[node.output[0]])


def lower_paged_attention(model: onnx.ModelProto) -> int:
    """Replace every PagedAttention node in place; returns how many were lowered."""
    view = GraphView(model)
    targets = [n for n in model.graph.node if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]
    g = GraphBuilder()
    lowering = _Lowering(g)
    for node in targets:
        lowering.lower(node)
        model.graph.node.remove(node)
    model.graph.node.extend(g.nodes)
    model.graph.initializer.extend(g.initializers)
    del view
    topological_sort(model.graph)
    for opset in list(model.opset_import):
        if opset.domain == pa.DOMAIN:
            model.opset_import.remove(opset)
    return len(targets)
