"""Fusion passes (builder/passes/): each alone and all together, on the structure they leave and the weights fused."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from passes_helpers import BUILD, LAYERS, check_lowered

from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder
from trtbuild.builder.lower_cpu import lower_paged_attention
from trtbuild.builder.passes import PASSES, fuse_add_rmsnorm, fuse_gate_up, fuse_qkv, fuse_rope_into_attention
from trtbuild.plugins import paged_attention as pa

FAMILIES = ["llama", "llama3_rope", "qwen2", "qwen3", "mistral"]
PA_ATTRIBUTES = {"layer_idx", "num_heads", "num_kv_heads", "head_size", "tokens_per_block", "scale", "rotary"}


def ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def check(model: onnx.ModelProto) -> None:
    """The ONNX checker with shape inference; custom-domain nodes need their opset imported."""
    assert {o.domain: o.version for o in model.opset_import}.get(pa.DOMAIN) == pa.OPSET_VERSION
    onnx.checker.check_model(model, full_check=True)


def producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    users = collections.defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            users[i].append(n)
    return users


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def weight(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for n in model.graph.node if n.op_type == pa.OP_TYPE and n.domain == pa.DOMAIN]
    assert len(nodes) == LAYERS
    return sorted(nodes, key=lambda n: attrs(n)["layer_idx"])


def trace_to(model: onnx.ModelProto, tensor: str, op_type: str, max_hops: int = 8) -> tuple[onnx.NodeProto, int]:
    """Walk first inputs upward from `tensor` to the nearest `op_type` node; returns it and the output index."""
    made_by = producers(model)
    for _ in range(max_hops):
        node = made_by[tensor]
        if node.op_type == op_type:
            return node, list(node.output).index(tensor)
        tensor = node.input[0]
    raise AssertionError(f"no {op_type} within {max_hops} hops above {tensor}")


def t(tensors: dict, name: str) -> np.ndarray:
    return tensors[name].float().numpy()


# --- fuse_qkv ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_qkv(family, network):
    config, tensors, model = network(family)
    before = ops(model)
    bias_adds = sum(1 for n in model.graph.node if n.op_type == "Add" and n.name.endswith("_bias"))
    assert bias_adds == (3 * LAYERS if config.qkv_bias else 0)
    assert fuse_qkv(model) == LAYERS
    check(model)
    after = ops(model)
    assert after["MatMul"] == before["MatMul"] - 2 * LAYERS
    assert after["Split"] == LAYERS
    assert after["Add"] == before["Add"] - (2 * LAYERS if config.qkv_bias else 0)  # 3 bias Adds -> 1 per layer
    names = {n.name for n in model.graph.node}
    for i, node in enumerate(attention_nodes(model)):
        p = f"transformer.layers.{i}."
        assert not {p + f"attention.{x}" for x in "qkv"} & names
        assert {p + "mlp.gate", p + "mlp.fc"} <= names  # gate/up untouched
        splits = [trace_to(model, node.input[slot], "Split") for slot in (pa.Q, pa.K, pa.V)]
        split = splits[0][0]
        assert all(s is split for s, _ in splits) and [k for _, k in splits] == [0, 1, 2]
        widths = weight(model, split.input[1]).tolist()
        assert widths == [config.q_size, config.kv_size, config.kv_size]
        matmul = producers(model)[split.input[0]]
        if config.qkv_bias:
            add = matmul
            assert add.op_type == "Add"
            bias = weight(model, add.input[1])
            want = np.concatenate([t(tensors, p + f"attention.{x}.bias") for x in "qkv"])
            np.testing.assert_array_equal(bias, want)
            matmul = producers(model)[add.input[0]]
        assert matmul.op_type == "MatMul" and matmul.name == p + "attention.qkv"
        assert producers(model)[matmul.input[0]].name == p + "input_layernorm"
        want = np.concatenate([t(tensors, p + f"attention.{x}.weight").T for x in "qkv"], axis=1)
        np.testing.assert_array_equal(weight(model, matmul.input[1]), want)
    leftover = {i.name for i in model.graph.initializer}
    assert not any(n.endswith((".q.weight", ".k.weight", ".v.weight", ".q.bias")) for n in leftover)
    assert fuse_qkv(model) == 0  # idempotent


# --- fuse_gate_up -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_first", [False, True], ids=["alone", "after_qkv"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fuse_gate_up(family, qkv_first, network):
    config, tensors, model = network(family)
    if qkv_first:
        fuse_qkv(model)
    before = ops(model)
    qkv_before = sorted(n.name for n in model.graph.node if ".attention." in n.name and n.op_type == "MatMul")
    assert fuse_gate_up(model) == LAYERS  # every layer's MLP, not only the last one's
    check(model)
    after = ops(model)
    assert after["MatMul"] == before["MatMul"] - LAYERS
    assert after["Split"] == before["Split"] + LAYERS
    qkv_after = sorted(n.name for n in model.graph.node if ".attention." in n.name and n.op_type == "MatMul")
    assert qkv_after == qkv_before  # the attention projections are not an MLP
    users = consumers(model)
    for i in range(LAYERS):
        p = f"transformer.layers.{i}."
        matmul = next(n for n in model.graph.node if n.name == p + "mlp.gate_up")
        assert producers(model)[matmul.input[0]].name == p + "post_layernorm"
        want = np.concatenate([t(tensors, p + "mlp.gate.weight").T, t(tensors, p + "mlp.fc.weight").T], axis=1)
        np.testing.assert_array_equal(weight(model, matmul.input[1]), want)
        (split,) = users[matmul.output[0]]
        assert split.op_type == "Split" and weight(model, split.input[1]).tolist() == [config.intermediate_size] * 2
        gate, up = split.output
        assert sorted(n.op_type for n in users[gate]) == ["Mul", "Sigmoid"]  # SiLU(gate)
        assert [n.name for n in users[up]] == [p + "swiglu"]
    assert fuse_gate_up(model) == 0


def _two_gemms_model(into_attention: bool) -> onnx.ModelProto:
    """x -> two sibling MatMuls; they feed a PagedAttention (q, and k/v through a Split) or a SwiGLU."""
    g = GraphBuilder()
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    x = g.input("x", f32, ["T", 16])
    rng = np.random.default_rng(0)
    a = g.op("MatMul", [x, g.weight("a.weight", rng.standard_normal((16, 16)).astype(np.float32))], name="a")
    b = g.op("MatMul", [x, g.weight("b.weight", rng.standard_normal((16, 16)).astype(np.float32))], name="b")
    if into_attention:
        k, v = g.op("Split", [b, g.const(np.array([8, 8]))], num_outputs=2, axis=-1)
        meta = [g.input("kv_cache", f32, [1, 2, "n", 4, 1, 8]), g.input("block_tables", i64, ["B", 4]),
                g.input("past_lengths", i64, ["B"]), g.input("query_start_loc", i64, ["B1"])]
        g.op(pa.OP_TYPE, [a, k, v, *meta], num_outputs=3, domain=pa.DOMAIN, outputs=["y", "k_new", "v_new"],
             layer_idx=0, num_heads=2, num_kv_heads=1, head_size=8, tokens_per_block=4, scale=0.35, rotary=0)
    else:
        g.op("Mul", [g.op("Mul", [a, g.op("Sigmoid", [a])]), b], outputs=["y"])
    g.output("y", f32, ["T", 16])
    return g.model("siblings", {pa.DOMAIN: pa.OPSET_VERSION})


def test_fuse_gate_up_leaves_attention_projections_alone():
    assert fuse_gate_up(_two_gemms_model(into_attention=True)) == 0
    model = _two_gemms_model(into_attention=False)
    assert fuse_gate_up(model) == 1 and ops(model)["MatMul"] == 1
    assert fuse_qkv(_two_gemms_model(into_attention=True)) == 0  # two GEMMs are not a Q/K/V triple


# --- fuse_rope_into_attention -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_rope_into_attention(family, network):
    config, _, model = network(family)
    unfused = {n.name: attrs(n) for n in attention_nodes(model)}
    assert ops(model)["RotaryEmbedding"] == 2 * LAYERS
    assert fuse_rope_into_attention(model) == LAYERS
    check(model)
    after = ops(model)
    assert after["RotaryEmbedding"] == 0 and after["Squeeze"] == 0
    assert "positions_2d" not in {n.name for n in model.graph.node}  # fed only the removed RotaryEmbeddings
    for i, node in enumerate(attention_nodes(model)):
        a = attrs(node)
        assert set(a) == PA_ATTRIBUTES and a["rotary"] == 1
        assert {k: v for k, v in a.items() if k != "rotary"} == {k: v for k, v in unfused[node.name].items()
                                                                 if k != "rotary"}
        assert len(node.input) == pa.SINKS == len(pa.INPUTS) - 1  # every input but the optional sinks
        assert list(node.input[pa.POSITION_IDS :]) == ["position_ids", "rope_cos", "rope_sin"]
        p = f"transformer.layers.{i}."
        q_from, k_from = (producers(model)[node.input[s]] for s in (pa.Q, pa.K))
        if config.qk_norm:  # qwen3: q/k norm sits between the projection and the (now fused) rope
            assert q_from.op_type == k_from.op_type == "Reshape"
            assert producers(model)[q_from.input[0]].name == p + "attention.q_norm"
            assert producers(model)[k_from.input[0]].name == p + "attention.k_norm"
        else:
            want = "Add" if config.qkv_bias else "MatMul"
            assert q_from.op_type == k_from.op_type == want
    cos = weight(model, "rope_cos")
    assert cos.shape == (BUILD.max_seq_len, config.head_size // 2)
    assert fuse_rope_into_attention(model) == 0


def test_fuse_rope_keeps_the_attention_sinks(network):
    """gpt-oss's sinks sit at input 10 behind three empty rope slots; the fusion fills the slots and keeps them."""
    _, _, model = network("llama")
    for node in attention_nodes(model):
        name = f"{node.name}/sinks"
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(attrs(node)["num_heads"], np.float32), name))
        node.input.extend(["", "", "", name])
    assert fuse_rope_into_attention(model) == LAYERS
    check(model)
    for node in attention_nodes(model):
        assert list(node.input[pa.POSITION_IDS:]) == ["position_ids", "rope_cos", "rope_sin", f"{node.name}/sinks"]
        assert pa.sinks_input(node.input) == f"{node.name}/sinks"


# --- fuse_add_rmsnorm -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fuse_add_rmsnorm(family, network):
    config, _, model = network(family)
    before = ops(model)
    head_norms = 2 * LAYERS if config.qk_norm else 0
    assert before["RMSNormalization"] == 2 * LAYERS + 1 + head_norms
    # every norm reading a residual Add fuses: all but layer 0's input norm (reads the embedding Gather) and the
    # final norm (reads the select_logit_tokens Gather); head norms read a Reshape
    expected = 2 * LAYERS - 1
    assert fuse_add_rmsnorm(model) == expected
    check(model)
    after = ops(model)
    assert after["SkipSimplifiedLayerNormalization"] == expected
    assert after["RMSNormalization"] == before["RMSNormalization"] - expected
    assert after["Add"] == before["Add"] - expected
    assert {o.domain: o.version for o in model.opset_import}[MS_DOMAIN] == 1
    made_by, users = producers(model), consumers(model)
    left = {n.name for n in model.graph.node if n.op_type == "RMSNormalization"}
    assert {"transformer.layers.0.input_layernorm", "transformer.ln_f"} <= left
    assert made_by["transformer.layers.0.input_layernorm_out0"].op_type == "RMSNormalization"
    ln_f = next(n for n in model.graph.node if n.name == "transformer.ln_f")
    assert made_by[ln_f.input[0]].name == "select_logit_tokens"
    for node in (n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"):
        assert node.domain == MS_DOMAIN and attrs(node)["epsilon"] == pytest.approx(config.norm_epsilon)
        assert len(node.input) == 3 and node.input[2].endswith("layernorm.weight")
        assert node.output[1] == node.output[2] == ""
        assert users[node.output[0]] and users[node.output[3]]  # normalized -> GEMM, sum -> residual stream
    assert fuse_add_rmsnorm(model) == 0


# --- all together -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_all_passes_in_order(family, network):
    config, _, model = network(family)
    counts = {}
    for p in PASSES["cpu"]:
        counts[p.__name__] = p(model)
        check(model)  # every intermediate model is valid ONNX
    assert counts == {"fold_prescale": 0, "fuse_qkv": LAYERS, "fuse_gate_up": LAYERS, "hoist_lora_adds": 0,
                      "fuse_rope_into_attention": LAYERS,
                      "fuse_add_rmsnorm": 2 * LAYERS - 1}
    got = ops(model)
    # qkv, dense, gate_up, proj per layer, and lm_head (a Gemm over the embedding table when tied)
    assert got["MatMul"] + got.get("Gemm", 0) == 4 * LAYERS + 1
    assert got["RotaryEmbedding"] == 0 and got["SkipSimplifiedLayerNormalization"] == 2 * LAYERS - 1
    for node in attention_nodes(model):
        assert attrs(node)["rotary"] == 1 and len(node.input) == 10
        assert trace_to(model, node.input[pa.V], "Split")[1] == 2
    lower_paged_attention(model)
    check_lowered(model)


def test_tensorrt_pass_list_keeps_standard_norms(network):
    _, _, model = network("llama")
    for p in PASSES["tensorrt"]:
        p(model)
        check(model)
    assert ops(model)["SkipSimplifiedLayerNormalization"] == 0
    assert MS_DOMAIN not in {o.domain for o in model.opset_import}
