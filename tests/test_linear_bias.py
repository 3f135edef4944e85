"""Bias adds folded into the native linears (builder/linear_bias.py): the optional bias input of
trtbuild::BlockQuantMatMul and DenseMatMul against their references plus the bias, which Adds the lowering takes
(after a Split of a fused linear too), and a Qwen2 engine (q, k, v biases) with none of them left."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import AVX512, needs_block_quant, needs_dense
from onnx import TensorProto, helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, read_engine_config
from trtbuild.builder.linear_bias import fold_linear_biases
from trtbuild.plugins import block_quant_matmul as bq
from trtbuild.plugins import dense_matmul as dm

K, N = 64, 40
# each kind's op runs with its instruction sets only: DenseMatMul AVX-512 or AVX2, BlockQuantMatMul AVX-512 VNNI or AVX2
KINDS = [pytest.param("dense", marks=needs_dense), pytest.param("block", marks=needs_block_quant)]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def linear_model(kind: str, rng: np.random.Generator, after: list[onnx.NodeProto], outputs: list[str],
                 extra: list[onnx.TensorProto]) -> tuple[onnx.ModelProto, np.ndarray]:
    """x [M, K] -> one native linear `kind` ("dense" | "block") -> `after`; returns the model and W [N, K]."""
    if kind == "dense":
        w = rng.standard_normal((N, K)).astype(np.float32)
        inits = [numpy_helper.from_array(dm.pack(w, "float32"), "B")]
        node = helper.make_node(dm.OP_TYPE, ["x", "B"], ["y"], domain=dm.DOMAIN, K=K, N=N)
    else:
        codes = rng.integers(0, 16, (N, K), dtype=np.uint8)
        scales = (rng.random((N, K // 32), dtype=np.float32) * 0.02 + 1e-3)
        b, s, *_ = bq.pack(codes, scales.reshape(-1), 4)
        inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s, "S")]
        node = helper.make_node(bq.OP_TYPE, ["x", "B", "S"], ["y"], domain=bq.DOMAIN, K=K, N=N, bits=4, block_size=32)
        w = (codes.astype(np.float32) - 8) * np.repeat(scales, 32, axis=1)
    # NOTE: the outputs go through an Identity each, as inside a network (a graph output is never renamed)
    ends = [helper.make_node("Identity", [o], [f"{o}_out"]) for o in outputs]
    graph = helper.make_graph([node, *after, *ends], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info(f"{o}_out", TensorProto.FLOAT, None) for o in outputs],
                              inits + extra)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(dm.DOMAIN, 1)]), w


@pytest.mark.parametrize("kind", KINDS)
def test_a_bias_add_becomes_the_linears_bias_input(kind):
    rng = np.random.default_rng(0)
    bias = rng.standard_normal(N).astype(np.float32)
    model, _ = linear_model(kind, rng, [helper.make_node("Add", ["bias", "y"], ["z"])], ["z"],
                            [numpy_helper.from_array(bias, "bias")])
    x = rng.standard_normal((9, K)).astype(np.float32)
    want = session(model).run(None, {"x": x})[0]
    assert fold_linear_biases(model) == 1
    assert [n.op_type for n in model.graph.node] == [dm.OP_TYPE if kind == "dense" else bq.OP_TYPE, "Identity"]
    np.testing.assert_allclose(session(model).run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fused_linears_split_outputs_take_their_biases_and_zeros_where_none(kind):
    """q, k, v of a fused linear: q and v have a bias Add, k none (its rows of the bias are zero)."""
    rng = np.random.default_rng(1)
    sizes = [24, 8, 8]
    bq_, bv = rng.standard_normal(24).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    after = [helper.make_node("Split", ["y", "sizes"], ["q", "k", "v"], axis=-1),
             helper.make_node("Add", ["q", "bq"], ["q_b"]), helper.make_node("Add", ["v", "bv"], ["v_b"])]
    extra = [numpy_helper.from_array(np.array(sizes, np.int64), "sizes"), numpy_helper.from_array(bq_, "bq"),
             numpy_helper.from_array(bv, "bv")]
    model, w = linear_model(kind, rng, after, ["q_b", "k", "v_b"], extra)
    x = rng.standard_normal((3, K)).astype(np.float32)
    want = session(model).run(None, {"x": x})
    assert fold_linear_biases(model) == 1
    assert collections.Counter(n.op_type for n in model.graph.node)["Add"] == 0
    got = session(model).run(None, {"x": x})
    for g, wa in zip(got, want, strict=True):
        np.testing.assert_allclose(g, wa, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], x @ w[:24].T + bq_, rtol=2e-2, atol=2e-2 * np.abs(got[0]).max())


def test_what_is_not_a_bias_is_left_alone():
    rng = np.random.default_rng(2)
    two_d = rng.standard_normal((1, N)).astype(np.float32)  # a broadcast [1, N] constant: not a bias vector
    model, _ = linear_model("dense", rng, [helper.make_node("Add", ["y", "c"], ["z"]),
                                           helper.make_node("Add", ["y", "y"], ["twice"])], ["z", "twice"],
                            [numpy_helper.from_array(two_d, "c")])
    assert fold_linear_biases(model) == 0 and len(model.graph.node) == 5


@needs_dense
def test_a_bias_of_the_wrong_size_is_an_error():
    rng = np.random.default_rng(3)
    model, _ = linear_model("dense", rng, [], ["y"], [numpy_helper.from_array(np.zeros(N - 1, np.float32), "bias")])
    model.graph.node[0].input.append("bias")
    with pytest.raises(Exception, match="the bias must hold N values"):
        session(model).run(None, {"x": np.zeros((1, K), np.float32)})


def test_a_qwen2_engine_keeps_no_bias_add(random_hf_model, engine_from_hf):
    engine = engine_from_hf(random_hf_model("qwen2"))
    graph = onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False).graph
    constants = {t.name for t in graph.initializer}
    layers = read_engine_config(engine).model.num_hidden_layers
    bias_adds = [n for n in graph.node if n.op_type == "Add" and constants & set(n.input)]  # the residual's stays
    if AVX512:  # DenseMatMul takes this float32 model's weights (AVX2 tiles take only 16-bit ones)
        assert f"linear_biases:{layers}" in read_engine_config(engine).passes  # each layer's fused q+k+v
        assert not bias_adds
        assert sum(n.op_type == "DenseMatMul" and len(n.input) == 3 for n in graph.node) == layers
    else:  # MatMul computes the float linears, and each fused q+k+v's bias stays one Add after it
        assert not [p for p in read_engine_config(engine).passes if p.startswith(("linear_biases", "dense_linears"))]
        producers = {o: n.op_type for n in graph.node for o in n.output}
        assert [producers.get(i) for n in bias_adds for i in n.input if i not in constants] == ["MatMul"] * layers
