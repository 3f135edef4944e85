"""The CPU engine's native 4/8-bit linears (builder/native_linears.py): eligible MatMulNBits become
trtbuild::BlockQuantMatMul over packed copies of their weights, in the one graph every step runs; the logits agree
with MatMulNBits' up to int8 activation rounding; the autotuner times both."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from helpers import BLOCK_QUANT, make_random_hf_model, needs_block_quant

from trtbuild.bench.autotune import time_graph
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, CPU_WEIGHTS_FILE, read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

LIMITS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128)


@pytest.fixture(scope="module", params=[4, 8], ids=["int4", "int8"])
def checkpoint(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"native_linears_{request.param}")
    # NOTE: 136 input features to the MLP's down projection: not a multiple of 128, so every kernel path is used
    hf = make_random_hf_model("qwen2", work / "hf", overrides=dict(hidden_size=128, intermediate_size=224))
    convert(hf, work / "ckpt", weight_only=WeightOnly(request.param, 32))
    return work / "ckpt"


def ops(engine_dir) -> list[str]:
    return [n.op_type for n in onnx.load(str(engine_dir / CPU_ENGINE_FILE), load_external_data=False).graph.node]


def steps(engine_dir) -> list[np.ndarray]:
    """A prefill of two sequences, then a decode step of both: every row of logits."""
    engine = CpuEngine(engine_dir, num_threads=2, num_blocks=16)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    prefill = engine.step([SequenceChunk(i, p, 0, len(p), [3 * i, 3 * i + 1, 3 * i + 2])
                           for i, p in enumerate(prompts)])
    decode = engine.step([SequenceChunk(i, [7 + i], len(p), 1, [3 * i, 3 * i + 1, 3 * i + 2])
                          for i, p in enumerate(prompts)])
    return [prefill, decode]


@needs_block_quant
def test_native_linears_replace_matmulnbits_and_agree_with_it(checkpoint, tmp_path):
    native = build_engine(checkpoint, tmp_path / "native", **LIMITS)
    ort = build_engine(checkpoint, tmp_path / "ort", quant_linears="ort", **LIMITS)
    assert read_engine_config(native).build.quant_linears == "native"
    assert read_engine_config(ort).build.quant_linears == "ort"
    native_ops, ort_ops = ops(native), ops(ort)
    assert native_ops.count("BlockQuantMatMul") == ort_ops.count("MatMulNBits") > 0
    assert "MatMulNBits" not in native_ops
    linears_and_adds = ("BlockQuantMatMul", "MatMulNBits", "Add")
    others = [[o for o in found if o not in linears_and_adds] for found in (native_ops, ort_ops)]
    # the untied token table: gathered from its own packed table
    assert others[0] == ["BlockQuantGather" if o == "GatherBlockQuantized" else o for o in others[1]]
    # a Qwen2: each layer's q, k and v bias adds go into its fused q+k+v kernel (builder/linear_bias.py)
    layers = read_engine_config(native).model.num_hidden_layers
    assert f"linear_biases:{layers}" in read_engine_config(native).passes
    assert ort_ops.count("Add") - native_ops.count("Add") == 3 * layers
    # the weights once: packed copies replace MatMulNBits' (rows padded to 16, fp32 scales either way)
    sizes = [(e / CPU_WEIGHTS_FILE).stat().st_size for e in (native, ort)]
    assert abs(sizes[0] - sizes[1]) < 0.02 * sizes[1] + 2 * 4096  # (and a page for each layer's folded bias)
    for got, want in zip(steps(native), steps(ort), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
        assert (got.argmax(axis=-1) == want.argmax(axis=-1)).all()


def test_quant_linears_ort_or_where_native_does_not_apply(checkpoint, tmp_path):
    fp32 = build_engine(checkpoint, tmp_path / "acc1", int4_accuracy_level=1, **LIMITS)
    assert read_engine_config(fp32).build.quant_linears == "ort"  # fp32 compute asked for: MatMulNBits only
    assert "BlockQuantMatMul" not in ops(fp32)
    with pytest.raises(ConfigError, match="native cannot be used: int4_accuracy_level 1"):
        build_engine(checkpoint, tmp_path / "bad", int4_accuracy_level=1, quant_linears="native", **LIMITS)
    with pytest.raises(ConfigError, match="quant_linears must be one of auto, native, ort"):
        build_engine(checkpoint, tmp_path / "bad2", quant_linears="fast", **LIMITS)


def test_a_cpu_without_block_quant_tiles_keeps_matmulnbits(checkpoint, tmp_path, monkeypatch):
    from trtbuild import cpu_ops

    monkeypatch.setattr(cpu_ops, "runs_block_quant", lambda: False)
    assert read_engine_config(build_engine(checkpoint, tmp_path / "a", **LIMITS)).build.quant_linears == "ort"
    with pytest.raises(ConfigError, match="native cannot be used: this CPU has neither AVX-512 VNNI nor AVX2"):
        build_engine(checkpoint, tmp_path / "b", quant_linears="native", **LIMITS)


def test_autotune_times_native_and_ort_linears(checkpoint, tmp_path):
    engine = build_engine(checkpoint, tmp_path / "e", timer=time_graph, autotune="fast", **LIMITS)
    info = read_engine_config(engine)
    tactic = info.tactics["quant_linears"]
    if BLOCK_QUANT:
        assert tactic["source"] == "measured" and set(tactic["timings_ms"]) == {"native", "ort"}
    else:  # BlockQuantMatMul cannot run here: MatMulNBits is the only candidate, nothing is timed
        assert tactic == {"chosen": "ort", "timings_ms": {}, "source": "only candidate"}
    assert info.build.quant_linears == tactic["chosen"]
    assert ("BlockQuantMatMul" in ops(engine)) == (tactic["chosen"] == "native")


def test_verify_checks_the_native_linears_against_matmulnbits(checkpoint, tmp_path):
    from trtbuild.bench.verify import verify_engine

    engine_dir = build_engine(checkpoint, tmp_path / "e", **LIMITS)
    report = verify_engine(engine_dir, checkpoint, num_threads=1)
    report.check()  # raises VerificationError if an output is off
    assert len(report.steps) == 2 and "decode" in report.steps[1]


@pytest.mark.parametrize("bits,block", [(8, 16), (4, 16), (4, 32)])
def test_lowering_one_linear_keeps_its_product(bits, block):
    """A lone MatMulNBits (GGUF's Q6_K arrives as 8-bit blocks of 16) lowered and run against itself."""
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from trtbuild import cpu_ops
    from trtbuild.builder.native_linears import NativeLinears
    from trtbuild.plugins.block_quant_matmul import ZERO_POINT, unpack_nbits
    from trtbuild.plugins.block_quant_reference import reference_block_quant_matmul

    rng = np.random.default_rng(block)
    k, n = 96, 40
    b = rng.integers(0, 256, (n, k // block, block * bits // 8), dtype=np.uint8)
    s = (rng.random(n * k // block, dtype=np.float32) * 0.01 + 1e-3)
    node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=4)
    model = helper.make_model(
        helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                          [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s, "S")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = onnxruntime.SessionOptions()
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    x = rng.standard_normal((5, k)).astype(np.float32)

    def run(m: onnx.ModelProto) -> np.ndarray:
        return onnxruntime.InferenceSession(m.SerializeToString(), options).run(None, {"x": x})[0]

    matmulnbits = run(model)
    assert NativeLinears().lower(model) == 1
    assert [n.op_type for n in model.graph.node] == ["BlockQuantMatMul"]
    assert {t.name for t in model.graph.initializer} == {"B.bq", "S.bq"}  # MatMulNBits' copies dropped
    codes = unpack_nbits(b, n, k, bits)
    # NOTE: MLAS quantizes activations per weight block (16 here), so it differs by rounding, not more
    exact = x @ ((codes.astype(np.float32) - ZERO_POINT[bits]) * np.repeat(s.reshape(n, -1), block, axis=1)).T
    assert np.abs(matmulnbits - exact).max() < 0.02 * np.abs(exact).max()
    if not BLOCK_QUANT:  # the lowered graph refuses to run here (the builder's auto tactics never lower on such a CPU)
        with pytest.raises(Exception, match="this CPU has neither AVX-512 VNNI nor AVX2"):
            run(model)
        return
    got = run(model)
    want = reference_block_quant_matmul(x, codes, s, bits)  # activations in int8 blocks of 32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def tied_gguf_engines(tmp_path, qtype, hidden: int = 128, tied: bool = True, suffixes: dict | None = None) -> tuple:
    """A small Qwen2 GGUF whose 2-D weights (linears and the tied token table, or the untied token table and
    output; not norms) are all `qtype` (or `suffixes`' type for the GGUF names ending in a key), built with the
    native linears and with ONNX Runtime's: (native engine dir, ort engine dir)."""
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp

    class AllLinears(dict):
        def get(self, name, default=None):
            if not name.endswith(".weight") or "norm" in name:
                return default
            return next((t for suffix, t in (suffixes or {}).items() if name.endswith(suffix)), qtype)

    hf = make_hf_folder("qwen2", tmp_path / "hf", overrides={"hidden_size": hidden, "intermediate_size": 2 * hidden,
                                                             "tie_word_embeddings": tied})
    qtypes = AllLinears({"token_embd.weight": qtype})  # NOTE: not empty: an empty dict is false
    convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "qwen2", qtypes), tmp_path / "ckpt")
    return (build_engine(tmp_path / "ckpt", tmp_path / "native", **LIMITS),
            build_engine(tmp_path / "ckpt", tmp_path / "ort", quant_linears="ort", **LIMITS))


@needs_block_quant
def test_a_tied_quantized_embedding_is_held_once(tmp_path):
    """A GGUF whose lm_head is its Q8_0 token table: the embedding gathers rows of the lm_head's packed table
    (BlockQuantGather), and the engine file holds that table once."""
    from gguf import GGMLQuantizationType

    native, ort = tied_gguf_engines(tmp_path, GGMLQuantizationType.Q8_0)
    assert ops(native).count("BlockQuantGather") == 1 and "GatherBlockQuantized" not in ops(native)
    assert ops(ort).count("GatherBlockQuantized") == 1
    config = read_engine_config(native).model
    table = config.vocab_size * config.hidden_size  # 8-bit codes
    sizes = [(e / CPU_WEIGHTS_FILE).stat().st_size for e in (native, ort)]
    assert sizes[1] - sizes[0] > 0.9 * table
    for got, want in zip(steps(native), steps(ort), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


@needs_block_quant
def test_q5_0_weights_are_packed_in_5_bits(tmp_path):
    """A GGUF whose linears and tied token table are Q5_0 (converted as 8-bit codes within 16 of 128): the native
    linears and the embedding's gather hold them in 5.5 bits a weight, not 8.5, and compute what MatMulNBits
    computes on the 8-bit codes."""
    from gguf import GGMLQuantizationType
    from onnx import numpy_helper

    native, ort = tied_gguf_engines(tmp_path, GGMLQuantizationType.Q5_0)
    model = onnx.load(str(native / CPU_ENGINE_FILE))
    nodes = [n for n in model.graph.node if n.op_type in ("BlockQuantMatMul", "BlockQuantGather")]
    assert {n.op_type for n in nodes} == {"BlockQuantMatMul", "BlockQuantGather"}
    weights = {t.name: t for t in model.graph.initializer}
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == 5, node.name
        codes = numpy_helper.to_array(weights[node.input[1]])
        assert codes.size == -(-attrs["N"] // 16) * 16 * attrs["K"] * 5 // 8
    config = read_engine_config(native).model
    sizes = [(e / CPU_WEIGHTS_FILE).stat().st_size for e in (native, ort)]
    assert sizes[1] - sizes[0] > 0.3 * config.vocab_size * config.hidden_size  # 3 bits a weight less, table alone
    for got, want in zip(steps(native), steps(ort), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
        assert (got.argmax(axis=-1) == want.argmax(axis=-1)).all()


@needs_block_quant
@pytest.mark.parametrize("qtype,bits,mins,two_level", [("Q4_K", 4, True, True), ("Q5_K", 5, True, True),
                                                       ("Q6_K", 6, False, True), ("Q5_1", 5, True, False),
                                                       ("Q3_K", 3, False, True), ("Q2_K", 2, True, True),
                                                       ("IQ4_NL", 4, False, False), ("IQ4_XS", 4, False, True),
                                                       ("IQ2_XXS", 3, False, True), ("IQ2_XS", 3, False, True),
                                                       ("IQ3_XXS", 4, False, True), ("IQ3_S", 4, False, True),
                                                       ("IQ1_M", 3, False, True), ("TQ1_0", 2, False, True),
                                                       ("TQ2_0", 2, False, True), ("MXFP4", 4, False, True)])
def test_gguf_blocks_are_held_as_ggml_holds_them(tmp_path, monkeypatch, qtype, bits, mins, two_level):
    """A GGUF whose linears are Q2_K / Q4_K / Q5_K / Q5_1 (converted as 4- or 8-bit codes with float zero points),
    Q6_K (8-bit codes within 32 of 128), Q3_K / TQ1_0 / TQ2_0 (4-bit codes within 4 / 1 of 8), IQ types or MXFP4
    (8-bit codes taking 16 values or 6; MXFP4's 15): the native linears hold them as ggml does, codes in 2 to 6 bits
    (IQ types and MXFP4: 3- or 4-bit indices into their values), k-quants' scales (and minimums) as int8 under a
    float16 per 256 weights (MXFP4's powers of two too), the others' as float16, and compute what ONNX Runtime's
    lowering (MatMulNBits, with the float zero points as a second GEMM) computes."""
    from gguf import GGMLQuantizationType
    from onnx import numpy_helper

    native, ort = tied_gguf_engines(tmp_path, GGMLQuantizationType[qtype], hidden=256)
    book = qtype.startswith("IQ") or qtype == "MXFP4"  # held as indices into a codebook of their values
    model = onnx.load(str(native / CPU_ENGINE_FILE))
    weights = {t.name: t for t in model.graph.initializer}
    linears = [n for n in model.graph.node if n.op_type == "BlockQuantMatMul"]
    assert len(linears) == 2 * 4 + 1  # per layer q+k+v, o, gate+up, down; the lm_head
    for node in linears:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["bits"] == bits, node.name
        assert ("codebook" in attrs) == book
        if "codebook" in attrs:  # ggml's values + 128
            from trtbuild.builder.convert.gguf_quants import IQ4_CODES, MXFP4_CODES

            if qtype.startswith("IQ4"):
                assert attrs["codebook"] == IQ4_CODES.tolist()
            elif qtype == "MXFP4":  # 15 values (0 twice), then padding
                assert attrs["codebook"] == [*sorted(set(MXFP4_CODES.tolist())), 128]
            else:  # IQ1's and IQ2's 6 values in 3 bits, IQ3's 16 in 4 (none of them 0: code 128 is padding)
                assert len(set(attrs["codebook"]) - {128}) == (16 if qtype.startswith("IQ3") else 6)
        scales = numpy_helper.to_array(weights[node.input[2]])
        nibbles = qtype in ("Q2_K", "IQ1_M")  # sub-scales (and Q2_K's sub-minimums) 0..15 in blocks of 16: two a byte
        assert scales.dtype == (np.uint8 if nibbles else np.int8 if two_level else np.float16)
        if two_level:
            supers = numpy_helper.to_array(weights[node.input[4]])
            assert supers.dtype == np.float16 and supers.shape == (-(-attrs["N"] // 16), attrs["K"] // 256, 16)
        assert (len(node.input) >= 6) == mins, node.input
        if mins:  # in the scales' form
            assert numpy_helper.to_array(weights[node.input[5]]).dtype == scales.dtype
        # bits per weight: Q4_K 4 + (8 + 8) / 32 + (16 + 16) / 256 = 4.625; Q6_K 6 + 8 / 16 + 16 / 256 = 6.5625;
        # Q5_1 5 + (16 + 16) / 32 = 6; Q3_K 3 + 8 / 16 + 16 / 256 = 3.5625; Q2_K 2 + 8 / 16 + 32 / 256 = 2.625;
        # IQ4_NL 4 + 16 / 32 = 4.5; IQ4_XS and IQ3 4 + 8 / 32 + 16 / 256 = 4.3125; IQ2_XXS 3.3125; IQ2_XS
        # 3 + 8 / 16 + 16 / 256 = 3.5625; IQ1_M (1 + 2 s <= 15: nibbles) 3 + 4 / 16 + 16 / 256 = 3.3125; TQ1_0 / TQ2_0
        # 2 + 8 / 32 + 16 / 256 = 2.3125; MXFP4 (powers of two: int8 2^j under a float16 per 256) 4.3125
        per_block = 4 if nibbles else 8 if two_level else 16
        per_weight = bits + per_block / attrs["block_size"] * (1 + mins) + two_level * 16 / 256 * (1 + mins)
        held = sum(numpy_helper.to_array(weights[i]).nbytes for j, i in enumerate(node.input) if i and j not in (0, 3))
        assert held == -(-attrs["N"] // 16) * 16 * attrs["K"] * per_weight / 8
        assert (node.input[3:4] not in ([], [""])) == node.name.endswith("q+k+v")  # Qwen2's biases, folded in
    assert "MatMulNBits" not in ops(native) and "ReduceSum" not in ops(native)
    assert "MatMulNBits" in ops(ort)
    # what the build log says it packed: the 9 linears' tables (the token table is the lm_head's)
    from trtbuild.builder.native_linears import describe_tables

    said = describe_tables(model)
    form = rf"9 x {bits}-bit( codebook)?, blocks of (16|32){', minimums' if mins else ''} \(([\d.]+) bits a weight\)"
    assert (found := re.fullmatch(form, said)) and ("codebook" in said) == book, said
    assert abs(float(found[3]) - per_weight) < 1e-3, said  # the held bits a weight the loop above checks
    # the token table is the lm_head's packed table (with float zero points too: the gather the network writes
    # for them becomes the same op)
    gathers = [n for n in model.graph.node if n.op_type == "BlockQuantGather"]
    assert len(gathers) == 1 and "GatherBlockQuantized" not in ops(native)
    assert not [n for n in model.graph.node if n.name == "embedding_codes"]  # the standard-op gather's
    assert [i for i in gathers[0].input[1:] if i] == [i for i in linears[-1].input[1:] if i]
    # against the float model the GGUF holds (its weights dequantized): as near as ONNX Runtime's lowering
    convert(tmp_path / "m.gguf", tmp_path / "float_ckpt", dequantize=True)
    exact = build_engine(tmp_path / "float_ckpt", tmp_path / "float", **LIMITS)
    # (IQ types' weights span int8 as Q8_0's do, and so does the error of rounding x to int8 blocks, llama.cpp's way)
    bound, ratio = (1.5e-2, 2.0) if qtype.startswith("IQ") else (1e-2, 1.5)
    for got, other, want in zip(steps(native), steps(ort), steps(exact), strict=True):
        errors = [np.abs(y - want).max() for y in (got, other)]
        assert errors[0] < bound * np.abs(want).max() and errors[0] < ratio * errors[1], errors
        top = np.sort(want, axis=-1)
        decided = top[:, -1] - top[:, -2] > 2 * errors[0]  # a random model's near-ties may flip
        assert decided.mean() >= 0.5 and (got.argmax(axis=-1) == want.argmax(axis=-1))[decided].all()
    if book:  # the codebook's indices compute exactly what the 8-bit codes do
        from trtbuild.plugins import block_quant_matmul as bq

        monkeypatch.setattr(bq, "compact",
                            lambda codes, bits, zero_point: bq.Compact(*bq.narrow(codes, bits, zero_point)))
        eight = build_engine(tmp_path / "ckpt", tmp_path / "eight", **LIMITS)
        assert "codebook" not in str(onnx.load(str(eight / CPU_ENGINE_FILE), load_external_data=False).graph)
        for got, want in zip(steps(native), steps(eight), strict=True):
            np.testing.assert_array_equal(got, want)


@needs_block_quant
@pytest.mark.parametrize("qtype,bits,inputs", [("Q4_K", 4, 6), ("Q3_K", 3, 4)])
def test_an_untied_table_is_gathered_packed(tmp_path, qtype, bits, inputs):
    """An untied Q4_K token table (converted with float zero points, which ONNX Runtime's GatherBlockQuantized does
    not take) or Q3_K one (4-bit codes in blocks of 16, which it does): the native build gathers it from its own
    packed table (4.625 or 3.5625 bits a weight, not the 6 of GatherBlockQuantized's float32 scales), exactly the
    rows the ort build's gather dequantizes."""
    from gguf import GGMLQuantizationType

    native, ort = tied_gguf_engines(tmp_path, GGMLQuantizationType[qtype], hidden=256, tied=False)
    assert ops(native).count("BlockQuantGather") == 1 and "GatherBlockQuantized" not in ops(native)
    names = [{n.name for n in onnx.load(str(e / CPU_ENGINE_FILE), load_external_data=False).graph.node}
             for e in (native, ort)]
    assert ("embedding_codes" in names[1] or "GatherBlockQuantized" in ops(ort)) and "embedding_codes" not in names[0]
    model = onnx.load(str(native / CPU_ENGINE_FILE))
    gather = next(n for n in model.graph.node if n.op_type == "BlockQuantGather")
    head = next(n for n in model.graph.node if n.op_type == "BlockQuantMatMul" and n.name == "lm_head")
    # its own table, two-level (with minimums for Q4_K)
    assert gather.input[1] != head.input[1] and len(gather.input) == inputs
    assert onnx.helper.get_attribute_value(next(a for a in gather.attribute if a.name == "bits")) == bits
    for got, want in zip(steps(native), steps(ort), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


def test_float_zero_points_are_rewritten_once_for_every_graph_copy(monkeypatch):
    """The `ort` tactic's rewrite of float zero points (passes/lower_quant_cpu.py: FloatZeroPoints) makes its
    initializers (5-bit codes centred on 128, the correction's offsets) once, though the autotuner lowers a copy of
    the graph per candidate; every copy computes the linear."""
    import copy

    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from trtbuild.builder.graph import GraphView
    from trtbuild.builder.passes.lower_quant_cpu import FloatZeroPoints

    rng = np.random.default_rng(0)
    k, n, g = 64, 16, 32
    codes = rng.integers(0, 32, (n, k), dtype=np.uint8)  # GGUF Q5_K's codes, 8 bits in the checkpoint
    scales = rng.random((n, k // g), dtype=np.float32) * 0.1
    zero_points = rng.random((n, k // g), dtype=np.float32) * 31
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], name="linear", domain="com.microsoft", K=k,
                            N=n, bits=8, block_size=g, accuracy_level=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(codes.reshape(n, k // g, g), "B"),
                               numpy_helper.from_array(scales.reshape(-1), "S"),
                               numpy_helper.from_array(zero_points.reshape(-1), "Z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    made = []
    add = GraphView.add_initializer
    monkeypatch.setattr(GraphView, "add_initializer", lambda self, name, value: (made.append(name),
                                                                                 add(self, name, value)))
    rewrite = FloatZeroPoints()
    copies = [copy.deepcopy(model) for _ in range(2)]
    assert [rewrite.expand(c) for c in copies] == [1, 1]
    assert sorted(made) == ["linear.axis_last", "linear.blocks_shape", "linear.weight_nbits_centred",
                            "linear.zero_point_offsets"]
    x = rng.standard_normal((3, k)).astype(np.float32)
    w = (codes.astype(np.float32) - np.repeat(zero_points, g, axis=1)) * np.repeat(scales, g, axis=1)
    for c in copies:
        assert "linear.weight_nbits_centred" in [i for nd in c.graph.node for i in nd.input]
        got = onnxruntime.InferenceSession(c.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_llama_gguf_of_lattice_weights_computes_its_float_model(tmp_path):
    """A `llama` GGUF (q and k rows permuted as llama.cpp writes them) whose weights are all IQ2_XS: the rows the
    reader un-permutes carry their 3-bit codebook indices and scales along, so the engine computes what the same
    file dequantized to float32 does, up to int8 activation rounding."""
    from gguf import GGMLQuantizationType as Q
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp

    class AllLinears(dict):
        def get(self, name, default=None):
            return Q.IQ2_XS if name.endswith(".weight") and "norm" not in name else default

    hf = make_hf_folder("llama", tmp_path / "hf", overrides={"hidden_size": 256, "intermediate_size": 512})
    gguf_file = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "llama", AllLinears({"token_embd.weight": Q.IQ2_XS}))
    convert(gguf_file, tmp_path / "ckpt")
    convert(gguf_file, tmp_path / "float_ckpt", dequantize=True)
    native = build_engine(tmp_path / "ckpt", tmp_path / "native", **LIMITS)
    exact = build_engine(tmp_path / "float_ckpt", tmp_path / "float", **LIMITS)
    graph = onnx.load(str(native / CPU_ENGINE_FILE), load_external_data=False).graph
    if BLOCK_QUANT:
        assert "codebook" in str(graph)
    else:  # BlockQuantMatMul cannot run here: MatMulNBits on the 8-bit codes
        assert "codebook" not in str(graph) and "MatMulNBits" in [n.op_type for n in graph.node]
    for got, want in zip(steps(native), steps(exact), strict=True):
        assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()
        assert (got.argmax(axis=-1) == want.argmax(axis=-1)).mean() >= 0.9


@needs_block_quant
def test_siblings_merge_only_where_their_codes_have_one_form(tmp_path):
    """llama.cpp's IQ4_XS files keep attn_v in Q5_K: each layer's q and k (4-bit indices into a codebook) run as one
    kernel and its v (5-bit codes with minimums) as another, not all three in 8 bits with float zero points."""
    from gguf import GGMLQuantizationType as Q

    native, ort = tied_gguf_engines(tmp_path, Q.IQ4_XS, hidden=256, suffixes={"attn_v.weight": Q.Q5_K})
    model = onnx.load(str(native / CPU_ENGINE_FILE), load_external_data=False)
    forms = sorted((n.name.rsplit(".", 1)[-1], a["bits"], "codebook" in a) for n in model.graph.node
                   if n.op_type == "BlockQuantMatMul" and (a := {x.name: onnx.helper.get_attribute_value(x)
                                                                 for x in n.attribute}))
    layers = read_engine_config(native).model.num_hidden_layers
    assert forms.count(("q+k", 4, True)) == layers and forms.count(("v", 5, False)) == layers, forms
    assert all(bits == 4 and codebook for name, bits, codebook in forms if name != "v"), forms
    for got, want in zip(steps(native), steps(ort), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())
