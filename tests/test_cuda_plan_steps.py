"""CUDA plan steps on small hand-made graphs (builder/cuda_plan.py, runtime/cuda_plan_ops.py): each graph is run by
ONNX Runtime (with the native op library for trtbuild ops) and as a plan whose steps call the Triton kernels in
Triton's interpreter on CPU tensors. Whole engines against the CPU engine are in test_cuda_target.py."""

from __future__ import annotations

import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev]); the cuda target needs it")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from trtbuild.builder.cuda_plan import Plan, emit_plan  # noqa: E402
from trtbuild.builder.graph import GraphBuilder  # noqa: E402
from trtbuild.errors import TrtbuildError  # noqa: E402
from trtbuild.gpu_kernels.load import load_kernels  # noqa: E402
from trtbuild.plugins import paged_attention as pa  # noqa: E402
from trtbuild.runtime.cuda_plan_ops import OPS  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRTBUILD_KERNELS_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu" and "triton" in sys.modules and \
        not isinstance(tl.standard.sigmoid, interpreter.InterpretedFunction):
    pytest.skip("triton was imported before tests/conftest.py could load it in interpreter mode; run these tests "
                "with TRITON_INTERPRET=1", allow_module_level=True)
K = load_kernels(interpret=DEVICE == "cpu")
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], library: str | None = None) -> np.ndarray:
    options = ort.SessionOptions()
    if library:
        options.register_custom_ops_library(library)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(["logits"], feeds)[0]


def run_plan(model: onnx.ModelProto, feeds: dict[str, np.ndarray], max_query_len: int = 0
             ) -> tuple[np.ndarray, Plan]:
    """The plan of `model` executed step by step as CudaEngine.forward does (float32), -> (logits, plan)."""
    plan, weights = emit_plan(model, "float32")
    env = {**{n: torch.from_numpy(a.copy()).to(DEVICE) for n, a in feeds.items()},
           **{n: w.to(DEVICE) for n, w in weights.items()}}
    for step in plan.steps:
        attrs = {**step.attrs, "max_query_len": max_query_len} if step.kernel == "paged_attention" else step.attrs
        env.update(zip(step.outputs, OPS[step.kernel](K, attrs, *(env[n] for n in step.inputs)), strict=True))
    return env["logits"].cpu().numpy(), plan


# ---- PagedAttention's softcap ----------------------------------------------------------------------------------
HEADS, KV_HEADS, HEAD, BLOCK, NUM_BLOCKS, WIDTH, MAX_POS, VOCAB = 4, 2, 16, 4, 12, 5, 32, 24
SEQS = [(9, 1), (0, 6), (5, 4)]  # decode, fresh prefill, continuing chunk


def attention_graph(softcap: float, window: int, sinks: np.ndarray | None = None, rotary: bool = True
                    ) -> onnx.ModelProto:
    """q, k, v -> PagedAttention (RoPE inside, the tables constants as the network makes them) -> a linear ->
    logits. `sinks`: an initializer at input 10 (behind three empty names when not `rotary`)."""
    rng = np.random.default_rng(1)
    g = GraphBuilder()
    ins = [g.input("q", F32, ["T", HEADS * HEAD]), g.input("k", F32, ["T", KV_HEADS * HEAD]),
           g.input("v", F32, ["T", KV_HEADS * HEAD]),
           g.input("kv_cache", F32, [NUM_BLOCKS, 1, 2, KV_HEADS, BLOCK, HEAD]),
           g.input("block_tables", I64, ["B", WIDTH]), g.input("past_lengths", I64, ["B"]),
           g.input("query_start_loc", I64, ["B1"]), g.input("position_ids", I64, ["T"])]
    angles = np.arange(MAX_POS)[:, None] * 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)[None, :]
    rope = [g.const(f(angles).astype(np.float32), n) for f, n in ((np.cos, "rope_cos"), (np.sin, "rope_sin"))]
    extra = {**({"softcap": softcap} if softcap else {}), **({"window": window} if window else {})}
    inputs = ins + rope if rotary else ins[:7] + (["", "", ""] if sinks is not None else [])
    if sinks is not None:
        inputs.append(g.const(sinks, "sinks"))
    attn = g.op(pa.OP_TYPE, inputs, num_outputs=3, domain=pa.DOMAIN, name="attention", layer_idx=0,
                num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD, tokens_per_block=BLOCK, scale=HEAD**-0.5,
                rotary=int(rotary), **extra)[0]
    w = g.const(rng.standard_normal((HEADS * HEAD, VOCAB)).astype(np.float32), "lm_head")
    g.op("MatMul", [attn, w], outputs=["logits"], name="lm_head")
    g.output("logits", F32, ["T", VOCAB])
    return g.model("attention", {pa.DOMAIN: pa.OPSET_VERSION})


def attention_feeds(q_gain: float) -> dict[str, np.ndarray]:
    """A packed step over shuffled blocks (free ones hold random values too), and where its new K/V go."""
    rng = np.random.default_rng(2)
    tokens, perm = sum(n for _, n in SEQS), rng.permutation(NUM_BLOCKS)
    tables = np.full((len(SEQS), WIDTH), perm[-1], np.int64)
    taken = 0
    for b, (p, n) in enumerate(SEQS):
        needed = -(-(p + n) // BLOCK)
        tables[b, :needed], taken = perm[taken: taken + needed], taken + needed
    positions = [(b, j) for b, (p, n) in enumerate(SEQS) for j in range(p, p + n)]
    return {"q": (rng.standard_normal((tokens, HEADS * HEAD)) * q_gain).astype(np.float32),
            "k": rng.standard_normal((tokens, KV_HEADS * HEAD)).astype(np.float32),
            "v": rng.standard_normal((tokens, KV_HEADS * HEAD)).astype(np.float32),
            "kv_cache": rng.standard_normal((NUM_BLOCKS, 1, 2, KV_HEADS, BLOCK, HEAD)).astype(np.float32),
            "block_tables": tables, "past_lengths": np.array([p for p, _ in SEQS], np.int64),
            "query_start_loc": np.cumsum([0] + [n for _, n in SEQS]).astype(np.int64),
            "position_ids": np.array([j for _, j in positions], np.int64),
            "slot_mapping": np.array([tables[b, j // BLOCK] * BLOCK + j % BLOCK for b, j in positions], np.int64)}


@pytest.mark.parametrize(("softcap", "window", "q_gain"), [(2.0, 0, 1.0), (5.0, 4, 30.0)],
                         ids=["softcap", "softcap_windowed_large_scores"])
def test_soft_capped_attention_plan_matches_ort(library, softcap, window, q_gain):
    feeds = attention_feeds(q_gain)
    slots = feeds.pop("slot_mapping")
    want = run_ort(attention_graph(softcap, window), feeds, library)
    got, plan = run_plan(attention_graph(softcap, window), {**feeds, "slot_mapping": slots},
                         max_query_len=max(n for _, n in SEQS))
    step = next(s for s in plan.steps if s.kernel == "paged_attention")
    assert step.attrs["softcap"] == softcap and step.attrs.get("window", 0) == window
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    uncapped = run_ort(attention_graph(0.0, window), feeds, library)
    assert not np.allclose(got, uncapped, atol=1e-2)


@pytest.mark.parametrize(("rotary", "window"), [(True, 0), (False, 0), (True, 4)],
                         ids=["rope", "no_rope", "rope_window4"])
def test_attention_sinks_plan_matches_ort(library, rotary, window):
    """gpt-oss's sinks: the step's last input (float32), with or without the rope inputs before it; the plan's
    logits are the native op's."""
    sinks = np.array([2.0, -1.0, 0.5, 6.0], np.float32)
    feeds = attention_feeds(1.0)
    slots = feeds.pop("slot_mapping")
    want = run_ort(attention_graph(0.0, window, sinks, rotary), feeds, library)
    got, plan = run_plan(attention_graph(0.0, window, sinks, rotary), {**feeds, "slot_mapping": slots},
                         max_query_len=max(n for _, n in SEQS))
    step = next(s for s in plan.steps if s.kernel == "paged_attention")
    assert step.attrs["sinks"] and len(step.inputs) == (11 if rotary else 8)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(got, run_ort(attention_graph(0.0, window, None, rotary), feeds, library), atol=1e-2)


# ---- Gemma's MLP and scalings: geglu / gelu_mul / gelu, scale, tanh ------------------------------------------------
HIDDEN, INTER = 16, 24


def gemma_graph(fused: bool, approximate: str = "tanh") -> onnx.ModelProto:
    """input_ids -> embedding * sqrt(hidden) -> Gelu(gate, approximate) * up (gate|up one GEMM and a Split when
    `fused`, else two GEMMs) -> down, plus an exact Gelu of the embedding (no GLU) -> lm_head -> the final-logit
    soft-cap cap * tanh(logits / cap) as Mul(Tanh(Mul(logits, 1 / cap)), cap)."""
    rng = np.random.default_rng(3)

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    g = GraphBuilder()
    ids = g.input("input_ids", I64, ["T"])
    x = g.op("Gather", [g.const(w(VOCAB, HIDDEN), "embedding"), ids], name="embedding")
    x = g.op("Mul", [x, g.const(np.float32(HIDDEN**0.5), "normalizer")], name="embedding_scale")  # a 0-d scalar
    if fused:
        gate, up = g.op("Split", [g.op("MatMul", [x, g.const(w(HIDDEN, 2 * INTER), "gate_up")], name="gate_up"),
                                  g.const(np.array([INTER, INTER], np.int64), "sizes")], num_outputs=2, axis=-1,
                        name="split")
    else:
        gate, up = (g.op("MatMul", [x, g.const(w(HIDDEN, INTER), n)], name=n) for n in ("gate", "up"))
    act = g.op("Mul", [g.op("Gelu", [gate], name="gelu", approximate=approximate), up], name="glu")
    h = g.op("Add", [g.op("MatMul", [act, g.const(w(INTER, HIDDEN) * 0.2, "down")], name="down"),
                     g.op("Gelu", [x], name="exact_gelu")], name="residual")
    logits = g.op("MatMul", [h, g.const(w(HIDDEN, VOCAB), "lm_head")], name="lm_head")
    cap = np.float32(30.0)
    capped = g.op("Tanh", [g.op("Mul", [logits, g.const(np.array([1 / cap], np.float32), "inv_cap")],
                                name="cap_in")], name="cap_tanh")
    g.op("Mul", [g.const(np.array([cap], np.float32), "cap"), capped], outputs=["logits"], name="cap_out")
    g.output("logits", F32, ["T", VOCAB])
    return g.model("gemma")


@pytest.mark.parametrize(("fused", "approximate", "glu"), [(True, "tanh", ["geglu"]),
                                                          (False, "tanh", ["linear", "gelu_mul"]),
                                                          (True, "none", ["split", "gelu_mul"])],
                         ids=["fused_geglu", "separate_gemms", "exact_gelu_glu"])
def test_gemma_steps_match_ort(fused, approximate, glu):
    """The steps of each form, and the plan's logits against ONNX Runtime's: the soft-cap saturates some of them."""
    ids = np.array([3, 0, 7, 23, 11, 3], np.int64)
    want = run_ort(gemma_graph(fused, approximate), {"input_ids": ids})
    got, plan = run_plan(gemma_graph(fused, approximate), {"input_ids": ids})
    assert [s.kernel for s in plan.steps] == ["embedding", "scale", "linear", *glu, "linear", "gelu", "add",
                                              "linear", "scale", "tanh", "scale"]
    assert plan.steps[1].attrs["value"] == pytest.approx(HIDDEN**0.5)
    assert plan.steps[-1].attrs["value"] == 30.0 and plan.steps[-3].attrs["value"] == pytest.approx(1 / 30)
    gelus = [s.attrs["approximate"] for s in plan.steps if s.kernel in ("gelu", "gelu_mul")]
    assert gelus == ([approximate] if "gelu_mul" in glu else []) + ["none"]
    assert np.abs(want).max() > 25  # near the cap: tanh saturating
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_elementwise_steps_with_constant_operands_match_ort():
    """int4_awq's prequant Mul by a constant vector and a per-token int8 scale's Abs -> ReduceMax -> Max -> Div."""
    g = GraphBuilder()
    x = g.input("x", F32, ["T", 4])
    scaled = g.op("Mul", [x, g.const(np.array([0.5, 2.0, -1.0, 3.0], np.float32), "prequant")], name="prescale")
    amax = g.op("ReduceMax", [g.op("Abs", [scaled], name="abs"), g.const(np.array([-1]), "axes")], keepdims=1,
                name="amax")
    scale = g.op("Div", [g.op("Max", [amax, g.const(np.array([1e-3], np.float32), "floor")], name="floor"),
                         g.const(np.array([127.0], np.float32), "int8_max")], name="scale")
    g.op("Mul", [scaled, scale], outputs=["logits"], name="out")
    g.output("logits", F32, ["T", 4])
    model = g.model("elementwise")
    feeds = {"x": np.array([[1.0, -2.0, 0.25, 0.5], [0.0, 0.0, 0.0, 0.0]], np.float32)}
    got, plan = run_plan(model, feeds)
    assert [s.kernel for s in plan.steps] == ["mul", "abs", "reduce_max", "maximum", "div", "mul"]
    np.testing.assert_array_equal(got, run_ort(model, feeds))


def test_an_op_without_a_kernel_is_refused():
    g = GraphBuilder()
    x = g.input("x", F32, ["T", 4])
    g.op("Cos", [x], outputs=["logits"], name="cosine")
    g.output("logits", F32, ["T", 4])
    with pytest.raises(TrtbuildError, match="no kernel for ai.onnx::Cos \\(node cosine\\)"):
        emit_plan(g.model("cos"), "float32")
