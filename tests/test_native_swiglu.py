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
