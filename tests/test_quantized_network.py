"""Quantized networks: standard Q/DQ before lowering, sibling fusion, pre-scale folding, int8_wo, build refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from quant_helpers import quantize_checkpoint
from quantized_engine_helpers import LAYERS, OPTIONS, _ops, rel_err

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.builder.network import build_network
from trtbuild.configs import BuildConfig
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.errors import TrtbuildError


@pytest.mark.parametrize("algo", ["fp8", "int4_awq", "int8_sq"])
def test_unfused_network_is_standard_qdq(algo, base, tmp_path):
    ckpt, amax = base("qwen2")
    config, tensors = load_checkpoint(quantize_checkpoint(ckpt, tmp_path / "ckpt", algo, "int8", amax))
    model = build_network(config, tensors, BuildConfig(**OPTIONS))
    onnx.checker.check_model(model, full_check=True)
    weight_dq = [n for n in model.graph.node if n.name.endswith("_weight_dequant")]
    assert len(weight_dq) == 7 * LAYERS
    inits = {t.name: t for t in model.graph.initializer}
    want = {"fp8": TensorProto.FLOAT8E4M3FN, "int4_awq": TensorProto.INT4, "int8_sq": TensorProto.INT8}[algo]
    assert {inits[n.input[0]].data_type for n in weight_dq} == {want}
    attrs = {a.name: a.i for a in weight_dq[0].attribute}
    assert attrs == {"fp8": {}, "int4_awq": {"axis": 0, "block_size": 32}, "int8_sq": {"axis": 1}}[algo]
    act_quant = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(act_quant) == (0 if algo == "int4_awq" else 4 * LAYERS)  # shared by Q/K/V and by gate/up
    assert len([n for n in model.graph.node if n.name.endswith("_prescale")]) == (0 if algo == "fp8" else 4 * LAYERS)
    paged = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert {a.name for a in paged[0].attribute} >= {"kv_cache_quant_algo", "kv_cache_scale"}
    assert model.graph.input[-1].type.tensor_type.elem_type == TensorProto.INT8


@pytest.mark.parametrize("quant, message", [
    ({"quant_algo": "w4a8_awq"}, "w4a8_awq"),
    ({"quant_algo": "int4_awq", "group_size": 8, "pre_quant_scale": True}, "group_size 8"),
    ({"quant_algo": "int4_awq", "group_size": 48, "pre_quant_scale": True}, "group_size 48"),
    ({"kv_cache_quant_algo": "int4"}, "int4"),
])
def test_build_refuses_unsupported_quantization(quant, message, base, tmp_path):
    import json
    import shutil

    ckpt, _ = base("llama")
    shutil.copytree(ckpt, tmp_path / "ckpt")
    doc = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    doc["quantization"].update(quant)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(TrtbuildError, match=message):
        build_engine(tmp_path / "ckpt", tmp_path / "engine", **OPTIONS)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("algo", ["int4_awq", "int8_sq"])
def test_siblings_fuse_only_with_identical_scales(algo, base, tmp_path):
    """Q/K/V and gate/up become one kernel only when their pre-scales (and int8 activation scales) are identical;
    with one differing scale the others still fuse and the odd one gets its own Mul / Q/DQ and kernel."""
    from trtbuild.builder.passes.lower_quant_cpu import lower_quantized_linears

    ckpt, amax = base("llama")
    kernel = {"int4_awq": "MatMulNBits", "int8_sq": "MatMulIntegerToFloat"}[algo]
    config, tensors = load_checkpoint(quantize_checkpoint(ckpt, tmp_path / "ckpt", algo, None, amax))
    assert config.quantization.shared_input_scales
    odd = "transformer.layers.0.attention.v.prequant_scaling_factor"
    counts = {}
    for label, changed in (("shared", {}), ("one differs", {odd: tensors[odd] * 1.5})):
        t = {**tensors, **changed}
        c = dataclasses.replace(config, quantization=dataclasses.replace(config.quantization,
                                                                         shared_input_scales=not changed))
        model = build_network(c, t, BuildConfig(**OPTIONS))
        prescales = len([n for n in model.graph.node if n.name.endswith("_prescale")])
        lower_quantized_linears(model, 1)
        counts[label] = prescales, _ops(model)[kernel]
    assert counts == {"shared": (4 * LAYERS, 4 * LAYERS), "one differs": (4 * LAYERS + 1, 4 * LAYERS + 1)}


@pytest.mark.parametrize("algo,per_token", [("int4_awq", False), ("int8_sq", False), ("int8_sq", True)])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "own_scales"])
def test_prescale_folds_into_norms_and_up_projection(algo, per_token, shared, base, tmp_path):
    """fold_prescale removes the q/k/v and gate/up pre-scale Muls into the RMSNorm weights when the siblings share
    them, and the down projection's into the up projection's output scales always; the o projection's stays (its
    input comes from attention). The engines of CASES, built with every pass, match the format to RTOL."""
    from trtbuild.builder.passes.fold_prescale import fold_prescale

    ckpt, amax = base("llama")
    q = quantize_checkpoint(ckpt, tmp_path / "ckpt", algo, None, amax, shared_prequant=shared, per_token=per_token)
    config, tensors = load_checkpoint(q)
    model = build_network(config, tensors, BuildConfig(**OPTIONS))
    prescales = lambda: sorted(n.name.split(".", 3)[-1] for n in model.graph.node  # noqa: E731
                               if n.op_type == "Mul" and n.name.endswith("_prescale"))
    per_layer = ["attention.dense_prescale"] + ([] if shared else [
        "attention.k_prescale", "attention.q_prescale", "attention.v_prescale", "mlp.fc_prescale",
        "mlp.gate_prescale"])
    before = prescales()
    assert fold_prescale(model) == len(before) - LAYERS * len(per_layer)
    assert prescales() == sorted(per_layer * LAYERS)
    onnx.checker.check_model(model)
    up_scale = numpy_helper.to_array(next(t for t in model.graph.initializer
                                          if t.name == "transformer.layers.0.mlp.fc.weights_scaling_factor"))
    want = tensors["transformer.layers.0.mlp.fc.weights_scaling_factor"].float().numpy()
    s = tensors["transformer.layers.0.mlp.proj.prequant_scaling_factor"].float().numpy().reshape(-1)
    np.testing.assert_allclose(up_scale, want.T * s if algo == "int4_awq" else want.reshape(-1) * s, rtol=1e-6)


def test_build_refuses_a_false_shared_scales_flag(base, tmp_path):
    """`shared_input_scales: true` promises identical sibling scales (engines that trust it fuse the GEMMs)."""
    import json

    ckpt, amax = base("llama")
    q = quantize_checkpoint(ckpt, tmp_path / "ckpt", "int4_awq", None, amax, shared_prequant=False)
    doc = json.loads((q / "config.json").read_text())
    assert doc["quantization"]["shared_input_scales"] is False
    doc["quantization"]["shared_input_scales"] = True
    (q / "config.json").write_text(json.dumps(doc))
    with pytest.raises(TrtbuildError, match="shared_input_scales=true but transformer.layers.0.attention.q.prequant"):
        build_engine(q, tmp_path / "engine", **OPTIONS)
    assert not (tmp_path / "engine").exists()


def test_build_refuses_an_unknown_int4_accuracy_level(base, tmp_path):
    with pytest.raises(TrtbuildError, match="^int4_accuracy_level must be one of 1, 4, got 2"):
        build_engine(base("llama")[0], tmp_path / "engine", **{**OPTIONS, "int4_accuracy_level": 2})


def test_per_token_unfused_network_is_standard_onnx(base, tmp_path):
    """int8_sq with per-token activations: blocked Q/DQ (one block = the whole last axis) with the scale computed
    from x, one per sibling group; the full ONNX checker passes. The CPU lowering leaves no DequantizeLinear: one
    blocked QuantizeLinear to uint8 (zero point 128) per group feeds an integer GEMM."""
    from trtbuild.builder.passes.lower_quant_cpu import lower_quantized_linears

    ckpt, amax = base("qwen2")
    config, tensors = load_checkpoint(quantize_checkpoint(ckpt, tmp_path / "ckpt", "int8_sq", None, amax,
                                                          per_token=True))
    assert config.quantization.per_token_activations
    assert not any(n.endswith("activation_scaling_factor") for n in tensors)
    model = build_network(config, tensors, BuildConfig(**OPTIONS))
    onnx.checker.check_model(model, full_check=True)
    act_quant = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(act_quant) == 4 * LAYERS  # shared by Q/K/V and by gate/up (their pre-scales are equal here)
    hidden = config.hidden_size
    assert {a.name: a.i for a in act_quant[0].attribute} == {"axis": -1, "block_size": hidden,
                                                             "output_dtype": TensorProto.INT8}
    assert lower_quantized_linears(model, 1) == 7 * LAYERS
    ops = _ops(model)
    assert ops["DequantizeLinear"] == 0 and ops["QuantizeLinear"] == ops["MatMulIntegerToFloat"] == 4 * LAYERS
    for quant in (n for n in model.graph.node if n.op_type == "QuantizeLinear"):
        width = config.intermediate_size if ".mlp.proj" in quant.name else hidden  # the GEMM's input features
        assert len(quant.input) == 3 and {a.name: a.i for a in quant.attribute} == {"axis": -1, "block_size": width}


def test_build_refuses_per_token_with_tensor_parallelism(base):
    from trtbuild.builder.quantized import check_quantization
    from trtbuild.configs.model_config import Mapping

    config, _ = load_checkpoint(base("llama")[0])
    quant = QuantConfig("int8_sq", pre_quant_scale=True, per_token_activations=True)
    check_quantization(dataclasses.replace(config, quantization=quant), BuildConfig(**OPTIONS))
    with pytest.raises(TrtbuildError, match="per-token activation scales need tp_size 1"):
        check_quantization(dataclasses.replace(config, quantization=quant, mapping=Mapping(tp_size=2)),
                           BuildConfig(**OPTIONS))


@pytest.mark.parametrize("k", [64, 24])
def test_int8_weight_only_lowering(k):
    """int8_wo: MatMul(x, DequantizeLinear(int8 W [K, N], per-channel scales)) becomes an 8-bit MatMulNBits (the
    scales repeated per block) when a power-of-two block from 16 to 256 divides K; otherwise the standard DQ -> MatMul
    stays. Both compute x @ (W * s) in ONNX Runtime."""
    import onnxruntime as ort
    from onnx import helper

    from trtbuild.builder.passes.lower_quant_cpu import lower_quantized_linears

    rng = np.random.default_rng(k)
    n = 40
    w = rng.integers(-127, 128, size=(k, n)).astype(np.int8)
    s = rng.uniform(1e-3, 1e-2, size=n).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["W", "s"], ["Wf"], name="head_weight_dequant", axis=1),
         helper.make_node("MatMul", ["x", "Wf"], ["y"], name="head")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(s, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert lower_quantized_linears(model, 1) == (1 if k % 16 == 0 else 0)
    ops = _ops(model)
    assert (ops["MatMulNBits"], ops["DequantizeLinear"]) == ((1, 0) if k % 16 == 0 else (0, 1))
    x = rng.standard_normal((5, k)).astype(np.float32)
    options = ort.SessionOptions()  # as CpuEngine runs an engine built with int4_accuracy_level 1 (see there)
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    y = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    want = x.astype(np.float64) @ (w * s.astype(np.float64))
    assert rel_err(y, want) <= 1e-5


@pytest.mark.parametrize("signed", [True, False])
def test_int8_lowering_sums_exactly_where_it_is_chosen(signed):
    """int8 x int8: MatMul(DQ(Q(x)), DQ(W)) becomes MatMulIntegerToFloat, with int8 weights (exact only where the
    u8s8 GEMM accumulates in int32: AVX-512 VNNI) or uint8 ones with zero point 128 (exact everywhere). Full-range
    weights against activations far from zero: the inputs that saturate an int16 pair sum."""
    import onnxruntime as ort
    from onnx import helper

    from trtbuild.builder.engine_dir import cpu_features
    from trtbuild.builder.passes.lower_quant_cpu import lower_quantized_linears, u8s8_exact

    if signed and not u8s8_exact(cpu_features()):
        pytest.skip("this CPU's u8s8 GEMM saturates int16 pair sums (no AVX-512 VNNI): builds here use uint8 weights")
    rng = np.random.default_rng(0)
    k, n = 64, 48
    w = rng.choice(np.array([-127, -100, 100, 127], np.int8), size=(k, n))
    s_x, s_w = np.float32(0.01), rng.uniform(1e-3, 1e-2, size=n).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "sx"], ["xq"], name="act_quant"),
         helper.make_node("DequantizeLinear", ["xq", "sx"], ["xd"], name="act_dequant"),
         helper.make_node("DequantizeLinear", ["W", "sw"], ["Wf"], name="fc_weight_dequant", axis=1),
         helper.make_node("MatMul", ["xd", "Wf"], ["y"], name="fc")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(s_w, "sw"),
         numpy_helper.from_array(np.array(s_x), "sx"),
         numpy_helper.from_array(np.array(0, np.int8), "zero")])
    graph.node[0].input.append("zero")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    assert lower_quantized_linears(model, 1, signed_int8_weights=signed) == 1
    (gemm,) = [node for node in model.graph.node if node.op_type == "MatMulIntegerToFloat"]
    assert (len(gemm.input) == 6) != signed  # uint8 weights carry their zero point
    x = (rng.choice([-1, 1], size=(8, k)) * rng.integers(100, 128, size=(8, k)) * s_x).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    exact = (np.round(x / s_x).astype(np.int64) @ w.astype(np.int64)) * (s_x * s_w.astype(np.float64))
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-4)
