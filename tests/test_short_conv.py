"""trtbuild::PagedShortConv's native CPU kernel (cpu_ops/short_conv.cc) and its standard-op lowering
(builder/lower_short_conv.py) run by ONNX Runtime against the numpy reference of plugins/short_conv.py.

One packed batch mixes decode tokens, a fresh prefill, continuing prefill chunks (past > 0) and a short past shorter
than the kernel, over shuffled block tables of 4-token blocks (so a token's taps cross blocks), with rows that take
one slot exactly or are zero-padded over 2 or 3, float32 and float16 pools, with and without a bias. Table entries
before each sequence's window point at a block of NaNs (the runtime's released entries read block 0): the
op must never read them."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import F16C
from onnx import TensorProto, helper

from trtbuild import cpu_ops
from trtbuild.builder.lower_cpu import lower_paged_attention
from trtbuild.plugins import short_conv as sc

KV_HEADS, HEAD, BLOCK, NUM_BLOCKS, WIDTH = 2, 4, 4, 24, 4  # a slot holds 2 x 2 x 4 = 16 values a token
RELEASED_BLOCK = 0
# (past length, new tokens): decode across a block edge, fresh prefill, continuing chunk, decode opening a block,
# a chunk whose first taps reach before position 0, a second token's decode
SEQS = [(9, 1), (0, 6), (5, 4), (4, 1), (2, 3), (1, 1)]

native = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                            reason=f"the native CPU op library is unavailable: {cpu_ops.unavailable_reason()}")


def model(hidden: int, kernel: int, slots: int, layer: int, half: bool, bias: str) -> onnx.ModelProto:
    """One PagedShortConv node, every input a graph input; `bias`: "input", "absent" (6 inputs) or "empty" (a name
    of "")."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    pool_type = TensorProto.FLOAT16 if half else f32
    entries = sc.entries_per_row(hidden, KV_HEADS, HEAD)
    inputs = [helper.make_tensor_value_info("x", f32, ["T", hidden]),
              helper.make_tensor_value_info("kv_cache", pool_type, ["blocks", slots, 2, KV_HEADS, BLOCK, HEAD]),
              helper.make_tensor_value_info("block_tables", i64, ["B", WIDTH]),
              helper.make_tensor_value_info("past_lengths", i64, ["B"]),
              helper.make_tensor_value_info("query_start_loc", i64, ["B1"]),
              helper.make_tensor_value_info("weight", f32, [hidden, kernel])]
    names = [i.name for i in inputs]
    if bias == "input":
        inputs.append(helper.make_tensor_value_info("bias", f32, [hidden]))
        names.append("bias")
    elif bias == "empty":
        names.append("")
    node = helper.make_node(sc.OP_TYPE, names, list(sc.OUTPUTS), domain=sc.DOMAIN, layer_idx=layer)
    outputs = [helper.make_tensor_value_info("y", f32, ["T", hidden]),
               helper.make_tensor_value_info("new_entries", f32, [entries, 2, "T", KV_HEADS, HEAD])]
    graph = helper.make_graph([node], "short_conv", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(sc.DOMAIN, 1)])


def run(m: onnx.ModelProto, feeds: dict[str, np.ndarray], library: bool = True) -> list[np.ndarray]:
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(str(cpu_ops.library_path()))
    options.intra_op_num_threads = 3
    session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(list(sc.OUTPUTS), {k: v for k, v in feeds.items() if k in names})


def batch(hidden: int, kernel: int, slots: int, half: bool, seed: int) -> dict[str, np.ndarray]:
    """Random x, weight, bias and pool; shuffled tables whose entries before each window read RELEASED_BLOCK."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((NUM_BLOCKS, slots, 2, KV_HEADS, BLOCK, HEAD)).astype(np.float32)
    pool = pool.astype(np.float16) if half else pool
    pool[RELEASED_BLOCK] = np.nan  # a NaN in y if ever read
    perm = rng.permutation(np.arange(1, NUM_BLOCKS))
    tables = np.full((len(SEQS), WIDTH), perm[-1], dtype=np.int64)  # padding entries point at a free block
    taken = 0
    for b, (past, new) in enumerate(SEQS):
        needed = -(-(past + new) // BLOCK)
        tables[b, :needed] = perm[taken:taken + needed]
        taken += needed
        tables[b, :max(0, past - kernel + 1) // BLOCK] = RELEASED_BLOCK  # blocks wholly before the first tap
    assert (tables == RELEASED_BLOCK).any(), "some taps should start past a released block"
    tokens = sum(n for _, n in SEQS)
    return {
        "x": rng.standard_normal((tokens, hidden)).astype(np.float32),
        "kv_cache": pool,
        "block_tables": tables,
        "past_lengths": np.array([p for p, _ in SEQS], dtype=np.int64),
        "query_start_loc": np.concatenate([[0], np.cumsum([n for _, n in SEQS])]).astype(np.int64),
        "weight": (rng.standard_normal((hidden, kernel)) * 0.5).astype(np.float32),
        "bias": rng.standard_normal(hidden).astype(np.float32),
    }


# (hidden, kernel, slots, layer_idx, bias): rows over 2 padded slots, 3 padded slots, or exactly 1
CASES = [(20, 3, 4, 1, "input"), (40, 4, 6, 2, "absent"), (16, 4, 3, 2, "input"), (16, 3, 2, 0, "empty"),
         (40, 3, 4, 1, "input"), (20, 4, 2, 0, "empty")]


@native
@pytest.mark.parametrize("half", [False, True], ids=["float32_pool", "float16_pool"])
@pytest.mark.parametrize(("hidden", "kernel", "slots", "layer", "bias"), CASES,
                         ids=[f"H{c[0]}_L{c[1]}_layer{c[3]}_bias_{c[4]}" for c in CASES])
def test_native_short_conv_matches_reference(hidden, kernel, slots, layer, bias, half):
    if half and not F16C:
        pytest.skip("this CPU has no F16C, which the native op widens a float16 pool with")
    data = batch(hidden, kernel, slots, half, seed=hidden * 10 + kernel + layer)
    y, entries = run(model(hidden, kernel, slots, layer, half, bias), data)
    want_y, want_entries = sc.reference_short_conv(
        data["x"], data["kv_cache"], data["block_tables"], data["past_lengths"], data["query_start_loc"],
        data["weight"], data["bias"] if bias == "input" else None, layer_idx=layer)
    assert entries.shape == (sc.entries_per_row(hidden, KV_HEADS, HEAD), 2, len(data["x"]), KV_HEADS, HEAD)
    np.testing.assert_array_equal(entries, want_entries)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)


@native
def test_float16_pool_sees_new_rows_as_stored():
    """A whole prefill equals the same tokens computed in two chunks, the first chunk's rows stored as float16."""
    if not F16C:
        pytest.skip("this CPU has no F16C")
    hidden, kernel = 20, 4
    data = batch(hidden, kernel, 2, True, seed=7)
    x = data["x"][:7]
    tables = np.array([[3, 5, 9, 1]], dtype=np.int64)
    common = {"kv_cache": data["kv_cache"], "block_tables": tables, "weight": data["weight"]}
    m = model(hidden, kernel, 2, 0, True, "absent")
    whole, _ = run(m, {**common, "x": x, "past_lengths": np.array([0]), "query_start_loc": np.array([0, 7])})
    first, first_entries = run(m, {**common, "x": x[:5], "past_lengths": np.array([0]),
                                   "query_start_loc": np.array([0, 5])})
    pool = data["kv_cache"].copy()
    for q in range(5):  # the runtime writes the entries into the pool as float16
        pool[tables[0, q // BLOCK], 0:2, :, :, q % BLOCK] = first_entries[:, :, q].astype(np.float16)
    second, _ = run(m, {**common, "kv_cache": pool, "x": x[5:], "past_lengths": np.array([5]),
                        "query_start_loc": np.array([0, 2])})
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)


@pytest.mark.parametrize(("change", "message"), [
    ({"slots": 2, "layer": 1}, "exceeds the pool's 2 slots"),
    ({"weight": np.zeros((19, 4), np.float32)}, "weight must be [H, L]"),
    ({"query_start_loc": np.array([0, 1, 7, 11, 12, 15, 15])}, "query_start_loc does not cover every token"),
    ({"past_lengths": np.array([9, 0, 5, 4, 2, 16])}, "do not fit its block table"),
    ({"read_block": NUM_BLOCKS}, "a block table entry is outside the pool"),
    ({"bias": np.zeros(21, np.float32)}, "bias must be [H]"),
], ids=["slots", "weight_shape", "uncovered_token", "past_too_long", "block_id", "bias_shape"])
@native
def test_bad_inputs_are_refused_with_the_reason(change, message):
    hidden, kernel, slots, layer = 20, 4, change.get("slots", 3), change.get("layer", 1)
    data = batch(hidden, kernel, slots, False, seed=3)
    data.update({k: v for k, v in change.items() if isinstance(v, np.ndarray)})
    if "read_block" in change:
        data["block_tables"][0, 8 // BLOCK] = change["read_block"]  # past 9: taps read positions 6, 7 and 8
    m = model(hidden, kernel, slots, layer, False, "input")
    for i in (5, 6):  # any weight or bias shape reaches the op
        for j, dim in enumerate(m.graph.input[i].type.tensor_type.shape.dim):
            dim.dim_param = f"any{i}{j}"
    with pytest.raises(Exception, match="trtbuild::PagedShortConv: .*" + re.escape(message)):
        run(m, data)


@pytest.mark.parametrize("half", [False, True], ids=["float32_pool", "float16_pool"])
@pytest.mark.parametrize(("hidden", "kernel", "slots", "layer", "bias"), CASES,
                         ids=[f"H{c[0]}_L{c[1]}_layer{c[3]}_bias_{c[4]}" for c in CASES])
def test_standard_op_lowering_matches_reference(hidden, kernel, slots, layer, bias, half):
    """The node lowered to standard ops (its weight and bias initializers, as the network writes them) runs without
    the library and computes the reference."""
    data = batch(hidden, kernel, slots, half, seed=hidden * 10 + kernel + layer)
    m = model(hidden, kernel, slots, layer, half, bias)
    for name in ("weight", "bias"):  # graph inputs -> initializers
        if any(i.name == name for i in m.graph.input):
            m.graph.input.remove(next(i for i in m.graph.input if i.name == name))
            m.graph.initializer.append(onnx.numpy_helper.from_array(data[name], name))
    assert lower_paged_attention(m, "split") == 0
    assert not any(n.domain == sc.DOMAIN for n in m.graph.node)
    y, entries = run(m, data, library=False)
    want_y, want_entries = sc.reference_short_conv(
        data["x"], data["kv_cache"], data["block_tables"], data["past_lengths"], data["query_start_loc"],
        data["weight"], data["bias"] if bias == "input" else None, layer_idx=layer)
    np.testing.assert_array_equal(entries, want_entries)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
