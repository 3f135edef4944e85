"""Move RoPE into the attention op: `Squeeze(RotaryEmbedding(Unsqueeze(x)))` on q and k -> PagedAttention(rotary=1).

The attention op then takes the un-rotated q/k, the 1-D position ids and the cos/sin tables, so a target whose
attention kernel rotates while it loads q and k (a TensorRT plugin, a GPU kernel) saves two passes over them.
The CPU lowering saves nothing: ONNX Runtime has no such kernel, so `lower_cpu.py` emits the same RotaryEmbedding
node per q and k again (one kernel each, the cost of the unfused graph); the pass keeps the graph in the form the
other targets take.
"""

from __future__ import annotations

import onnx
from onnx import helper

from trtbuild.builder.graph import GraphView
from trtbuild.plugins import paged_attention as pa


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _rope_chain(view: GraphView, tensor: str) -> tuple[list[onnx.NodeProto], str, str, str, str] | None:
    """Match tensor = Squeeze(RotaryEmbedding(Unsqueeze(x), cos, sin, Unsqueeze(pos))); return nodes and x, pos."""
    squeeze = view.producer.get(tensor)
    if squeeze is None or squeeze.op_type != "Squeeze":
        return None
    rope = view.producer.get(squeeze.input[0])
    if rope is None or rope.op_type != "RotaryEmbedding" or len(rope.input) < 4:
        return None
    if _attr(rope, "interleaved", 0) or _attr(rope, "rotary_embedding_dim", 0):
        return None  # only full, rotate-half RoPE moves into the op
    unsq_x, unsq_pos = view.producer.get(rope.input[0]), view.producer.get(rope.input[3])
    if unsq_x is None or unsq_x.op_type != "Unsqueeze" or unsq_pos is None or unsq_pos.op_type != "Unsqueeze":
        return None
    if any(len(view.consumers[n.output[0]]) != 1 for n in (unsq_x, rope, squeeze)):
        return None
    return [unsq_x, rope, squeeze], unsq_x.input[0], rope.input[1], rope.input[2], unsq_pos.input[0]


def fuse_rope_into_attention(model: onnx.ModelProto) -> int:
    view = GraphView(model)
    fused = 0
    for node in [n for n in model.graph.node if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]:
        if _attr(node, "rotary", 0):
            continue
        q_chain, k_chain = _rope_chain(view, node.input[pa.Q]), _rope_chain(view, node.input[pa.K])
        if q_chain is None or k_chain is None or q_chain[2:] != k_chain[2:]:
            continue
        (q_nodes, q, cos, sin, pos), (k_nodes, k, *_) = q_chain, k_chain
        node.input[pa.Q], node.input[pa.K] = q, k
        sinks = list(node.input[pa.SINKS:])  # NOTE: the inputs after the rope slots (gpt-oss's sinks) stay
        del node.input[pa.POSITION_IDS:]
        node.input.extend([pos, cos, sin, *sinks])
        for a in node.attribute:
            if a.name == "rotary":
                a.i = 1
        for n in q_nodes + k_nodes:
            model.graph.node.remove(n)
        fused += 1
    # drop position Unsqueezes that fed only the removed RotaryEmbedding nodes
    view = GraphView(model)
    for n in [n for n in model.graph.node if n.op_type == "Unsqueeze" and not view.consumers.get(n.output[0])]:
        if n.output[0] not in view.graph_outputs:
            model.graph.node.remove(n)
    view.drop_unused_initializers()
    return fused
