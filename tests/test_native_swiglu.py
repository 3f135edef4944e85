"""The CPU lowering of the MLP's SwiGLU / GeGLU onto trtbuild::SwiGLU / trtbuild::GeGLU (builder/native_swiglu.py):
which patterns it takes, what it leaves, and that an engine without native tactics keeps the standard ops (it must
not need the library)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.native_swiglu import lower_swiglu
from trtbuild.plugins import swiglu as sw


def _gated_mlp(activation: list[onnx.NodeProto], act: str, extra_gate_use: bool, sizes: tuple[int, int],
               opset: int) -> onnx.ModelProto:
    """x [T, 12] -> Split -> `activation` nodes (gate -> act) -> act * up (-> and gate * 2 when `extra_gate_use`)."""
    nodes = [helper.make_node("Split", ["x", "sizes"], ["gate", "up"], axis=-1), *activation,
             helper.make_node("Mul", ["up", act] if act == "silu" else [act, "up"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 6])]
    if extra_gate_use:
        nodes.append(helper.make_node("Add", ["gate", "gate"], ["twice"]))
        outputs.append(helper.make_tensor_value_info("twice", TensorProto.FLOAT, ["T", 6]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 12])],
                              outputs, [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mlp(extra_gate_use: bool = False, sizes: tuple[int, int] = (6, 6)) -> onnx.ModelProto:
    """x [T, 12] -> Split -> silu(gate) * up (-> and gate * 2 when `extra_gate_use`)."""
    silu = [helper.make_node("Sigmoid", ["gate"], ["sig"]),
            helper.make_node("Mul", ["sig", "gate"], ["silu"])]  # either operand order
    return _gated_mlp(silu, "silu", extra_gate_use, sizes, 18)


def geglu_mlp(approximate: str | None = "tanh", extra_gate_use: bool = False, sizes: tuple[int, int] = (6, 6)
              ) -> onnx.ModelProto:
    """x [T, 12] -> Split -> Gelu(gate, approximate) * up (-> and gate * 2 when `extra_gate_use`), as Gemma's MLP."""
    gelu = helper.make_node("Gelu", ["gate"], ["act"], **({"approximate": approximate} if approximate else {}))
    return _gated_mlp([gelu], "act", extra_gate_use, sizes, 23)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x})[0]


def test_the_pattern_becomes_one_node_with_the_same_output():
    x = np.random.default_rng(0).standard_normal((5, 12)).astype(np.float32)
    model = mlp()
    want = run(model, x)
    assert lower_swiglu(model) == 1
    onnx.checker.check_model(model)
    assert [(n.op_type, n.domain) for n in model.graph.node] == [(sw.OP_TYPE, sw.DOMAIN)]
    assert not model.graph.initializer  # the split sizes went with the Split
    np.testing.assert_allclose(run(model, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", [mlp(extra_gate_use=True), mlp(sizes=(4, 8))], ids=["gate_used_twice", "unequal"])
def test_what_is_not_exactly_swiglu_is_left_alone(model):
    before = collections.Counter(n.op_type for n in model.graph.node)
    assert lower_swiglu(model) == 0
    assert collections.Counter(n.op_type for n in model.graph.node) == before


def test_a_tanh_gelu_gated_mlp_becomes_one_geglu_node_with_the_same_output():
    x = (np.random.default_rng(1).standard_normal((5, 12)) * 4).astype(np.float32)
    x[0, 0], x[1, 1] = -30.0, 30.0  # the gelu's tails
    model = geglu_mlp()
    want = run(model, x)
    np.testing.assert_allclose(want, sw.reference_geglu(x), rtol=1e-5, atol=1e-5)  # ORT's Gelu is the tanh form
    assert lower_swiglu(model) == 1
    onnx.checker.check_model(model)
    assert [(n.op_type, n.domain) for n in model.graph.node] == [(sw.GEGLU_OP_TYPE, sw.DOMAIN)]
    assert not model.graph.initializer
    np.testing.assert_allclose(run(model, x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model", [geglu_mlp(None), geglu_mlp("none"), geglu_mlp(extra_gate_use=True),
                                   geglu_mlp(sizes=(4, 8))], ids=["erf_gelu", "none_gelu", "gate_used_twice",
                                                                  "unequal"])
def test_what_is_not_exactly_geglu_is_left_alone(model):
    before = collections.Counter(n.op_type for n in model.graph.node)
    assert lower_swiglu(model) == 0
    assert collections.Counter(n.op_type for n in model.graph.node) == before


def test_engines_lower_swiglu_only_with_a_native_tactic(random_hf_model, engine_from_hf):
    hf = random_hf_model("qwen2")
    layers = 2
    for options, expected in ((dict(), layers),
                              (dict(attention="split", quant_linears="ort", float_linears="ort"), 0)):
        engine = engine_from_hf(hf, **options)
        ops = collections.Counter(n.op_type for n in onnx.load(str(engine / CPU_ENGINE_FILE),
                                                                 load_external_data=False).graph.node)
        assert ops["SwiGLU"] == expected and ops["Sigmoid"] == layers - expected


def glu_session(library: str, op_type: str = sw.OP_TYPE, **attrs: float) -> ort.InferenceSession:
    """One trtbuild::SwiGLU (or `op_type`) node with `attrs`, x of any shape."""
    graph = helper.make_graph([helper.make_node(op_type, ["x"], ["y"], domain=sw.DOMAIN, **attrs)], "glu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(sw.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _beyond_the_limit(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Gate and up values from well inside to far past +-7, gpt-oss's limit (and sigmoid's tails)."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 8).astype(np.float32)
    f = shape[-1] // 2
    rows = x.reshape(-1, 2, f)  # (gate, up) of each row
    rows[0, :, 0] = (-100.0, 100.0)  # sigmoid's far tail; up far past the limit
    rows[-1, :, -1] = (100.0, -100.0)  # a gate far past it; up far below -limit
    at = (7.0, 6.999, 7.001, -7.0)[:f]  # at the limit
    rows[-1, 0, :len(at)], rows[-1, 1, :len(at)] = at, at
    return x


@pytest.mark.parametrize("attrs", [sw.GPT_OSS_SWIGLU, {sw.LIMIT: 7.0}, {sw.ALPHA: 1.702}, {sw.BETA: 1.0},
                                   {sw.ALPHA: 0.5, sw.BETA: -2.0, sw.LIMIT: 0.25}],
                         ids=["gpt_oss", "limit", "alpha", "beta", "all"])
def test_the_clamped_form_matches_its_reference(library, attrs):
    """gpt-oss's SwiGLU (alpha, beta, limit) and each attribute alone, on widths around the 16-lane vectors and a 3-D
    input, gates and ups beyond the limit included."""
    sess = glu_session(library, **attrs)
    want_attrs = {k: float(np.float32(v)) for k, v in attrs.items()}  # the attributes arrive as float32
    for seed, shape in enumerate([(1, 2), (3, 30), (9, 32), (5, 2 * 2880), (2, 3, 66)]):
        x = _beyond_the_limit(shape, seed)
        got = sess.run(None, {"x": x})[0]
        assert got.shape == (*shape[:-1], shape[-1] // 2)
        np.testing.assert_allclose(got, sw.reference_swiglu(x, **want_attrs), rtol=1e-6, atol=1e-6)
    if sw.LIMIT in attrs:  # nothing past the limit changes y
        x = _beyond_the_limit((4, 64), 9)
        limit = attrs[sw.LIMIT]
        gate, up = np.split(x, 2, axis=-1)
        clamped = np.concatenate([np.minimum(gate, limit), np.clip(up, -limit, limit)], axis=-1)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], sess.run(None, {"x": clamped})[0])


def test_the_default_attributes_are_plain_swiglu(library):
    """alpha 1, beta 0 and no limit (absent or given) compute exactly what SwiGLU always has."""
    x = _beyond_the_limit((7, 2 * 100), 3)
    plain = glu_session(library).run(None, {"x": x})[0]
    np.testing.assert_allclose(plain, sw.reference_swiglu(x), rtol=1e-6, atol=1e-6)
    given = glu_session(library, **{sw.ALPHA: 1.0, sw.BETA: 0.0, sw.LIMIT: float("inf")}).run(None, {"x": x})[0]
    np.testing.assert_array_equal(given, plain)


@pytest.mark.parametrize("limit", [0.0, -7.0, float("nan")])
def test_a_limit_that_is_not_positive_is_refused(library, limit):
    with pytest.raises(Exception, match="limit must be positive"):
        glu_session(library, **{sw.LIMIT: limit}).run(None, {"x": np.zeros((1, 4), np.float32)})
