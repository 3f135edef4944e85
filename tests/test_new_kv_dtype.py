"""new_kv in the KV pool's element type (builder/new_kv_dtype.py): a float16 pool's engine returns float16 K/V, cast
right after each layer makes them, and runs exactly as the engine that returned float32 and was rounded on write."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from trtbuild.builder import new_kv_dtype
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.builder.new_kv_dtype import new_kv_in_pool_dtype
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group


def two_layer_graph(pool_type: int) -> onnx.ModelProto:
    """x -> per layer K = x * (layer + 1), V = x + layer; new_kv = Reshape(Concat(K0, V0, K1, V1)), beside a pool."""
    nodes, kv = [], []
    for layer in range(2):
        scale = helper.make_tensor(f"s{layer}", TensorProto.FLOAT, [], [layer + 1.0])
        nodes += [helper.make_node("Constant", [], [f"s{layer}"], value=scale),
                  helper.make_node("Mul", ["x", f"s{layer}"], [f"k{layer}"], name=f"k{layer}"),
                  helper.make_node("Add", ["x", f"s{layer}"], [f"v{layer}"], name=f"v{layer}")]
        kv += [f"k{layer}", f"v{layer}"]
    shape = helper.make_tensor("shape", TensorProto.INT64, [5], [2, 2, -1, 1, 4])
    nodes += [helper.make_node("Concat", kv, ["stacked"], axis=0, name="stack"),
              helper.make_node("Constant", [], ["shape_c"], value=shape),
              helper.make_node("Reshape", ["stacked", "shape_c"], ["new_kv"], name="new_kv"),
              helper.make_node("Identity", ["x"], ["logits"], name="logits")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 1, 4]),
                                           helper.make_tensor_value_info("kv_cache", pool_type, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", 1, 4]),
                               helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, [2, 2, "T", 1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    pool_type = model.graph.input[1].type.tensor_type.elem_type
    pool = np.zeros(1, helper.tensor_dtype_to_np_dtype(pool_type))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["new_kv"], {"x": x, "kv_cache": pool})[0]


def test_a_float16_pool_gets_float16_new_kv_cast_after_each_producer():
    x = np.random.default_rng(0).normal(size=(3, 1, 4)).astype(np.float32) * 100
    model = two_layer_graph(TensorProto.FLOAT16)
    expected = run(model, x)
    assert new_kv_in_pool_dtype(model) == 4
    onnx.checker.check_model(model)
    got = run(model, x)
    assert got.dtype == np.float16 and np.array_equal(got, expected.astype(np.float16))
    order = [n.name for n in model.graph.node]
    for name in ("k0", "v0", "k1", "v1"):  # each cast follows its producer at once
        assert order[order.index(name) + 1] == f"new_kv_float16_{'kv'.index(name[0]) + 2 * int(name[1])}"


def test_float32_pools_and_foreign_graphs():
    model = two_layer_graph(TensorProto.FLOAT)
    before = model.SerializeToString()
    assert new_kv_in_pool_dtype(model) == 0 and model.SerializeToString() == before
    broken = two_layer_graph(TensorProto.FLOAT16)
    next(n for n in broken.graph.node if n.name == "stack").op_type = "Sum"
    with pytest.raises(ValueError, match="new_kv is not a Reshape of a Concat"):
        new_kv_in_pool_dtype(broken)


def test_gemma3_engine_steps_exactly_as_without_the_cast(random_hf_model, tmp_path, monkeypatch):
    """Hybrid KV groups, float16 pool, native attention: logits and the pool after a prefill of two sequences and a
    decode step are bit for bit those of the engine built without the cast (float32 new_kv, rounded on write)."""
    convert(random_hf_model("gemma3"), tmp_path / "ckpt")
    options = dict(max_seq_len=64, tokens_per_block=4, max_batch_size=2, max_num_tokens=64, kv_pool_dtype="float16")
    with_cast = build_engine(tmp_path / "ckpt", tmp_path / "cast", **options)
    monkeypatch.setattr(new_kv_dtype, "new_kv_in_pool_dtype", lambda model: 0)
    without = build_engine(tmp_path / "ckpt", tmp_path / "plain", **options)
    info = read_engine_config(with_cast)
    assert {o["name"]: o["dtype"] for o in info.io["outputs"]}["new_kv"] == "float16"
    assert any(p.startswith("new_kv_float16:") for p in info.passes)
    assert {o["name"]: o["dtype"] for o in read_engine_config(without).io["outputs"]}["new_kv"] == "float32"

    groups, per_group = len(info.kv_cache_groups), 8
    steps = [[SequenceChunk(0, list(range(5, 19)), 0, 14, [0, 1, 2, 3]),
              SequenceChunk(1, list(range(40, 49)), 0, 9, [4, 5, 6])],
             [SequenceChunk(0, [7], 14, 1, [0, 1, 2, 3]), SequenceChunk(1, [9], 9, 1, [4, 5, 6])]]
    results = []
    for engine_dir in (with_cast, without):
        engine = CpuEngine(engine_dir, num_threads=1, num_blocks=groups * per_group)
        logits = [engine.step(in_every_group(chunks, groups, per_group)) for chunks in steps]
        results.append((logits, engine.kv.pool.copy()))
    (cast_logits, cast_pool), (plain_logits, plain_pool) = results
    assert cast_pool.dtype == np.float16 and np.array_equal(cast_pool, plain_pool)
    assert all(np.array_equal(a, b) for a, b in zip(cast_logits, plain_logits, strict=True))
