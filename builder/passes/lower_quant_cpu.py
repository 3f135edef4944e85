"""CPU lowering of quantized linears: the standard Q/DQ patterns of builder/quantized.py -> ONNX Runtime kernels
that compute in low precision, reading 1-byte or half-byte weights from the engine file.

  int4  MatMul(x, DQ(int4 W [K, N], scales [K/g, N], axis 0, block_size g))
        -> com.microsoft MatMulNBits(x, B uint8 [N, K/g, g/2], scales [N * K/g]), bits 4, default zero point 8
  int8 weight-only  MatMul(x, DQ(int8 W [K, N], s_w [N], axis 1)), x not quantized
        -> MatMulNBits(x, B uint8 [N, K/g, g] = W + 128, scales s_w repeated per block), bits 8, default zero point
        128, with g the largest power of two <= 256 dividing K (per-channel scales are per-block ones, repeated)
  int8  MatMul(DQ(Q(x, s_x)), DQ(int8 W [K, N], s_w [N], axis 1))
        -> com.microsoft MatMulIntegerToFloat(Q(x, s_x, zero point 128) uint8, W int8, s_x, s_w, a_zero_point 128)
        per token (s_x [T, 1] computed from x, blocked Q/DQ over the last axis): the blocked QuantizeLinear with
        zero point 128 -> MatMulIntegerToFloat(a_scale 1, s_w, a_zero_point 128) -> Mul(s_x)
        (uint8 activations with zero point 128 are the int8 values + 128 exactly, and MLAS' u8s8 GEMM is ~100x
        faster than its s8s8 path on x86). On a CPU without AVX-512 VNNI the weights are uint8 W + 128 with
        b_zero_point 128 instead (u8s8_exact: there the u8s8 GEMM adds pairs of products in saturating int16)
  fp8   left as it is: DequantizeLinear(float8 W) -> MatMul (no CPU kernel multiplies fp8; ONNX Runtime keeps the
        float8 initializer and dequantizes it when the MatMul runs) with Q/DQ(fp8) on the activation.

Sibling linears that read the same (pre-scaled, quantized) activation, Q/K/V and gate/up, become one kernel over
their concatenated weights followed by a Split: every output column is computed exactly as before. Siblings are
grouped by the very tensor their kernel would read: int4 by the MatMul's input (the output of the pre-scale Mul),
int8 by the QuantizeLinear's input and scale. builder/quantized.py shares that Mul / Q/DQ only between linears with
bit-identical scales, so linears with their own prequant / activation scales (the default `trtbuild quantize`
checkpoint, `shared_input_scales: false`) stay separate kernels. Weight-only (MatMulNBits) siblings merge where
their codes have one form: the same bits and block size, all with float zero points or none, and 8-bit codes that
the native lowering holds alike (plugins/block_quant_matmul.py: `compact_form`). NOTE: a GGUF IQ4_XS layer's q and k
(4-bit indices into a codebook) merged with its Q5_K v (5-bit codes with minimums) were all held in 8 bits.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper

from trtbuild.builder.graph import MS_DOMAIN, GraphView, drop_dead_nodes, node_attrs, topological_sort, use_opset
from trtbuild.plugins.block_quant_matmul import compact_form
from trtbuild.quantization import pack_int4


def _is_zero_or_absent(view: GraphView, node: onnx.NodeProto, index: int) -> bool:
    if len(node.input) <= index or not node.input[index]:
        return True
    zp = view.constant(node.input[index])
    return zp is not None and not np.any(zp.astype(np.float32))


def _weight_dq(view: GraphView, matmul: onnx.NodeProto) -> tuple[onnx.NodeProto, int] | None:
    """The DequantizeLinear of a constant weight feeding `matmul`, and the weight's element type."""
    dq = view.producer.get(matmul.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in view.initializers:
        return None
    if view.constant(dq.input[1]) is None or not _is_zero_or_absent(view, dq, 2):
        return None
    return dq, view.initializers[dq.input[0]].data_type


def _int4_site(view: GraphView, matmul: onnx.NodeProto, dq: onnx.NodeProto) -> tuple | None:
    a = node_attrs(dq)
    q = view.constant(dq.input[0]).astype(np.int8)  # [K, N]
    scales = view.constant(dq.input[1])
    g = a.get("block_size", 0)
    if a.get("axis", 1) != 0 or q.ndim != 2 or g < 16 or g & (g - 1) or q.shape[0] % g:
        return None
    k, n = q.shape
    packed = pack_int4(q.T).reshape(n, k // g, g // 2)  # [N, K/2] -> MatMulNBits' B
    return ("nbits", matmul.input[0], k, g, 4), packed, scales.T.astype(np.float32), None  # scales [N, K/g]


def _int8_weight_only_site(matmul: onnx.NodeProto, w: np.ndarray, w_scale: np.ndarray) -> tuple | None:
    k, n = w.shape
    g = next((b for b in (256, 128, 64, 32, 16) if k % b == 0), None)
    if g is None:
        return None  # NOTE: stays DequantizeLinear -> MatMul, which ONNX Runtime runs (dequantizing every call)
    packed = (w.T.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // g, g)
    return ("nbits", matmul.input[0], k, g, 8), packed, np.repeat(w_scale[:, None], k // g, axis=1), None


def _int8_site(view: GraphView, matmul: onnx.NodeProto, dq: onnx.NodeProto) -> tuple | None:
    w, w_scale = view.constant(dq.input[0]), view.constant(dq.input[1])  # [K, N], per-tensor or per-column scale
    if w.ndim != 2 or not (w_scale.size == 1 or (w_scale.ndim == 1 and node_attrs(dq).get("axis", 1) in (1, -1))):
        return None
    w_scale = np.broadcast_to(w_scale, (w.shape[1],)).astype(np.float32)
    act_dq = view.producer.get(matmul.input[0])
    if act_dq is None or act_dq.op_type != "DequantizeLinear":
        return _int8_weight_only_site(matmul, w, w_scale)
    if not _is_zero_or_absent(view, act_dq, 2):
        return None
    quant = view.producer.get(act_dq.input[0])
    x_scale = view.constant(act_dq.input[1])
    if quant is None or quant.op_type != "QuantizeLinear":
        return None
    if x_scale is None:  # a dynamic scale: per token when one block spans the whole last axis of x
        per_token = all(node_attrs(n).get("axis") == -1 and node_attrs(n).get("block_size") == w.shape[0]
                        for n in (quant, act_dq))
        if not per_token or quant.input[1] != act_dq.input[1]:
            return None
        return ("int8_per_token", quant.input[0], quant.input[1]), w, w_scale, None
    if x_scale.size != 1:
        return None
    return ("int8", quant.input[0], quant.input[1]), w, w_scale, None


def _nbits_key(view: GraphView, node: onnx.NodeProto) -> tuple | None:
    """The merge key of a MatMulNBits the network wrote itself (weight_only linears): its input, K, block size,
    bits, whether it has float zero points, and for 8-bit codes without them the bits and codebook `compact` packs
    them in (4-bit codes are told apart by their block size: GGUF's Q3_K 16, Q4_0 32)."""
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len(node.input) > 4:
        return None
    if any(view.shape_of(i) is None for i in node.input[1:]):
        return None
    a = node_attrs(node)
    zero_points = len(node.input) == 4 and bool(node.input[3])
    form = None
    if a["bits"] == 8 and not zero_points and (codes := view.constant(node.input[1])) is not None:
        form = compact_form(codes.reshape(a["N"], -1), 8)
    return "nbits", node.input[0], a["K"], a["block_size"], a["bits"], zero_points, form


def _nbits_weights(view: GraphView, node: onnx.NodeProto) -> tuple:
    """(codes [N, ...], scales [N, blocks], zero points [N, blocks] or None) of a MatMulNBits with an `_nbits_key`."""
    n = node_attrs(node)["N"]
    zp = view.constant(node.input[3]).reshape(n, -1) if len(node.input) == 4 and node.input[3] else None
    return view.constant(node.input[1]), view.constant(node.input[2]).reshape(n, -1), zp


def _site(view: GraphView, node: onnx.NodeProto) -> tuple | None:
    """(merge key, weights [N, ...] or [K, N], scales, zero points or None) of a Q/DQ linear to lower, or None
    (a MatMulNBits the network wrote: `_nbits_key`, `_nbits_weights`)."""
    if node.op_type != "MatMul" or (found := _weight_dq(view, node)) is None:
        return None
    dq, elem = found
    return (_int4_site(view, node, dq) if elem == TensorProto.INT4
            else _int8_site(view, node, dq) if elem == TensorProto.INT8 else None)


def u8s8_exact(cpu_features: list[str]) -> bool:
    """Whether ONNX Runtime's uint8 x int8 GEMM sums exactly on a CPU with these features. With AVX-512 VNNI it
    accumulates every product in int32; without it (AVX2, AVX-512BW) MLAS adds pairs of u8 x s8 products in int16
    with saturation, which clips wherever two weights of |w| > 64 meet activations far from the zero point (errors
    of ~20% of a dot product measured on an AVX2 CPU). Its uint8 x uint8 GEMM widens to 16 bits first: exact,
    ~1.3x slower there. NOTE: the engine records the CPU features it was built with and refuses a CPU without them
    (builder/engine_dir.py), so an engine built for u8s8 never runs where it clips."""
    return "avx512_vnni" in cpu_features


def lower_quantized_linears(model: onnx.ModelProto, accuracy_level: int, signed_int8_weights: bool = True) -> int:
    """Rewrite every int4 / int8 quantized linear to its ONNX Runtime kernel; returns how many linears changed.
    `accuracy_level` is MatMulNBits' (BuildConfig.int4_accuracy_level): 1 computes in fp32 and matches the format to
    ~1e-6; 4 quantizes activations to int8 per block (VNNI kernels, ~7e-3 relative error). `signed_int8_weights`:
    int8 x int8 linears keep int8 weights (u8s8_exact of the build machine) or become uint8 with zero point 128."""
    view = GraphView(model)
    # NOTE: sites are grouped by key first and their weights read again group by group, so that one group's
    # weights are in memory at a time, not the whole model's.
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for node in model.graph.node:
        key = _nbits_key(view, node)
        if key is None and (site := _site(view, node)) is not None:
            key = site[0]
        if key is not None:
            groups[key].append(node)
    # a lone MatMulNBits the network wrote stays as it is (rewriting it would copy its weights again)
    groups = {k: nodes for k, nodes in groups.items() if k[0] != "nbits" or len(nodes) > 1
              or nodes[0].op_type != "MatMulNBits"}
    new_nodes = []
    for key, nodes in groups.items():
        # NOTE: a MatMulNBits' key is not made again here (for 8-bit codes it counts their values)
        members = [(node, *(_nbits_weights(view, node) if node.op_type == "MatMulNBits" else _site(view, node)[1:]))
                   for node in nodes]
        names = [m[0].name for m in members]
        base = names[0] if len(names) == 1 else names[0] + "+" + "+".join(n.rsplit(".", 1)[-1] for n in names[1:])
        outs = [m[0].output[0] for m in members]
        wide = outs[0] if len(members) == 1 else base + "_out"
        widths = [m[1].shape[0 if key[0] == "nbits" else 1] for m in members]
        if key[0] == "nbits":
            _, x, k, g, bits, *_ = key
            scales = np.concatenate([m[2] for m in members])  # [N, blocks]
            if len(members) == 1 and members[0][0].op_type == "MatMulNBits":  # its own weights, as they are
                inputs = list(members[0][0].input[:3])
            else:
                inputs = [x, base + ".weight_nbits", base + ".scales_nbits"]
                view.add_initializer(inputs[1], np.concatenate([m[1] for m in members]))
                view.add_initializer(inputs[2], scales.reshape(-1))
            attrs = dict(domain=MS_DOMAIN, K=k, N=sum(widths), bits=bits, block_size=g, accuracy_level=accuracy_level)
            if any(m[3] is not None for m in members):  # a member without: the default zero point
                view.add_initializer(base + ".zero_points_nbits", np.concatenate(
                    [np.full_like(m[2], 1 << (bits - 1)) if m[3] is None else m[3] for m in members]).reshape(-1))
                inputs.append(base + ".zero_points_nbits")
            new_nodes.append(helper.make_node("MatMulNBits", inputs, [wide], name=base, **attrs))
        else:  # int8: u8 = round(x / s) + 128 (|x / s| <= 127); y = (u8 - 128) @ W * s * s_w
            # NOTE: uint8 activations with zero point 128, because ONNX Runtime's int8 x int8 MatMulInteger is ~16x
            # slower than uint8 x int8 on x86. MatMulIntegerToFloat scales in the GEMM's epilogue (1.2-1.35x faster
            # than MatMulInteger -> Cast -> Mul at 2048 tokens, where those passes over the output are memory bound).
            _, x, x_scale = key
            per_token = key[0] == "int8_per_token"
            weights = np.concatenate([m[1] for m in members], axis=1)
            if not signed_int8_weights:
                weights = (weights.astype(np.int16) + 128).astype(np.uint8)
            view.add_initializer(base + ".weight_int8", weights)
            view.add_initializer(base + ".weight_scale", np.concatenate([m[2] for m in members]))
            view.add_initializer(base + ".act_zero_point", np.array(128, dtype=np.uint8))
            zp = act_zp = base + ".act_zero_point"
            if per_token:  # the blocked QuantizeLinear takes a zero point shaped like its scale [tokens, 1]
                view.add_initializer(base + ".act_token_zero_point", np.full((1, 1), 128, np.uint8))
                view.add_initializer(base + ".unit_scale", np.array(1.0, dtype=np.float32))
                act_zp = base + "_act_zp"
                new_nodes += [
                    helper.make_node("Shape", [x_scale], [base + "_act_scale_shape"], name=base + "_act_scale_shape"),
                    helper.make_node("Expand", [base + ".act_token_zero_point", base + "_act_scale_shape"], [act_zp],
                                     name=base + "_act_zp")]
            quant_attrs = dict(axis=-1, block_size=members[0][1].shape[0]) if per_token else {}
            new_nodes += [
                helper.make_node("QuantizeLinear", [x, x_scale, act_zp], [base + "_act_u8"], name=base + "_act_quant",
                                 **quant_attrs),
                helper.make_node("MatMulIntegerToFloat", [base + "_act_u8", base + ".weight_int8",
                                                          base + ".unit_scale" if per_token else x_scale,
                                                          base + ".weight_scale", zp,
                                                          *([] if signed_int8_weights else [zp])],
                                 [base + "_scaled" if per_token else wide], name=base, domain=MS_DOMAIN)]
            if per_token:  # the GEMM's epilogue takes one activation scale; the token's is applied after it
                new_nodes.append(helper.make_node("Mul", [base + "_scaled", x_scale], [wide],
                                                  name=base + "_token_scale"))
        if len(members) > 1:
            view.add_initializer(base + ".split", np.array(widths, dtype=np.int64))
            new_nodes.append(helper.make_node("Split", [wide, base + ".split"], outs, name=base + "_split", axis=-1))
        for m in members:
            model.graph.node.remove(m[0])
    model.graph.node.extend(new_nodes)
    drop_dead_nodes(model)
    GraphView(model).drop_unused_initializers()
    topological_sort(model.graph)
    if groups:
        use_opset(model, MS_DOMAIN)
    return sum(len(m) for m in groups.values())


class FloatZeroPoints:
    """The `ort` tactic's form of a MatMulNBits with float zero points (the native tactic,
    builder/native_linears.py, computes such linears itself). NOTE: ONNX Runtime's MatMulNBits has no fast kernel
    for float zero points (it dequantizes the whole weight on every call: ~40 ms instead of ~0.8 ms for a 1536 x 8960
    int4 GEMV). With its default zero point z0 = 2^(bits-1) instead,
      x @ ((q - zp) * s)^T = x @ ((q - z0) * s)^T + blocksum(x) @ ((z0 - zp) * s)^T,
    exact algebra: the second term is a small fp32 GEMM over one sum of x per block (1/block_size of the work). Run
    after sibling linears are merged, the block sums and the correction GEMM are shared by Q/K/V and by gate/up. Each
    linear's new initializers are made once however many graph copies it lowers (the autotuner lowers one per
    candidate)."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[str, list[onnx.TensorProto]]] = {}  # node -> (its codes input, new initializers)

    def expand(self, model: onnx.ModelProto) -> int:
        """Rewrite each MatMulNBits with float zero points in `model`; returns how many."""
        view = GraphView(model)
        count = 0
        for node in list(model.graph.node):
            if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len(node.input) != 4 or \
                    view.initializers.get(node.input[3], TensorProto()).data_type != TensorProto.FLOAT:
                continue
            if node.name not in self._made:
                self._made[node.name] = self._initializers(view, node)
            codes, tensors = self._made[node.name]
            for t in tensors:
                view.attach(t)
            attrs, base, x = {**node_attrs(node), "domain": MS_DOMAIN}, node.name, node.input[0]
            model.graph.node.remove(node)
            model.graph.node.extend([
                helper.make_node("MatMulNBits", [x, codes, node.input[2]], [base + "_codes_out"], name=base + "_codes",
                                 **attrs),
                helper.make_node("Reshape", [x, base + ".blocks_shape"], [base + "_blocks"], name=base + "_blocks"),
                helper.make_node("ReduceSum", [base + "_blocks", base + ".axis_last"], [base + "_block_sums"],
                                 name=base + "_block_sums", keepdims=0),
                helper.make_node("MatMul", [base + "_block_sums", base + ".zero_point_offsets"],
                                 [base + "_zero_points"], name=base + "_zero_points"),
                helper.make_node("Add", [base + "_codes_out", base + "_zero_points"], list(node.output),
                                 name=base + "_with_zero_points")])
            count += 1
        if count:
            view.drop_unused_initializers()
            topological_sort(model.graph)
        return count

    @staticmethod
    def _initializers(view: GraphView, node: onnx.NodeProto) -> tuple[str, list[onnx.TensorProto]]:
        """The codes the rewrite of `node` multiplies with, and the initializers it adds (made here)."""
        a, base = node_attrs(node), node.name
        n, k, g = a["N"], a["K"], a["block_size"]
        codes, scales = view.constant(node.input[1]), view.constant(node.input[2]).reshape(n, -1)
        zero_points = view.constant(node.input[3]).reshape(n, -1)
        names = [base + ".blocks_shape", base + ".axis_last", base + ".zero_point_offsets"]
        view.add_initializer(names[0], np.array([0, k // g, g], dtype=np.int64))
        view.add_initializer(names[1], np.array([-1], dtype=np.int64))
        codes_name = node.input[1]
        if a["bits"] == 8 and int(codes.max()) < 128:
            # NOTE: GGUF's Q5_K / Q5_1 codes are 0..31: centred on the default zero point (q + 112 - 128), the
            # kernel's int8 activation rounding meets weights near 0, not 16x their scale (a small model's logits:
            # ~15x nearer the float model's)
            shift = 128 - (1 << int(codes.max()).bit_length()) // 2
            codes_name = base + ".weight_nbits_centred"
            names.append(codes_name)
            view.add_initializer(codes_name, codes + np.uint8(shift))
            zero_points = zero_points + np.float32(shift)
        offsets = ((1 << (a["bits"] - 1)) - zero_points) * scales  # [N, blocks]
        view.add_initializer(names[2], offsets.T.astype(np.float32).copy())
        return codes_name, [view.initializers[name] for name in names]
