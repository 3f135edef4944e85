"""The native ops of a mixture of experts (cpu_ops/moe_route.cc, cpu_ops/block_matmul.cc with `experts`) against
their numpy references: the routing as rows sorted by expert, and tables of experts, in GGUF's forms."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_block_quant_ops import TABLE_INPUTS, custom_op_session, format_case

from trtbuild import cpu_ops
from trtbuild.plugins.block_quant_matmul import OP_TYPE, pack, reference_block_quant_matmul
from trtbuild.plugins.moe_route import OP_TYPE as ROUTE
from trtbuild.plugins.moe_route import reference_moe_route


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


EXPERTS, ROWS = 4, 48
# (bits, block, scales, minimums, K): GGUF's Q4_0, Q8_0, Q4_K, Q6_K, Q5_K and Q2_K expert forms
FORMATS = [(4, 32, "float16", None, 256), (8, 32, "float16", None, 256), (4, 32, "k-quant", "k-quant", 512),
           (6, 16, "k-quant", None, 512), (5, 32, "float32", "float32", 256), (2, 16, "k-quant", "k-quant", 512)]


@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", FORMATS)
def test_a_table_of_experts_multiplies_each_expert_s_tokens_by_its_own_rows(library, bits, block, scales_kind,
                                                                            mins_kind, k):
    n = EXPERTS * ROWS
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=bits + k)
    table = pack(codes, scales, bits, mins)
    inputs = ["x", *(name if v is not None else "" for name, v in zip(TABLE_INPUTS, table.tensors(), strict=True))]
    inputs = [*inputs[:3], "", *inputs[3:], "offsets"]  # the bias, then the expert offsets
    node = helper.make_node(OP_TYPE, inputs, ["y"], domain=cpu_ops.DOMAIN, K=k, N=n, bits=bits, block_size=block,
                            experts=EXPERTS, **({"scale_exponent": table.scale_exponent} if table.scale_exponent
                                                else {}))
    sess = _session(library, [node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]),
                                      helper.make_tensor_value_info("offsets", TensorProto.INT64, [EXPERTS + 1])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", ROWS])],
                    [numpy_helper.from_array(v, name) for name, v in zip(TABLE_INPUTS, table.tensors(), strict=True)
                     if v is not None])
    rng = np.random.default_rng(k)
    for counts in ((1, 0, 2, 1), (20, 3, 0, 17), (0, 0, 0, 1)):  # an expert without tokens; runs past a tile of 16
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        x = rng.standard_normal((offsets[-1], k)).astype(np.float32)
        got = sess.run(None, {"x": x, "offsets": offsets})[0]
        assert got.shape == (offsets[-1], ROWS)
        for e in range(EXPERTS):
            run, rows = slice(offsets[e], offsets[e + 1]), slice(e * ROWS, (e + 1) * ROWS)
            if counts[e]:
                want = reference_block_quant_matmul(x[run], codes[rows], scales[rows].reshape(-1), bits,
                                                    None if mins is None else mins[rows].reshape(-1))
                np.testing.assert_allclose(got[run], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    with pytest.raises(Exception, match="offsets must rise from 0 to at most M"):
        sess.run(None, {"x": np.zeros((2, k), np.float32), "offsets": np.array([0, 2, 1, 3, 3], np.int64)})
