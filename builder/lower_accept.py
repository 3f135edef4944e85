"""Lower `trtbuild::SpeculativeAccept` (plugins/speculative_accept.py) to standard ONNX ops for ONNX Runtime's CPU
provider: every sequence's K + 1 rows gathered at once ([A, K+1, V], rows past its drafts repeat its bonus row and
are masked), one float64 softmax over them, accept tests as a prefix count, and the final draw as a cumulative sum
compared with u * total (the reference's first token whose cumulative probability exceeds it)."""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import GraphBuilder, topological_sort
from trtbuild.builder.lower_cpu import _attr
from trtbuild.builder.weight_file import StagingWeights
from trtbuild.plugins import speculative_accept as sa

_I64, _F64, _BOOL = onnx.TensorProto.INT64, onnx.TensorProto.DOUBLE, onnx.TensorProto.BOOL


def _lower(g: GraphBuilder, node: onnx.NodeProto) -> None:
    op = g.op
    c = lambda value, hint="c": g.const(np.asarray(value), hint)  # noqa: E731
    k = _attr(node, "max_draft_len")
    logits, rows0, drafts, lens, temperatures, uniforms = (node.input[i] for i in range(6))
    g.scope = node.name + "/"
    col = lambda x: op("Unsqueeze", [x, c([1])])  # noqa: E731  [A] -> [A, 1]
    j = c(np.arange(k + 1, dtype=np.int64)[None, :], "row_offsets")  # [1, K+1]
    rows = op("Add", [col(rows0), op("Min", [j, col(lens)])])  # [A, K+1]: rows past the drafts repeat the bonus row
    rows_logits = op("Gather", [logits, rows], axis=0)  # [A, K+1, V]
    drafts_ext = op("Pad", [drafts, c([0, 0, 0, 1])])  # [A, K+1]: a 0 for the bonus row, never compared
    has_draft = op("Less", [j, col(lens)])  # [A, K+1]
    # greedy: the first maximum, as numpy's argmax
    argmax = op("ArgMax", [rows_logits], axis=-1, keepdims=0)
    greedy_ok = op("Equal", [argmax, drafts_ext])
    # sampling: softmax(row / temperature) in float64, written as numpy computes it (exp(x - max), then / sum)
    is_greedy = op("Equal", [temperatures, c(np.float64(0.0))])  # [A]
    safe_t = op("Where", [is_greedy, c(np.float64(1.0)), temperatures])
    scaled = op("Div", [op("Cast", [rows_logits], to=_F64), op("Unsqueeze", [safe_t, c([1, 2])])])
    e = op("Exp", [op("Sub", [scaled, op("ReduceMax", [scaled, c([-1])], keepdims=1)])])
    probs = op("Div", [e, op("ReduceSum", [e, c([-1])], keepdims=1)])  # [A, K+1, V]
    p_draft = op("Squeeze", [op("GatherElements", [probs, op("Unsqueeze", [drafts_ext, c([2])])], axis=2), c([2])])
    sample_ok = op("Less", [op("Slice", [uniforms, c([0]), c([k + 1]), c([1])]), p_draft])
    greedy_col = col(is_greedy)  # NOTE: no Where over bool tensors in ONNX Runtime's CPU provider: And / Or instead
    ok = op("And", [op("Or", [op("And", [greedy_col, greedy_ok]), op("And", [op("Not", [greedy_col]), sample_ok])]),
                    has_draft])
    # accepted = length of the all-true prefix: rows before the first false
    misses = op("CumSum", [op("Cast", [op("Not", [ok])], to=_I64), c(np.int64(1))])
    n = op("ReduceSum", [op("Cast", [op("Equal", [misses, c(np.int64(0))])], to=_I64), c([1])], keepdims=0)
    g.op("Identity", [n], outputs=[node.output[0]])
    rejected = op("Less", [n, lens])  # [A]
    n_col = col(n)
    greedy_next = op("Squeeze", [op("GatherElements", [argmax, n_col], axis=1), c([1])])
    # the draw from row n: without the rejected draft (renormalized), or the bonus row as it is
    vocab = op("Slice", [op("Shape", [logits]), c([1]), c([2])])  # [1]
    flat = op("Reshape", [probs, op("Concat", [c([-1]), vocab], axis=0)])  # [A * (K+1), V]
    seq = op("Range", [c(np.int64(0)), op("Squeeze", [op("Slice", [op("Shape", [lens]), c([0]), c([1])])]),
                       c(np.int64(1))])
    row_n = op("Gather", [flat, op("Add", [op("Mul", [seq, c(np.int64(k + 1))]), n])], axis=0)  # [A, V]
    draft_n = op("GatherElements", [drafts_ext, n_col], axis=1)  # [A, 1]
    p_draft_n = op("GatherElements", [p_draft, n_col], axis=1)
    token_ids = op("Unsqueeze", [op("Range", [c(np.int64(0)), op("Squeeze", [vocab]), c(np.int64(1))]), c([0])])
    removed = op("And", [op("Equal", [token_ids, draft_n]), col(rejected)])
    residual = op("Where", [removed, c(np.float64(0.0)), row_n])
    norm = op("Where", [col(rejected), op("Sub", [c(np.float64(1.0)), p_draft_n]), c(np.float64(1.0))])
    residual = op("Div", [residual, norm])
    u = op("GatherElements", [uniforms, op("Add", [n_col, op("Cast", [col(rejected)], to=_I64)])], axis=1)  # [A, 1]
    cdf = op("CumSum", [residual, c(np.int64(1))])
    total = op("Slice", [cdf, c([-1]), c([np.iinfo(np.int64).max]), c([1])])  # [A, 1]
    index = op("ReduceSum", [op("Cast", [op("LessOrEqual", [cdf, op("Mul", [u, total])])], to=_I64), c([1])],
               keepdims=0)
    drawn = op("Min", [index, op("Sub", [vocab, c([1])])])
    g.op("Where", [is_greedy, greedy_next, drawn], outputs=[node.output[1]])


def lower_speculative_accept(model: onnx.ModelProto) -> int:
    """Replace every SpeculativeAccept node in place; returns how many were lowered."""
    targets = [n for n in model.graph.node if n.domain == sa.DOMAIN and n.op_type == sa.OP_TYPE]
    if not targets:
        return 0
    g = GraphBuilder(StagingWeights.of(model))
    for node in targets:
        _lower(g, node)
        model.graph.node.remove(node)
    model.graph.node.extend(g.nodes)
    model.graph.initializer.extend(g.initializers)
    topological_sort(model.graph)
    if not any(n.domain == sa.DOMAIN for n in model.graph.node):
        for opset in [o for o in model.opset_import if o.domain == sa.DOMAIN]:
            model.opset_import.remove(opset)
    return len(targets)
