"""Quantized checkpoints (fp8, int4_awq, int8_sq; int8 / fp8 KV cache) build into engines running the format's math.

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
from helpers import AVX512, VNNI
from onnx import TensorProto, numpy_helper
from quant_helpers import Reference, calibrate, quantize_checkpoint
from quantized_engine_helpers import LAYERS, OPTIONS, A, B, C, _ops, ids, rel_err

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.configs import BuildConfig
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.errors import ConfigError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

RTOL = 1e-4
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


def chunk(seq: int, token_ids: list[int], start: int, num_logits: int = 1) -> SequenceChunk:
    return SequenceChunk(seq, token_ids, start, num_logits, list(range(seq, 48, 3)))  # interleaved block tables


STEPS = [  # prefill + first chunk; decode + continuing chunk + fresh prompt; decodes across block boundaries
    [chunk(0, A[:11], 0, num_logits=11), chunk(1, B[:9], 0, num_logits=0)],
    [chunk(0, A[11:12], 11), chunk(1, B[9:15], 9, num_logits=6), chunk(2, C[:5], 0, 5)],
    [chunk(0, A[12:], 12), chunk(1, B[15:], 15), chunk(2, C[5:], 5)],
]


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
    if algo is None and AVX512:  # KV-only quantization: the fused full-precision GEMMs stay, on float32 weights
        assert ops["DenseMatMul"] == 4 * LAYERS + 1 and not ops["Gemm"]  # the lm_head too
        assert ops["MatMul"] == 2 * LAYERS  # the attention's (a quantized pool: standard-op attention)
        return
    if algo is None:  # no AVX-512 for DenseMatMul: ONNX Runtime's MatMul (the lm_head: Gemm) on the float32 weights
        assert not ops["DenseMatMul"] and ops["Gemm"] == 1
        assert ops["MatMul"] == 4 * LAYERS + 2 * LAYERS  # the linears', the attention's
        return
    # the float32 tables left: RoPE's, and the full-precision weights packed for DenseMatMul / DenseGather (without
    # AVX-512: ONNX Runtime's MatMul / Gemm / Gather read them as they are)
    dense, dense_t = (".dense", ".dense_t") if AVX512 else ("", "")
    float_tables = {t.name for t in model.graph.initializer
                    if t.data_type == TensorProto.FLOAT and len(t.dims) > 1 and min(t.dims) > 1}
    expected = {"rope_cos", "rope_sin", "transformer.vocab_embedding.weight" + dense} | (
        {"lm_head.weight" + dense} if "lm_head" in exclude and not head_int8 else set())
    assert float_tables == expected | {e + ".weight" + dense_t for e in excluded}  # no fp32 copy of a quantized weight
    for e in excluded:
        assert next(n for n in model.graph.node if n.name == e).op_type == ("DenseMatMul" if AVX512 else "MatMul")
    by_type = collections.Counter(t.data_type for t in model.graph.initializer if len(t.dims) == 2)
    if algo == "fp8":  # no CPU fp8 GEMM: 1-byte weights, dequantized as the MatMul runs
        assert by_type[TensorProto.FLOAT8E4M3FN] == 7 * LAYERS + ("lm_head" not in exclude)
        assert ops["DequantizeLinear"] >= 7 * LAYERS and ops["QuantizeLinear"] >= 4 * LAYERS
    if algo == "int4_awq":
        assert {a["bits"] for n, a in nbits.items() if n != "lm_head"} == {4}
        assert by_type[TensorProto.UINT8] == 0 and ops["DequantizeLinear"] == 0  # B is [N, K/g, g/2]: 3-D
    if algo == "int8_sq":
        assert ops["DequantizeLinear"] == 0
        # int8 weights where ONNX Runtime's u8s8 GEMM sums exactly (AVX-512 VNNI); elsewhere uint8 ones with a zero
        # point of 128, the weight zero point input (5) set (builder/passes/lower_quant_cpu.py: u8s8_exact)
        assert by_type[TensorProto.INT8] == (linears if VNNI else 0)
        gemms = [n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"]
        assert [len(n.input) > 5 and bool(n.input[5]) for n in gemms] == [not VNNI] * linears


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
