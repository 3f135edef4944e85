"""The CPU engine's native 16-bit float linears: trtbuild::DenseMatMul / DenseGather (cpu_ops/dense_matmul.cc)
against their numpy reference, and the lowering (builder/dense_linears.py) that holds a float16 or bfloat16
checkpoint's linears and embedding in 16 bits, once, with the logits of the float32 MatMul engine."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import AVX512, DENSE, make_random_hf_model, needs_dense
from onnx import TensorProto, helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.bench.autotune import time_graph
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, CPU_WEIGHTS_FILE, read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.plugins import dense_matmul as dm

LIMITS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128)


def op_session(library: str, node: onnx.NodeProto, first: onnx.ValueInfoProto, out_dim: int | None,
               b: np.ndarray) -> ort.InferenceSession:
    """One node; `out_dim` None: an output of any shape."""
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None if out_dim is None else ["M", out_dim])
    graph = helper.make_graph([node], "g", [first], [y], [numpy_helper.from_array(b, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(dm.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_exact_type_and_packing():
    w = np.random.default_rng(0).standard_normal((37, 5)).astype(np.float32)
    assert dm.exact_type(w) == "float32"
    assert dm.exact_type(w.astype(np.float16).astype(np.float32)) == "float16"
    tiny = w * 1e-6  # below float16's normal range: exact in bfloat16 only
    assert dm.exact_type(tiny.astype(ml_dtypes.bfloat16).astype(np.float32)) == "bfloat16"
    b = dm.pack(w, "float32")
    assert b.shape == (3, 5, 16) and b[1, 2, 3] == w[19, 2] and not b[2, :, 5:].any()  # rows 37..47 are zero
    np.testing.assert_array_equal(dm.unpack(b, 37), w)


@needs_dense
@pytest.mark.parametrize("weight_type", ["float16", "bfloat16", "float32"])
def test_dense_matmul_matches_its_reference(library, weight_type):
    """Token counts around the tile of 8 and the task of 64; rows not a multiple of 16 (nor of a task's 32 or 128);
    K not a multiple of the 4 interleaved chains."""
    rng = np.random.default_rng(1)
    k, n = 77, 200
    w = rng.standard_normal((n, k)).astype(dm.WEIGHT_TYPES[weight_type]).astype(np.float32)
    b = dm.pack(w, weight_type)
    assert b.dtype == dm.WEIGHT_TYPES[weight_type]
    sess = op_session(library, helper.make_node(dm.OP_TYPE, ["x", "B"], ["y"], domain=dm.DOMAIN, K=k, N=n),
                      helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]), n, b)
    for m in (1, 2, 3, 7, 8, 9, 17, 64, 70, 130):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = dm.reference_dense_matmul(x, b, n)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert sess.run(None, {"x": np.zeros((0, k), np.float32)})[0].shape == (0, n)


@needs_dense
@pytest.mark.parametrize("weight_type", ["float16", "bfloat16", "float32"])
def test_dense_gather_reads_rows_of_the_packed_table(library, weight_type):
    k, n = 40, 37
    w = np.random.default_rng(2).standard_normal((n, k)).astype(dm.WEIGHT_TYPES[weight_type])
    b = dm.pack(w, weight_type)
    sess = op_session(library, helper.make_node(dm.GATHER_OP_TYPE, ["ids", "B"], ["y"], domain=dm.DOMAIN, K=k, N=n),
                      helper.make_tensor_value_info("ids", TensorProto.INT64, None), None, b)
    ids = np.array([0, 15, 16, 36, 5, 5], dtype=np.int64)
    np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0], dm.reference_dense_gather(ids, b, n))
    np.testing.assert_array_equal(sess.run(None, {"ids": ids.reshape(2, 3)})[0],  # Gather's shape: ids', then K
                                  dm.reference_dense_gather(ids, b, n).reshape(2, 3, k))
    with pytest.raises(Exception, match="id 37 is outside the table's 37"):
        sess.run(None, {"ids": np.array([37], dtype=np.int64)})


@needs_dense
def test_dense_matmul_refuses_what_it_cannot_run(library):
    node = helper.make_node(dm.OP_TYPE, ["x", "B"], ["y"], domain=dm.DOMAIN, K=32, N=20)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 32])
    with pytest.raises(Exception, match=r"B does not hold ceil\(N / 16\) groups"):
        op_session(library, node, x, 20, np.zeros((20, 32), np.float16)).run(None, {"x": np.zeros((1, 32), np.float32)})
    with pytest.raises(Exception, match="B must be float16, bfloat16 or float"):
        op_session(library, node, x, 20, np.zeros((2, 32, 16), np.int8)).run(None, {"x": np.zeros((1, 32),
                                                                                                   np.float32)})
    with pytest.raises(Exception, match="the last dimension of x is not K"):
        op_session(library, node, helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 31]), 20,
                   np.zeros((2, 32, 16), np.float16)).run(None, {"x": np.zeros((1, 31), np.float32)})


@pytest.mark.skipif(DENSE, reason="this CPU has AVX-512 or AVX2: the native ops run (the tests above)")
@pytest.mark.parametrize("op_type", [dm.OP_TYPE, dm.GATHER_OP_TYPE])
def test_dense_ops_refuse_a_cpu_without_their_instructions(library, op_type):
    """Without AVX-512 or AVX2 (the library built without its kernels) a session with either op is refused, saying
    how."""
    node = helper.make_node(op_type, ["x", "B"], ["y"], domain=dm.DOMAIN, K=32, N=20)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT if op_type == dm.OP_TYPE else TensorProto.INT64, None)
    with pytest.raises(Exception, match=f"trtbuild::{op_type}: this CPU has neither AVX-512 nor AVX2 with FMA and "
                                        "F16C; rebuild the engine with `--float-linears ort`"):
        op_session(library, node, x, None, dm.pack(np.zeros((20, 32), np.float32), "float16"))


@pytest.fixture(scope="module", params=["float16", "bfloat16"])
def checkpoint(request, tmp_path_factory):
    """A Qwen2 with tied embeddings (the lm_head reads the embedding table) and one without, in 16 bits."""
    work = tmp_path_factory.mktemp(f"dense_{request.param}")
    hf = make_random_hf_model("qwen2", work / "hf", overrides=dict(hidden_size=128, intermediate_size=224,
                                                                   tie_word_embeddings=True))
    convert(hf, work / "ckpt", dtype=request.param)
    return work / "ckpt"


def ops(engine_dir) -> list[str]:
    return [n.op_type for n in onnx.load(str(engine_dir / CPU_ENGINE_FILE), load_external_data=False).graph.node]


@needs_dense
def test_a_16_bit_checkpoint_runs_its_linears_natively_from_16_bit_weights_held_once(checkpoint, tmp_path):
    from test_native_linears import steps

    native = build_engine(checkpoint, tmp_path / "native", **LIMITS)
    ort_engine = build_engine(checkpoint, tmp_path / "ort", float_linears="ort", **LIMITS)
    assert read_engine_config(native).build.float_linears == "native"
    assert read_engine_config(ort_engine).build.float_linears == "ort"
    native_ops, ort_ops = ops(native), ops(ort_engine)
    linears = ort_ops.count("MatMul") + ort_ops.count("Gemm")
    assert native_ops.count("DenseMatMul") == linears > 0 and "MatMul" not in native_ops and "Gemm" not in native_ops
    assert native_ops.count("DenseGather") == 1 and "Gather" in ort_ops  # the embedding reads the lm_head's table
    sizes = [(e / CPU_WEIGHTS_FILE).stat().st_size for e in (native, ort_engine)]
    assert 0.45 < sizes[0] / sizes[1] < 0.56  # every matrix in 16 bits instead of 32, the tied table once
    for got, want in zip(steps(native), steps(ort_engine), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_float_linears_ort_where_native_does_not_apply(checkpoint, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="float_linears must be one of auto, native, ort"):
        build_engine(checkpoint, tmp_path / "bad", float_linears="fast", **LIMITS)
    monkeypatch.setattr(cpu_ops, "runs_dense", lambda: False)
    assert read_engine_config(build_engine(checkpoint, tmp_path / "a", **LIMITS)).build.float_linears == "ort"
    with pytest.raises(ConfigError, match="native cannot be used: this CPU has neither AVX-512 nor AVX2"):
        build_engine(checkpoint, tmp_path / "b", float_linears="native", **LIMITS)


@needs_dense
def test_a_float32_checkpoint_runs_its_linears_natively_on_float32_weights(tmp_path):
    """Weights that no 16-bit type holds keep their float32 bytes in the packed table: same file size, the same
    logits as MatMul up to summation order. With AVX2 only, such weights stay MatMuls (MLAS's SGEMM is faster on
    them there), and native is refused saying so."""
    from test_native_linears import steps

    hf = make_random_hf_model("qwen2", tmp_path / "hf", overrides=dict(hidden_size=64, intermediate_size=96))
    convert(hf, tmp_path / "ckpt")
    if not AVX512:
        assert read_engine_config(build_engine(tmp_path / "ckpt", tmp_path / "a", **LIMITS)).build.float_linears == \
            "ort"
        with pytest.raises(ConfigError, match="no linear or embedding has 16-bit weights, the only ones this CPU's "
                                              r"DenseMatMul \(AVX2\) takes"):
            build_engine(tmp_path / "ckpt", tmp_path / "b", float_linears="native", **LIMITS)
        return
    native = build_engine(tmp_path / "ckpt", tmp_path / "native", **LIMITS)
    ort_engine = build_engine(tmp_path / "ckpt", tmp_path / "ort", float_linears="ort", **LIMITS)
    assert read_engine_config(native).build.float_linears == "native"
    native_ops, ort_ops = ops(native), ops(ort_engine)
    assert native_ops.count("DenseMatMul") == ort_ops.count("MatMul") + ort_ops.count("Gemm") > 0
    model = onnx.load(str(native / CPU_ENGINE_FILE), load_external_data=False)
    packed = [t for t in model.graph.initializer if t.name.endswith((".dense", ".dense_t"))]
    assert packed and {t.data_type for t in packed} == {TensorProto.FLOAT}
    sizes = [(e / CPU_WEIGHTS_FILE).stat().st_size for e in (native, ort_engine)]
    assert 0.98 < sizes[0] / sizes[1] < 1.05  # the same bytes, padded to 16 rows
    for got, want in zip(steps(native), steps(ort_engine), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_autotune_times_native_and_ort_float_linears(checkpoint, tmp_path):
    engine = build_engine(checkpoint, tmp_path / "tuned", autotune="fast", timer=time_graph, **LIMITS)
    info = read_engine_config(engine)
    tactic = info.tactics["float_linears"]
    if DENSE:
        assert tactic["source"] == "measured" and set(tactic["timings_ms"]) == {"native", "ort"}
    else:  # native cannot run here: MatMul is the only candidate, nothing to time
        assert tactic == {"chosen": "ort", "timings_ms": {}, "source": "only candidate"}
    assert info.build.float_linears == tactic["chosen"]
    assert ("DenseMatMul" in ops(engine)) == (tactic["chosen"] == "native")


def test_verify_checks_the_dense_linears(checkpoint, tmp_path):
    from trtbuild.bench.verify import verify_engine

    report = verify_engine(build_engine(checkpoint, tmp_path / "e", **LIMITS), checkpoint, num_threads=1)
    report.check()
