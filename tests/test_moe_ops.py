"""The native ops of a mixture of experts (cpu_ops/moe_route.cc, cpu_ops/block_matmul.cc with `experts`) against
their numpy references: the routing as rows sorted by expert, and tables of experts, in GGUF's forms (MXFP4's
included), with and without a bias per row."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from helpers import needs_block_quant
from onnx import TensorProto, helper, numpy_helper
from test_block_quant_ops import MXFP4_BOOK, TABLE_INPUTS, custom_op_session, format_case, mxfp4_weight

from trtbuild import cpu_ops
from trtbuild.builder.native_linears import pack_nbits
from trtbuild.plugins.block_quant_matmul import (
    OP_TYPE,
    PackedTable,
    compact,
    pack,
)
from trtbuild.plugins.moe_route import OP_TYPE as ROUTE
from trtbuild.plugins.moe_route import reference_block_quant_matmul_experts, reference_moe_route


def _session(library: str, nodes, inputs, outputs, initializers=()) -> ort.InferenceSession:
    return custom_op_session(library, helper.make_graph(nodes, "g", inputs, outputs, list(initializers)))


def route_session(library: str, experts: int, k: int, normalize: bool) -> ort.InferenceSession:
    outs = ("rows", "weights", "offsets", "inverse")
    node = helper.make_node(ROUTE, ["logits"], list(outs), domain=cpu_ops.DOMAIN, k=k, normalize=int(normalize))
    types = (TensorProto.INT64, TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT64)
    return _session(library, [node], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", experts])],
                    [helper.make_tensor_value_info(n, t, None) for n, t in zip(outs, types, strict=True)])


@pytest.mark.parametrize(("k", "normalize"), [(1, True), (2, True), (2, False), (8, False)])
def test_moe_route_sorts_each_token_s_top_experts_by_expert(library, k, normalize):
    rng = np.random.default_rng(k)
    sess = route_session(library, 8, k, normalize)
    for tokens in (0, 1, 7, 40):
        logits = rng.standard_normal((tokens, 8)).astype(np.float32) * 3
        if tokens:
            logits[0] = 0.5  # every expert tied: the lowest k win
        got = sess.run(None, {"logits": logits})
        want = reference_moe_route(logits, k, normalize)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6)
        rows, weights, offsets, inverse = got
        if tokens:
            assert list(rows[inverse[:k]]) == [0] * k  # token 0's rows
            assert all(offsets[e] <= inverse[j] < offsets[e + 1] for j, e in enumerate(range(k)))  # experts 0 .. k-1


@pytest.mark.parametrize(("normalize", "biased", "scale"), [(True, True, 2.5), (False, True, 1.0), (True, False, 1.0)])
def test_moe_route_with_sigmoid_scores_ranks_with_the_selection_bias(library, normalize, biased, scale):
    """LFM2-MoE's and AFMoE's routing: experts ranked by sigmoid(logit) + selection_bias, weighted by the unbiased
    sigmoids (renormalized or not), times `scale`."""
    rng = np.random.default_rng(3)
    outs = ("rows", "weights", "offsets", "inverse")
    node = helper.make_node(ROUTE, ["logits", "bias" if biased else ""], list(outs), domain=cpu_ops.DOMAIN, k=3,
                            normalize=int(normalize), sigmoid=1, scale=scale)
    types = (TensorProto.INT64, TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT64)
    inputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 8])]
    inputs += [helper.make_tensor_value_info("bias", TensorProto.FLOAT, [8])] if biased else []
    sess = _session(library, [node], inputs, [helper.make_tensor_value_info(n, t, None)
                                              for n, t in zip(outs, types, strict=True)])
    bias = (rng.standard_normal(8) * 0.3).astype(np.float32)
    for tokens in (1, 9, 33):
        logits = (rng.standard_normal((tokens, 8)) * 2).astype(np.float32)
        got = sess.run(None, {"logits": logits, **({"bias": bias} if biased else {})})
        want = reference_moe_route(logits, 3, normalize, sigmoid=True, selection_bias=bias if biased else None,
                                   scale=scale)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    if biased:  # the bias changes which experts are chosen, not their weights
        plain = reference_moe_route(logits, 3, normalize, sigmoid=True, scale=scale)
        assert not np.array_equal(plain[2], got[2])


EXPERTS, ROWS = 4, 48
# (bits, block, scales, minimums, K): GGUF's Q4_0, Q8_0, Q4_K, Q6_K, Q5_K and Q2_K expert forms
FORMATS = [(4, 32, "float16", None, 256), (8, 32, "float16", None, 256), (4, 32, "k-quant", "k-quant", 512),
           (6, 16, "k-quant", None, 512), (5, 32, "float32", "float32", 256), (2, 16, "k-quant", "k-quant", 512)]


def experts_session(library: str, table: PackedTable, k: int, n: int, bits: int, block: int,
                    bias: np.ndarray | None = None, codebook: tuple[int, ...] | None = None) -> ort.InferenceSession:
    """One BlockQuantMatMul with `experts` = EXPERTS over the packed `table` (and `bias` [N]): inputs x [M, K] and the
    expert offsets [EXPERTS + 1]."""
    tensors = dict(zip(TABLE_INPUTS, table.tensors(), strict=True))
    if bias is not None:
        tensors["bias"] = bias
    inputs = ["x", *(name if tensors[name] is not None else "" for name in TABLE_INPUTS)]
    inputs = [*inputs[:3], "bias" if bias is not None else "", *inputs[3:], "offsets"]  # the bias, then the offsets
    node = helper.make_node(OP_TYPE, inputs, ["y"], domain=cpu_ops.DOMAIN, K=k, N=n, bits=bits, block_size=block,
                            experts=EXPERTS, **({"scale_exponent": table.scale_exponent} if table.scale_exponent
                                                else {}), **({"codebook": list(codebook)} if codebook else {}))
    return _session(library, [node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]),
                                      helper.make_tensor_value_info("offsets", TensorProto.INT64, [EXPERTS + 1])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n // EXPERTS])],
                    [numpy_helper.from_array(v, name) for name, v in tensors.items() if v is not None])


# tokens per expert: an expert without tokens; runs past a tile of 16
COUNTS = ((1, 0, 2, 1), (20, 3, 0, 17), (0, 0, 0, 1))


def check_experts(sess: ort.InferenceSession, k: int, seed: int, reference) -> None:
    """The op against `reference(x, offsets)` (y [M, ROWS] in float64) for every COUNTS."""
    rng = np.random.default_rng(seed)
    for counts in COUNTS:
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        x = rng.standard_normal((offsets[-1], k)).astype(np.float32)
        got = sess.run(None, {"x": x, "offsets": offsets})[0]
        assert got.shape == (offsets[-1], ROWS)
        want = reference(x, offsets)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@needs_block_quant
@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", FORMATS)
def test_a_table_of_experts_multiplies_each_expert_s_tokens_by_its_own_rows(library, bits, block, scales_kind,
                                                                            mins_kind, k):
    n = EXPERTS * ROWS
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=bits + k)
    table = pack(codes, scales, bits, mins)
    sess = experts_session(library, table, k, n, bits, block)
    check_experts(sess, k, k, lambda x, offsets: reference_block_quant_matmul_experts(
        x, offsets, codes, scales, bits, EXPERTS, mins))
    with pytest.raises(Exception, match="offsets must rise from 0 to at most M"):
        sess.run(None, {"x": np.zeros((2, k), np.float32), "offsets": np.array([0, 2, 1, 3, 3], np.int64)})


@needs_block_quant
@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", [FORMATS[0], FORMATS[2]], ids=["Q4_0", "Q4_K"])
def test_each_expert_adds_its_own_rows_biases(library, bits, block, scales_kind, mins_kind, k):
    """A bias [N] with `experts`: expert e's tokens get the biases of its rows e * ROWS .. (e + 1) * ROWS - 1."""
    n = EXPERTS * ROWS
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=k)
    table = pack(codes, scales, bits, mins)
    bias = (np.random.default_rng(1).standard_normal(n) * 10).astype(np.float32)
    sess = experts_session(library, table, k, n, bits, block, bias)
    check_experts(sess, k, 2, lambda x, offsets: reference_block_quant_matmul_experts(
        x, offsets, codes, scales, bits, EXPERTS, mins, bias=bias))
    without = experts_session(library, table, k, n, bits, block)
    offsets = np.array([0, 3, 3, 20, 21], np.int64)
    x = np.random.default_rng(3).standard_normal((21, k)).astype(np.float32)
    delta = sess.run(None, {"x": x, "offsets": offsets})[0] - without.run(None, {"x": x, "offsets": offsets})[0]
    experts = np.repeat(np.arange(EXPERTS), np.diff(offsets))
    np.testing.assert_allclose(delta, bias.reshape(EXPERTS, ROWS)[experts], atol=1e-5)
    with pytest.raises(Exception, match="the bias must hold N values"):
        experts_session(library, table, k, n, bits, block, bias[:ROWS]).run(None, {"x": x, "offsets": offsets})


@needs_block_quant
def test_a_table_of_mxfp4_experts_with_biases(library):
    """gpt-oss's experts: MXFP4 weights (4-bit indices into its 15 codes; float16 scales, K being no multiple of 256,
    as gpt-oss's 2880) with a bias per row; against the reference and against gguf-py's dequantized weights."""
    k, n = 320, EXPERTS * ROWS
    raw, w = mxfp4_weight(np.random.default_rng(4), n, k)
    table, bits, codebook = pack_nbits(w.codes, w.scales, None, n, k, 8)
    assert bits == 4 and codebook == MXFP4_BOOK and table.scales.dtype == np.float16
    bias = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    sess = experts_session(library, table, k, n, bits, 32, bias, codebook)
    check_experts(sess, k, 6, lambda x, offsets: reference_block_quant_matmul_experts(
        x, offsets, compact(w.codes, 8).codes, w.scales, bits, EXPERTS, codebook=codebook, bias=bias))
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(EXPERTS, ROWS, k)
    offsets = np.array([0, 5, 5, 22, 40], np.int64)
    x = np.random.default_rng(7).standard_normal((40, k)).astype(np.float32)
    got = sess.run(None, {"x": x, "offsets": offsets})[0]
    experts = np.repeat(np.arange(EXPERTS), np.diff(offsets))
    exact = np.einsum("mk,mrk->mr", x.astype(np.float64), weight[experts]) + bias.reshape(EXPERTS, ROWS)[experts]
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # int8 activations' rounding only
