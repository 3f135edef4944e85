"""Quantized checkpoints (fp8, int4_awq, int8_sq weights; int8 / fp8 KV cache) build into engines that run the
format's math with low-bit kernels.

Reference: quant_helpers.Reference, float64 numpy of each format's math (docs/quantization.md) stepping like the
engine. Tolerance: max |engine - reference| / max |reference| <= 1e-4 per step, while quantizing moves the logits
by 1e-3 .. 2e-1 (asserted >= 30x the tolerance), so an engine that skipped or mis-scaled any quantization fails.
The bound holds while no activation lands within fp32 noise of a rounding tie; on these tiny models none does
(a 45M-parameter model with 1e6 quantized activations per step sees a few such ties, which then cascade).
"""

from __future__ import annotations

import collections
import dataclasses
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from quant_helpers import Reference, calibrate, quantize_checkpoint

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.network import build_network
from trtbuild.configs import BuildConfig
from trtbuild.configs.model_config import QuantConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

RTOL = 1e-4
# int4 in fp32 compute: these tests check the engine against the format to RTOL (level 4 is tested on its own)
# NOTE: a float32 KV pool (the default is float16 for quantized weights): the formats' arithmetic is compared
# exactly, against float32 references
OPTIONS = dict(max_seq_len=128, tokens_per_block=8, max_batch_size=4, max_num_tokens=64, int4_accuracy_level=1,
               kv_pool_dtype="float32")
LAYERS, VOCAB = 2, 320
# case -> (family, quant_algo, kv_cache_quant_algo, extra quantize options)
CASES = {
    "llama-fp8": ("llama", "fp8", None, {}),
    "llama-int4_awq-kv_int8": ("llama", "int4_awq", "int8", {"exclude": ("lm_head", "transformer.layers.1.mlp.*")}),
    "llama-int8_sq-kv_fp8": ("llama", "int8_sq", "fp8", {"exclude": ()}),  # lm_head quantized too
    "llama-kv_fp8": ("llama", None, "fp8", {}),
    "qwen2-fp8-kv_fp8": ("qwen2", "fp8", "fp8", {}),
    "qwen2-int4_awq": ("qwen2", "int4_awq", None, {"shared_prequant": False}),
    "qwen2-int8_sq-kv_int8": ("qwen2", "int8_sq", "int8", {}),
    "llama-int8_sq-own_scales": ("llama", "int8_sq", None, {"shared_prequant": False}),
    "llama-int8_sq-per_token": ("llama", "int8_sq", None, {"shared_prequant": False, "per_token": True}),
    "qwen2-int8_sq-per_token-kv_int8": ("qwen2", "int8_sq", "int8", {"per_token": True}),
    "llama-int4_awq-lm_head_int8": ("llama", "int4_awq", None, {"lm_head_int8": True}),
    "qwen2-int8_sq-lm_head_int8": ("qwen2", "int8_sq", None, {"lm_head_int8": True}),
}


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def chunk(seq: int, token_ids: list[int], start: int, num_logits: int = 1) -> SequenceChunk:
    return SequenceChunk(seq, token_ids, start, num_logits, list(range(seq, 48, 3)))  # interleaved block tables


A, B, C = ids(13, 1), ids(16, 2), ids(6, 3)
STEPS = [  # prefill + first chunk; decode + continuing chunk + fresh prompt; decodes across block boundaries
    [chunk(0, A[:11], 0, num_logits=11), chunk(1, B[:9], 0, num_logits=0)],
    [chunk(0, A[11:12], 11), chunk(1, B[9:15], 9, num_logits=6), chunk(2, C[:5], 0, 5)],
    [chunk(0, A[12:], 12), chunk(1, B[15:], 15), chunk(2, C[5:], 5)],
]


@pytest.fixture(scope="module")
def base(random_hf_model, tmp_path_factory):
    """family -> (full-precision checkpoint dir, calibration amax), once per module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            hf = random_hf_model(family)
            out = tmp_path_factory.mktemp(f"q_{family}") / "ckpt"
            convert(hf, out)
            cache[family] = out, calibrate(hf, ids(48, 7) + A + B + C)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def case(base, tmp_path_factory):
    """case id -> (config, tensors, engine dir, full-precision tensors)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            family, algo, kv, extra = CASES[name]
            ckpt, amax = base(family)
            work = tmp_path_factory.mktemp(name)
            qckpt = quantize_checkpoint(ckpt, work / "ckpt", algo, kv, amax, **extra)
            config, tensors = load_checkpoint(qckpt)
            cache[name] = config, tensors, build_engine(qckpt, work / "engine", **OPTIONS), load_checkpoint(ckpt)[1]
        return cache[name]

    return get


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_format_reference(name, case):
    config, tensors, engine_dir, full = case(name)
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=48)
    reference = Reference(config, tensors)
    unquantized = Reference(dataclasses.replace(config, quantization=QuantConfig()), full)
    effect = 0.0
    for step in STEPS:
        got, want, plain = engine.step(step), reference.step(step), unquantized.step(step)
        assert rel_err(got, want) <= RTOL
        effect = max(effect, rel_err(plain, want))
    assert effect >= 30 * RTOL  # the quantization is real (KV: from the second step on), and the engine follows it
    if config.quantization.kv_cache_quant_algo:  # the pool holds what the reference stored (up to rounding ties)
        pool = engine.kv.dequantized().transpose(1, 2, 3, 0, 4, 5).reshape(
            LAYERS, 2, config.num_key_value_heads, -1, config.head_size)  # [layer, K|V, head, slot, head_size]
        slots = engine.kv.slots(STEPS[0][0].block_ids, 0, len(A))
        for layer, which in np.ndindex(LAYERS, 2):
            stored = reference.past[0][layer][which]
            same = np.abs(pool[layer, which][:, slots].transpose(1, 0, 2) - stored) <= 1e-5 * np.abs(stored).max()
            assert same.mean() >= 0.99


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("name", list(CASES))
def test_lowered_graph_runs_low_bit_kernels(name, case):
    config, _, engine_dir, _ = case(name)
    model = onnx.load(str(engine_dir / CPU_ENGINE_FILE))
    ops, algo = _ops(model), config.quantization.quant_algo
    exclude = CASES[name][3].get("exclude", ("lm_head",))
    excluded = {f"transformer.layers.1.mlp.{x}" for x in ("gate_up", "proj")} if len(exclude) > 1 else set()
    merged = CASES[name][3].get("shared_prequant", True)  # siblings with one pre-scaled input share a kernel
    linears = (4 if merged else 7) * LAYERS - len(excluded) + ("lm_head" not in exclude)
    head_int8 = config.quantization.lm_head_quant_algo == "int8_wo"  # an 8-bit MatMulNBits, whatever algo is
    nbits = {n.name: {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
             for n in model.graph.node if n.op_type == "MatMulNBits"}
    assert len(nbits) == (linears if algo == "int4_awq" else 0) + head_int8
    assert {n: a["bits"] for n, a in nbits.items() if a["bits"] == 8} == ({"lm_head": 8} if head_int8 else {})
    assert ops["MatMulIntegerToFloat"] == (linears if algo == "int8_sq" else 0)
    if algo is None:  # KV-only quantization: the fused full-precision GEMMs stay, on float32 weights
        assert ops["DenseMatMul"] == 4 * LAYERS + 1 and not ops["Gemm"]  # the lm_head too
        assert ops["MatMul"] == 2 * LAYERS  # the attention's (a quantized pool: standard-op attention)
        return
    # the float32 tables left: RoPE's, and the full-precision weights packed for DenseMatMul / DenseGather
    float_tables = {t.name for t in model.graph.initializer
                    if t.data_type == TensorProto.FLOAT and len(t.dims) > 1 and min(t.dims) > 1}
    expected = {"rope_cos", "rope_sin", "transformer.vocab_embedding.weight.dense"} | (
        {"lm_head.weight.dense"} if "lm_head" in exclude and not head_int8 else set())
    assert float_tables == expected | {e + ".weight.dense_t" for e in excluded}  # no fp32 copy of a quantized weight
    for e in excluded:
        assert next(n for n in model.graph.node if n.name == e).op_type == "DenseMatMul"
    by_type = collections.Counter(t.data_type for t in model.graph.initializer if len(t.dims) == 2)
    if algo == "fp8":  # no CPU fp8 GEMM: 1-byte weights, dequantized as the MatMul runs
        assert by_type[TensorProto.FLOAT8E4M3FN] == 7 * LAYERS + ("lm_head" not in exclude)
        assert ops["DequantizeLinear"] >= 7 * LAYERS and ops["QuantizeLinear"] >= 4 * LAYERS
    if algo == "int4_awq":
        assert {a["bits"] for n, a in nbits.items() if n != "lm_head"} == {4}
        assert by_type[TensorProto.UINT8] == 0 and ops["DequantizeLinear"] == 0  # B is [N, K/g, g/2]: 3-D
    if algo == "int8_sq":
        assert by_type[TensorProto.INT8] == linears and ops["DequantizeLinear"] == 0


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


@pytest.mark.parametrize("name", ["llama-int4_awq-kv_int8", "llama-int8_sq-kv_fp8", "llama-fp8"])
def test_kv_pool_and_generation(name, case):
    config, tensors, engine_dir, _ = case(name)
    llm = LLM(engine_dir, RuntimeConfig(num_threads=1, kv_cache_blocks=64))
    kv = llm.core.engine.kv
    kv_algo = config.quantization.kv_cache_quant_algo
    fp32_bytes = LAYERS * 2 * config.num_key_value_heads * config.head_size * 4
    assert kv.pool.dtype == {None: np.float32, "int8": np.int8, "fp8": np.uint8}[kv_algo]
    assert kv.bytes_per_token == (fp32_bytes if kv_algo is None else fp32_bytes // 4)
    prompts = [A, C]
    out = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for p, completion in zip(prompts, out, strict=True):  # greedy tokens = the reference's argmax, step by step
        reference, tokens = Reference(config, tensors), list(p)
        logits = reference.chunk(0, tokens, 0, 1)
        for _ in range(8):
            tokens.append(int(logits[-1].argmax()))
            logits = reference.chunk(0, tokens[-1:], len(tokens) - 1, 1)
        assert completion.token_ids == tokens[len(p):]


def test_int4_engine_is_a_quarter_of_fp16(random_hf_model, tmp_path):
    """Hidden 256, group 128: packed int4 + fp32 scales = (0.5 + 4/128) / 2 = 0.27 of the fp16 bytes."""
    from helpers import make_random_hf_model

    hf = make_random_hf_model("llama", tmp_path / "hf", overrides=dict(hidden_size=256, intermediate_size=512,
                                                                       num_hidden_layers=1))
    convert(hf, tmp_path / "ckpt")
    q = quantize_checkpoint(tmp_path / "ckpt", tmp_path / "q", "int4_awq", None, calibrate(hf, ids(16, 0)),
                            group_size=128)
    model = onnx.load(str(build_engine(q, tmp_path / "engine", **OPTIONS) / CPU_ENGINE_FILE))
    params = 256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 512
    stored = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer if t.name.startswith("transformer.l"))
    assert 0.25 <= stored / (2 * params) <= 0.28


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


def test_int4_int8_compute_is_the_default_and_stays_close(case, tmp_path):
    """The default build (int4_accuracy_level 4) runs MatMulNBits with int8 activations: within a few percent of the
    format (fp32 compute) and recorded in the engine's config. (quant_linears ort: MatMulNBits, not the native op,
    whose own int8 arithmetic tests/test_native_linears.py checks.)"""
    config, tensors, exact_dir, _ = case("qwen2-int4_awq")
    options = {k: v for k, v in OPTIONS.items() if k != "int4_accuracy_level"}
    fast_dir = build_engine(exact_dir.parent / "ckpt", tmp_path / "engine", quant_linears="ort", **options)
    model = onnx.load(str(fast_dir / CPU_ENGINE_FILE), load_external_data=False)
    levels = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    assert levels == {4}
    assert json.loads((fast_dir / "config.json").read_text())["build_config"]["int4_accuracy_level"] == 4
    fast, exact = CpuEngine(fast_dir, num_threads=1, num_blocks=48), CpuEngine(exact_dir, num_threads=1, num_blocks=48)
    reference = Reference(config, tensors)
    for step in STEPS:
        want, got_exact, got_fast = reference.step(step), exact.step(step), fast.step(step)
        assert rel_err(got_exact, want) <= RTOL
        assert 0 < rel_err(got_fast, want) <= 5e-2


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


def test_build_refuses_a_float16_pool_for_a_quantized_kv_cache(case, tmp_path):
    """A float16 KV pool is for unquantized KV caches; with an int8 one the build says so before any work."""
    _, _, engine_dir, _ = case("qwen2-int8_sq-kv_int8")
    with pytest.raises(ConfigError, match=r"^kv_pool_dtype float16 applies to unquantized KV caches only, and the "
                                          r"checkpoint's KV cache is quantized \(int8\)") as error:
        build_engine(engine_dir.parent / "ckpt", tmp_path / "engine", **{**OPTIONS, "kv_pool_dtype": "float16"})
    assert error.value.field == "kv_pool_dtype" and "--" not in error.value.problem
    assert not (tmp_path / "engine").exists()
    with pytest.raises(ConfigError, match=r"^kv_pool_dtype must be one of float32, float16, got 'bfloat16'"):
        BuildConfig(kv_pool_dtype="bfloat16")
