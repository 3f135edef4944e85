"""Fusion passes (builder/passes/): each alone and all together, on the structure they leave and on numerics.

Numerics: the unfused and the fused network are both lowered for the CPU target and driven through CpuEngine.step
over the same three steps (prefill, mixed prefill chunk + decode + fresh prompt, decode); logits and new_kv must
agree to 1e-5 relative to their largest magnitude.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import RANDOM_CONFIGS
from onnx import helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder
from trtbuild.builder.lower_cpu import lower_paged_attention
from trtbuild.builder.network import build_network
from trtbuild.builder.passes import PASSES, fuse_add_rmsnorm, fuse_gate_up, fuse_qkv, fuse_rope_into_attention
from trtbuild.configs import BuildConfig
from trtbuild.plugins import paged_attention as pa
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

FAMILIES = ["llama", "llama3_rope", "qwen2", "qwen3", "mistral"]
LAYERS = RANDOM_CONFIGS["llama"][1]["num_hidden_layers"]  # the same for every family
VOCAB = RANDOM_CONFIGS["llama"][1]["vocab_size"]
ENGINE_OPTIONS = dict(max_seq_len=128, tokens_per_block=8, max_batch_size=4, max_num_tokens=64)
BUILD = BuildConfig(**ENGINE_OPTIONS)
ALL = (fuse_qkv, fuse_gate_up, fuse_rope_into_attention, fuse_add_rmsnorm)
RTOL = 1e-5
PA_ATTRIBUTES = {"layer_idx", "num_heads", "num_kv_heads", "head_size", "tokens_per_block", "scale", "rotary"}
PACKAGE = Path(__file__).resolve().parents[1]  # the repository root is the trtbuild package


@pytest.fixture(scope="module")
def checkpoint(random_hf_model, tmp_path_factory):
    """family -> (ModelConfig, checkpoint tensors), converted once per module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"passes_{family}") / "ckpt"
            convert(random_hf_model(family), out)
            cache[family] = load_checkpoint(out)
        return cache[family]

    return get


@pytest.fixture
def network(checkpoint):
    """family -> (config, tensors, a fresh unfused network)."""

    def get(family: str):
        config, tensors = checkpoint(family)
        return config, tensors, build_network(config, tensors, BUILD)

    return get


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


def check_lowered(model: onnx.ModelProto) -> None:
    assert not any(n.domain == pa.DOMAIN for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)


# --- numerics ---------------------------------------------------------------------------------------------------

VARIANTS = {"fuse_qkv": (fuse_qkv,), "fuse_gate_up": (fuse_gate_up,),
            "fuse_rope_into_attention": (fuse_rope_into_attention,), "fuse_add_rmsnorm": (fuse_add_rmsnorm,),
            "all": ALL}


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def chunk(seq: int, token_ids: list[int], start: int, num_logits: int = 1) -> SequenceChunk:
    """Sequence `seq` owns every third block from block `seq` (interleaved tables: 16 blocks, 128 tokens each)."""
    return SequenceChunk(seq, token_ids, start, num_logits, list(range(seq, 48, 3)))


A, B, C = ids(13, 1), ids(16, 2), ids(6, 3)
STEPS = [  # prefill + first chunk; decode + continuing chunk + fresh prompt; three decodes (block boundaries)
    [chunk(0, A[:11], 0, num_logits=11), chunk(1, B[:9], 0, num_logits=0)],
    [chunk(0, A[11:12], 11), chunk(1, B[9:15], 9, num_logits=6), chunk(2, C[:5], 0, 5)],
    [chunk(0, A[12:], 12), chunk(1, B[15:], 15), chunk(2, C[5:], 5)],
]


class Recorder:
    """Stands in for the engine's session; runs the given model and keeps what each step returned."""

    def __init__(self, model: onnx.ModelProto) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        if any(o.domain == cpu_ops.DOMAIN for o in model.opset_import):  # built with native attention
            options.register_custom_ops_library(str(cpu_ops.library_path()))
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.outputs: list[list[np.ndarray]] = []

    def run(self, names, feeds):
        out = self.session.run(names, feeds)
        self.outputs.append(out)
        return out


def drive(engine_dir, model: onnx.ModelProto | None) -> list[list[np.ndarray]]:
    """Run STEPS through CpuEngine.step (its feeds, its KV pool), with `model` in place of the engine's own."""
    engine = CpuEngine(engine_dir, num_threads=1)
    recorder = Recorder(model) if model is not None else Recorder(onnx.load(str(engine_dir / CPU_ENGINE_FILE)))
    engine.session = recorder
    for step in STEPS:
        engine.step(step)
    return recorder.outputs


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_same_outputs(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    assert len(got) == len(want) == len(STEPS)
    for i, ((logits, new_kv), (logits_ref, new_kv_ref)) in enumerate(zip(got, want, strict=True)):
        assert logits.shape == (sum(c.num_logits for c in STEPS[i]), VOCAB)
        assert rel_err(logits, logits_ref) <= RTOL, f"step {i} logits"
        assert rel_err(new_kv, new_kv_ref) <= RTOL, f"step {i} new_kv"


@pytest.fixture(scope="module")
def unfused(random_hf_model, engine_from_hf, checkpoint):
    """family -> (engine dir built without passes, outputs of its own lowered unfused network)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            engine_dir = engine_from_hf(random_hf_model(family), fuse=False, **ENGINE_OPTIONS)
            config, tensors = checkpoint(family)
            model = build_network(config, tensors, BUILD)
            lower_paged_attention(model)
            cache[family] = engine_dir, drive(engine_dir, model)
        return cache[family]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_numerics_match_unfused(family, variant, unfused, network):
    engine_dir, want = unfused(family)
    _, _, model = network(family)
    for p in VARIANTS[variant]:
        assert p(model) > 0, p.__name__
    lower_paged_attention(model)
    check_lowered(model)
    assert_same_outputs(drive(engine_dir, model), want)


@pytest.mark.parametrize("family", ["llama3_rope", "qwen2"])
def test_fused_engine_matches_unfused_engine(family, random_hf_model, engine_from_hf, unfused):
    """The real build path: build_engine with fuse=True vs fuse=False, both run by CpuEngine."""
    fused_dir = engine_from_hf(random_hf_model(family), **ENGINE_OPTIONS)
    unfused_dir, _ = unfused(family)
    fused_info, unfused_info = CpuEngine(fused_dir).info, CpuEngine(unfused_dir).info
    biases = 3 * LAYERS if family == "qwen2" else 0  # q, k and v
    lowered = (f"dense_linears:{7 * LAYERS + 1}",) + ((f"linear_biases:{biases}",) if biases else ())
    assert unfused_info.passes == lowered  # the target's lowering: every linear, and the bias adds
    assert fused_info.passes == ("fold_prescale:0", f"fuse_qkv:{LAYERS}", f"fuse_gate_up:{LAYERS}",
                                 "hoist_lora_adds:0", f"fuse_rope_into_attention:{LAYERS}",
                                 f"fuse_add_rmsnorm:{2 * LAYERS - 1}", f"dense_linears:{4 * LAYERS + 1}",
                                 *((f"linear_biases:{LAYERS}",) if biases else ()), f"native_swiglu:{LAYERS}")
    assert_same_outputs(drive(fused_dir, None), drive(unfused_dir, None))
    pools = []
    for engine_dir in (fused_dir, unfused_dir):
        engine = CpuEngine(engine_dir, num_threads=1)
        for step in STEPS:
            logits = engine.step(step)
        pools.append((logits, engine.kv.pool))
    assert rel_err(pools[0][0], pools[1][0]) <= RTOL
    assert rel_err(pools[0][1], pools[1][1]) <= RTOL


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (function-level imports included), as dotted names:
    `from trtbuild import runtime` counts as trtbuild.runtime."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(("sources", "forbidden"), [
    ("builder/**/*.py", ("trtbuild.runtime", "trtbuild.quantize")),
    ("configs/**/*.py", ("trtbuild.builder", "trtbuild.runtime", "trtbuild.quantize")),
    ("quantization.py", ("trtbuild.builder", "trtbuild.runtime", "trtbuild.quantize")),
])
def test_dependency_direction(sources, forbidden):
    """The builder compiles checkpoints without the runtime or the quantizer; configs and the shared quantization
    vocabulary (trtbuild.quantization) depend on neither the builder, the runtime nor the quantizer."""
    files = sorted(PACKAGE.glob(sources))
    assert files, sources
    bad = {f"{path.relative_to(PACKAGE)}: {name}" for path in files for name in imported_modules(path)
           if any(name == m or name.startswith(m + ".") for m in forbidden)}
    assert not bad, sorted(bad)
