"""Lower `trtbuild::PagedAttention` to standard ONNX ops that ONNX Runtime's CPU provider runs.

ONNX Runtime has no CPU kernel for paged attention. Either the node stays and trtbuild's custom-op library runs it
(`native`, cpu_ops/paged_attention.cc: one kernel per layer), or each node becomes gathers over the paged pool plus a
dense masked attention of each sequence's new tokens over its past tokens and its own new tokens (`split`,
`concat`: ~34 standard nodes per layer, for machines without the library and for quantized pools).
Index arithmetic that depends only on the batch layout (block tables, lengths) is emitted once and shared by every
layer. The gathers read O(context tokens) of the pool, never the whole pool.
"""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder, GraphView, topological_sort, use_opset
from trtbuild.builder.lower_short_conv import lower_short_convs
from trtbuild.builder.weight_file import StagingWeights
from trtbuild.errors import ConfigError
from trtbuild.plugins import paged_attention as pa
from trtbuild.quantization import FP8_E4M3_MAX, INT8_MAX, KVCacheQuantAlgo, fp8_e4m3_values

_MISSING = object()


def _attr(node: onnx.NodeProto, name: str, default=_MISSING):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    if default is not _MISSING:
        return default
    raise KeyError(f"{node.name} lacks attribute {name}")


ATTENTION_VARIANTS = ("split", "concat")  # how scores meet the past and the new keys (see _Lowering.lower)
NATIVE = "native"  # the nodes stay, for the custom-op library


def native_unavailable(model: onnx.ModelProto) -> str | None:
    """Why the native op cannot run this network's attention on this machine; None if it can."""
    nodes = [n for n in model.graph.node if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]
    if any(_attr(n, "kv_cache_quant_algo", None) for n in nodes):
        return "the KV pool is quantized, and the native op reads float32 or float16 pools"
    from trtbuild import cpu_ops

    pool = next((i for i in model.graph.input if i.name == "kv_cache"), None)
    half = pool is not None and pool.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    return (half and float16_pool_unreadable({_attr(n, "head_size") for n in nodes})) or cpu_ops.unavailable_reason()


def float16_pool_unreadable(head_sizes: set[int]) -> str | None:
    """Why the native op cannot read a float16 KV pool of these head sizes on this CPU; None if it can: every path
    widens the rows with F16C (cpu_ops/paged_attention.cc: kReadsHalf), whatever the head size."""
    from trtbuild.builder.engine_dir import cpu_features

    if "f16c" not in cpu_features():
        sizes = ", ".join(map(str, sorted(head_sizes)))
        return (f"the native op reads a float16 KV pool by widening its rows with F16C, which this CPU lacks (a "
                f"pool of head size {sizes})")
    return None


class _Lowering:
    def __init__(self, g: GraphBuilder, elem_types: dict[str, int], variant: str = "split") -> None:
        if variant not in ATTENTION_VARIANTS:
            raise ValueError(f"attention variant {variant!r} is not one of {', '.join(ATTENTION_VARIANTS)}")
        self.g, self.variant = g, variant
        self.elem_types = elem_types  # graph input -> onnx element type (a float16 KV pool is read as float32)
        self.meta: dict[tuple, dict[str, str]] = {}
        self.positions_per_token: dict[str, str] = {}  # position_ids -> [T, 1], shared by every layer's RoPE

    def c(self, value, hint: str = "c") -> str:
        return self.g.const(np.asarray(value), hint)

    def metadata(self, node: onnx.NodeProto, block_size: int, group: int, window: int = 0) -> dict[str, str]:
        """Batch-layout indices shared by all layers (keyed by the metadata inputs they come from)."""
        key = (node.input[pa.KV_CACHE], node.input[pa.BLOCK_TABLES], node.input[pa.PAST_LENGTHS],
               node.input[pa.QUERY_START_LOC], block_size, group, window)
        if key in self.meta:
            return self.meta[key]
        g, op, c = self.g, self.g.op, self.c
        g.scope = "paged_attention_metadata/"
        cache, tables, past, qsl = key[:4]
        starts = op("Slice", [qsl, c([0]), c([-1])])  # [B]
        q_lens = op("Sub", [op("Slice", [qsl, c([1]), c([np.iinfo(np.int64).max])]), starts])
        max_q = op("ReduceMax", [q_lens, c([0])], keepdims=1)
        max_past = op("ReduceMax", [past, c([0])], keepdims=1)
        i = op("Range", [c(0), op("Squeeze", [max_q]), c(1)])  # [Sq]
        col = lambda x: op("Unsqueeze", [x, c([1])])  # noqa: E731  [B] -> [B, 1]
        row = lambda x: op("Unsqueeze", [x, c([0])])  # noqa: E731  [n] -> [1, n]
        neg_inf, zero = c(np.float32(-np.inf)), c(np.float32(0.0))
        # this step's tokens, unpacked to [B, Sq]: q_index[b, i] = starts[b] + i (0 on padding rows)
        q_valid = op("Less", [row(i), col(q_lens)])
        q_index = op("Where", [q_valid, op("Add", [col(starts), row(i)]), c(0)])
        # past tokens, read from the pool [NB, L, 2, KVH, BS, D] as whole block rows of BS * D values: the row of
        # (block, layer 0, K, head h) is block * (L * 2 * KVH) + h. NOTE: one copy per block, not one per token,
        # so the gathers move the same bytes in 16x fewer pieces (~20% of a batch-16 decode step was these gathers).
        cache_shape = op("Shape", [cache])
        dim = lambda i: op("Slice", [cache_shape, c([i]), c([i + 1])])  # noqa: E731  [1]
        rows_per_block = op("Mul", [op("Mul", [dim(1), c([2])]), dim(3)])  # L * 2 * KVH
        num_past_blocks = op("Div", [op("Add", [max_past, c([block_size - 1])]), c([block_size])])  # [1]
        # a table's entries past a sequence's own past blocks may hold anything: read block 0 there (masked)
        block_starts = op("Mul", [op("Range", [c(0), op("Squeeze", [num_past_blocks]), c(1)]), c(block_size)])
        past_tables = op("Where", [op("Less", [row(block_starts), col(past)]),
                                   op("Slice", [tables, c([0]), num_past_blocks, c([1])]), c(0)])  # [B, nb]
        kv_heads = op("Range", [c(0), op("Squeeze", [dim(3)]), c(1)])  # [KVH]
        head_blocks = op("Add", [op("Unsqueeze", [op("Mul", [past_tables, rows_per_block]), c([1])]),
                                 op("Unsqueeze", [kv_heads, c([0, 2])])])  # [B, KVH, nb]: rows of layer 0's K
        past_span = op("Mul", [num_past_blocks, c([block_size])])  # [1]: nb * BS key positions, the last masked
        j = op("Range", [c(0), op("Squeeze", [past_span]), c(1)])  # [nb * BS]
        past_valid = op("Less", [row(j), col(past)])  # [B, nb * BS]: positions past the end are masked
        # new tokens: query i sees new token i2 iff i2 <= i and i2 < q_len[b] (padding rows still see token 0)
        i_row, i_col = op("Unsqueeze", [i, c([0, 1])]), op("Unsqueeze", [i, c([0, 2])])  # [1, 1, Sq], [1, Sq, 1]
        new_visible = op("And", [op("LessOrEqual", [i_row, i_col]),
                                 op("Less", [i_row, op("Unsqueeze", [q_lens, c([1, 2])])])])  # [B, Sq, Sq]
        if window:  # query i (position past + i) sees keys from position past + i + 1 - window on: per query row
            j_3d, past_3d = op("Unsqueeze", [j, c([0, 1])]), op("Unsqueeze", [past, c([1, 2])])  # [1,1,nbBS], [B,1,1]
            oldest = op("Add", [past_3d, op("Sub", [i_col, c(window - 1)])])  # [B, Sq, 1]
            past_valid = op("And", [op("Unsqueeze", [past_valid, c([1])]),
                                    op("GreaterOrEqual", [j_3d, oldest])])  # [B, Sq, nb * BS]
            new_visible = op("And", [new_visible, op("GreaterOrEqual", [op("Add", [past_3d, i_row]), oldest])])
            past_mask = op("Tile", [op("Unsqueeze", [op("Where", [past_valid, zero, neg_inf]), c([1])]),
                                    c([1, 1, group, 1])])  # [B, 1, G * Sq, nb * BS]
        else:
            past_mask = op("Unsqueeze", [op("Where", [past_valid, zero, neg_inf]), c([1, 2])])  # [B, 1, 1, nb * BS]
        # query rows are (group member g, token i) pairs, g-major: the [Sq, Sq] mask repeats for each g
        new_mask = op("Tile", [op("Unsqueeze", [op("Where", [new_visible, zero, neg_inf]), c([1])]),
                               c([1, 1, group, 1])])  # [B, 1, G * Sq, Sq]
        # unpack: packed token t of sequence s(t) sits at row s(t) * Sq + (t - starts[s(t)]) of [B * Sq]
        num_tokens = op("Squeeze", [op("Slice", [qsl, c([-1]), c([np.iinfo(np.int64).max])])])  # T = qsl[B]
        t = op("Range", [c(0), num_tokens, c(1)])
        seq_of_t = op("ReduceSum", [op("Cast", [op("GreaterOrEqual", [op("Unsqueeze", [t, c([1])]),
                                                                        row(op("Slice", [qsl, c([1]), c([2**62])]))])],
                                                to=onnx.TensorProto.INT64), c([1])], keepdims=0)
        out_index = op("Add", [op("Mul", [seq_of_t, max_q]), op("Sub", [t, op("Gather", [starts, seq_of_t])])])
        m = dict(q_index=q_index, head_blocks=head_blocks, past_mask=past_mask, new_mask=new_mask,
                 out_index=out_index, key_split=op("Concat", [past_span, max_q], axis=0), max_q=max_q)
        if self.variant == "concat":  # one mask over past | new keys, [B, 1, G * Sq, nb * BS + Sq], for every layer
            rows = op("Slice", [op("Shape", [new_mask]), c([0]), c([3])])  # [B, 1, G * Sq], a windowed past_mask's own
            m["mask"] = op("Concat", [op("Expand", [past_mask, op("Concat", [rows, past_span], axis=0)]), new_mask],
                           axis=-1)
        self.meta[key] = m
        return m

    def sink_scores(self, node: onnx.NodeProto, m: dict[str, str], kv_heads: int, group: int) -> str:
        """The node's sinks as one more column of scores, [B, KVH, G * Sq, 1]: row (g, i) of KV head h holds query
        head h * G + g's sink. Softmax over the scores and this column, then dropping it, is the sinks' softmax:
        the sink raises the maximum and joins the denominator, and has no value. Its shape is batch layout, emitted
        once for every layer with sinks."""
        g, op, c = self.g, self.g.op, self.c
        if "sink_shape" not in m:
            scope, g.scope = g.scope, "paged_attention_metadata/"
            batch = op("Shape", [node.input[pa.PAST_LENGTHS]])  # [1]: B
            m["sink_shape"] = op("Concat", [batch, c([1, 1]), m["max_q"], c([1])], axis=0)  # [B, 1, 1, Sq, 1]
            m["sink_split"] = op("Concat", [m["key_split"], c([1])], axis=0)  # past | new | sink
            g.scope = scope
        sinks = op("Reshape", [pa.sinks_input(node.input), c([1, kv_heads, group, 1, 1])])
        return op("Reshape", [op("Expand", [sinks, m["sink_shape"]]), c([0, 0, -1, 1])])

    def rope(self, x: str, positions: str, cos: str, sin: str, heads: int, d: int) -> str:
        """x [T, heads * D] rotated by ONNX RotaryEmbedding (rotate-half), one kernel -> [T, heads, 1, D].
        NOTE: each token is its own batch row [T, heads, 1, D] with position [T, 1]: as one sequence [1, T, ...],
        ONNX Runtime refuses steps with more packed tokens than the cos/sin table has rows."""
        op, c = self.g.op, self.c
        if positions not in self.positions_per_token:
            self.positions_per_token[positions] = op("Unsqueeze", [positions, c([1])], name=f"{positions}_per_token")
        x4 = op("Reshape", [x, c([-1, heads, 1, d])])
        return op("RotaryEmbedding", [x4, cos, sin, self.positions_per_token[positions]])

    @staticmethod
    def kv_quant(node: onnx.NodeProto, which: int) -> tuple[str | None, np.float32]:
        algo = _attr(node, "kv_cache_quant_algo", None)
        algo = algo.decode() if isinstance(algo, bytes) else algo
        return algo, np.float32(_attr(node, "kv_cache_scale")[which] if algo else 1.0)

    def half_pool(self, node: onnx.NodeProto) -> bool:
        return self.elem_types.get(node.input[pa.KV_CACHE]) == onnx.TensorProto.FLOAT16

    def dequantize_kv(self, gathered: str, node: onnx.NodeProto) -> str:
        """Float32 values of the rows gathered from a quantized pool, in units of the layer's K or V scale (the
        caller applies it, see `lower`); only those rows are touched. int8: Cast. fp8 (uint8 bit patterns): Gather
        from the 256-entry table of e4m3 values (exact). A float16 pool: Cast."""
        algo, _ = self.kv_quant(node, 0)
        op, c = self.g.op, self.c
        if algo is None:
            return gathered if not self.half_pool(node) else op("Cast", [gathered], to=onnx.TensorProto.FLOAT)
        if algo == KVCacheQuantAlgo.INT8:
            return op("Cast", [gathered], to=onnx.TensorProto.FLOAT)
        return op("Gather", [c(fp8_e4m3_values(), "kv_fp8_table"), op("Cast", [gathered], to=onnx.TensorProto.INT32)])

    def fake_quantize_kv(self, x: str, node: onnx.NodeProto, which: int) -> str:
        """This step's own K or V as the pool will hold it, in units of its scale like `dequantize_kv`, so that every
        key and value attended is a stored one whatever the chunking, as in the modelopt-simulated model. Plain float
        ops (Div, Round half to even, Clip / Cast to e4m3 saturating): ONNX Runtime's QDQ rewrites stay out. A
        float16 pool: rounded to float16 and back (to nearest even, as numpy rounds when the runtime writes)."""
        algo, scale = self.kv_quant(node, which)
        op, c = self.g.op, self.c
        if algo is None:
            if not self.half_pool(node):
                return x
            return op("Cast", [op("Cast", [x], to=onnx.TensorProto.FLOAT16)], to=onnx.TensorProto.FLOAT)
        y = op("Div", [x, c(scale, "kv_scale")])
        bound = np.float32(INT8_MAX if algo == KVCacheQuantAlgo.INT8 else FP8_E4M3_MAX)
        low, high = c(-bound, "kv_min"), c(bound, "kv_max")
        if algo == KVCacheQuantAlgo.INT8:
            return op("Clip", [op("Round", [y]), low, high])
        fp8 = op("Cast", [op("Clip", [y, low, high])], to=onnx.TensorProto.FLOAT8E4M3FN)
        return op("Cast", [fp8], to=onnx.TensorProto.FLOAT)

    def lower(self, node: onnx.NodeProto) -> None:
        g, op, c = self.g, self.g.op, self.c
        layer, heads, kv_heads = _attr(node, "layer_idx"), _attr(node, "num_heads"), _attr(node, "num_kv_heads")
        d, block_size, scale = _attr(node, "head_size"), _attr(node, "tokens_per_block"), _attr(node, "scale")
        group = heads // kv_heads
        m = self.metadata(node, block_size, group, _attr(node, "window", 0))
        g.scope = node.name + "/"
        q, k, v = (node.input[i] for i in (pa.Q, pa.K, pa.V))
        if _attr(node, "rotary"):
            pos, cos, sin = (node.input[i] for i in (pa.POSITION_IDS, pa.ROPE_COS, pa.ROPE_SIN))
            q, k = self.rope(q, pos, cos, sin, heads, d), self.rope(k, pos, cos, sin, kv_heads, d)
        k = op("Reshape", [k, c([-1, kv_heads, d])], outputs=[node.output[1]])  # [T, KVH, D]
        v = op("Reshape", [v, c([-1, kv_heads, d])], outputs=[node.output[2]])
        # Queries unpacked per sequence, the G query heads of a KV head as rows of one matrix: [B, KVH, G * Sq, D].
        # NOTE: one GEMM per (sequence, KV head) with G rows, instead of G single-row GEMMs reading the same keys.
        q = op("Gather", [op("Reshape", [q, c([-1, kv_heads, group, d])]), m["q_index"]], axis=0)  # [B,Sq,KVH,G,D]
        q = op("Reshape", [op("Transpose", [q], perm=[0, 2, 3, 1, 4]), c([0, 0, -1, d])])
        pool = op("Reshape", [node.input[pa.KV_CACHE], c([-1, block_size * d])])  # block rows; aliases the pool
        # Keys and values in two parts, both [B, KVH, tokens, D]: past tokens gathered from the pool as whole blocks
        # (O(context), never the whole pool) and this step's own tokens unpacked per sequence; one softmax spans both.
        # NOTE: a quantized pool's K and V stay in units of their per-layer scales: the K scale joins the score
        # scale and the V scale multiplies the output, instead of two passes over every gathered row.
        past_kv = [self.dequantize_kv(op("Reshape", [op("Gather", [pool, op(
            "Add", [m["head_blocks"], c((2 * layer + w) * kv_heads)])]), c([0, 0, -1, d])]), node) for w in (0, 1)]
        new_kv = [op("Transpose", [op("Gather", [self.fake_quantize_kv(x, node, w), m["q_index"]], axis=0)],
                     perm=[0, 2, 1, 3]) for w, x in enumerate((k, v))]
        (_, k_scale), (v_algo, v_scale) = self.kv_quant(node, 0), self.kv_quant(node, 1)
        alpha, softcap = float(np.float32(scale) * k_scale), float(_attr(node, "softcap", 0.0))
        cap = c(np.float32(softcap), "softcap") if softcap > 0 else None

        def scores_of(keys: str) -> str:  # scale * q . k, soft-capped (cap * tanh(s / cap)) before any mask
            s = op("FusedMatMul", [q, keys], domain=MS_DOMAIN, transB=1, alpha=alpha)
            return s if cap is None else op("Mul", [op("Tanh", [op("Div", [s, cap])]), cap])

        # gpt-oss's sinks: one more score column per row, in the softmax and dropped after it (never masked)
        sink = [self.sink_scores(node, m, kv_heads, group)] if pa.sinks_input(node.input) else []
        if self.variant == "concat":  # past | new keys and values side by side: 6 nodes, copies the context
            keys, values = (op("Concat", [past, new], axis=2) for past, new in zip(past_kv, new_kv, strict=True))
            scores = op("Add", [scores_of(keys), m["mask"]])
            if not sink:
                probs = op("Softmax", [scores], axis=-1)
            else:  # the last column, the sink's, sliced off
                probs = op("Slice", [op("Softmax", [op("Concat", [scores, *sink], axis=-1)], axis=-1), c([0]),
                                     c([-1]), c([-1])])
            out = op("MatMul", [probs, values])
        else:  # "split": past and new keys scored apart, one softmax over both: 10 nodes, no copy of the context
            scores = [op("Add", [scores_of(key), mask])
                      for key, mask in zip((past_kv[0], new_kv[0]), (m["past_mask"], m["new_mask"]), strict=True)]
            probs = op("Split", [op("Softmax", [op("Concat", scores + sink, axis=-1)], axis=-1),
                                 m["sink_split" if sink else "key_split"]],
                       num_outputs=2 + len(sink), axis=-1)[:2]  # [B, KVH, G * Sq, past | Sq (| sink)]
            out = op("Add", [op("MatMul", [p, val]) for p, val in zip(probs, (past_kv[1], new_kv[1]), strict=True)])
        if v_algo is not None:
            out = op("Mul", [out, c(v_scale, "kv_scale")])
        out = op("Transpose", [op("Reshape", [out, c([0, 0, group, -1, d])])], perm=[0, 3, 1, 2, 4])  # [B,Sq,KVH,G,D]
        op("Gather", [op("Reshape", [out, c([-1, heads * d])]), m["out_index"]], axis=0, outputs=[node.output[0]])


def lower_paged_attention(model: onnx.ModelProto, variant: str = "split") -> int:
    """Replace every PagedAttention node in place (ATTENTION_VARIANTS: the same attention, computed two ways; the
    autotuner picks one by timing both), and every PagedShortConv node; returns how many attention nodes were
    lowered. `native` leaves them all (none lowered)."""
    if variant == NATIVE:
        if (reason := native_unavailable(model)) is not None:
            raise ConfigError("attention", f"native cannot be used: {reason}. Use --attention split.")
        return 0
    view = GraphView(model)
    targets = [n for n in model.graph.node if n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE]
    g = GraphBuilder(StagingWeights.of(model))
    lowering = _Lowering(g, {i.name: i.type.tensor_type.elem_type for i in model.graph.input}, variant)
    for node in targets:
        lowering.lower(node)
        model.graph.node.remove(node)
    lower_short_convs(model, g)  # NOTE: LFM2's convolutions read the same pool, without the library too
    model.graph.node.extend(g.nodes)
    model.graph.initializer.extend(g.initializers)
    del view
    topological_sort(model.graph)
    if not any(n.domain == pa.DOMAIN for n in model.graph.node):  # NOTE: the native linears share the domain
        for opset in [o for o in model.opset_import if o.domain == pa.DOMAIN]:
            model.opset_import.remove(opset)
    use_opset(model, MS_DOMAIN)
    return len(targets)
