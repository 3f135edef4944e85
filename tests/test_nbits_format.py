"""Tests for builder/convert/weight_only.py (the nbits format, round-to-nearest) and builder/convert/gguf_quants.py
(GGUF quantized blocks -> nbits, exactly), including that ONNX Runtime's MatMulNBits reads the layout as documented."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf_kquants import set_iq1_m_d
from onnx import TensorProto, helper, numpy_helper

from trtbuild.builder.convert.gguf_quants import EXACT_NBITS, gguf_to_nbits
from trtbuild.builder.convert.weight_only import NBitsWeight, pack_codes, quantize_rtn, unpack_codes

OUT, IN = 24, 512  # two K-quant super-blocks per row
EPS = np.finfo(np.float32).eps
# (byte offset of d, byte offset of the minimum or None) in each block
D_OFFSETS = {Q.Q8_0: (0, None), Q.Q4_0: (0, None), Q.Q4_1: (0, 2), Q.Q5_0: (0, None), Q.Q5_1: (0, 2),
             Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None), Q.Q3_K: (108, None), Q.Q2_K: (80, 82),
             Q.IQ4_NL: (0, None), Q.IQ4_XS: (0, None), Q.IQ2_XXS: (0, None), Q.IQ2_XS: (0, None),
             Q.IQ2_S: (0, None), Q.IQ3_XXS: (0, None), Q.IQ3_S: (0, None), Q.IQ1_S: (0, None),
             Q.IQ1_M: (None, None), Q.TQ1_0: (52, None), Q.TQ2_0: (64, None),  # IQ1_M's d: its scale words' top nibbles
             Q.MXFP4: (0, None)}  # its 1-byte exponent (d = 0 zeroes it and the first codes: 2^-128, a subnormal)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _raw_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """uint8 [OUT, IN / block * type_size] of `qtype`: gguf's own quantization of random rows where it has one (with
    all-zero and constant blocks), else random bytes with sane float16 scales; then every 5th block gets d = 0."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    x = (rng.standard_normal((OUT, IN)) * rng.uniform(0.01, 2, (OUT, 1))).astype(np.float32)
    x[1, :32], x[2, 32:64] = 0, 0.375  # an all-zero block, a constant block (Q4_1: d == 0, m != 0)
    try:
        raw = gguf.quants.quantize(x, qtype)
    except NotImplementedError:  # the K-quants: gguf dequantizes them only
        raw = rng.integers(0, 256, (OUT, IN // block * type_size), dtype=np.uint8)
        blocks = raw.reshape(-1, type_size)
        for offset in D_OFFSETS[qtype]:
            if offset is not None:
                blocks[:, offset:offset + 2] = _f16_bytes(rng.uniform(-0.05, 0.05, len(blocks)))
        if qtype == Q.IQ1_M:
            set_iq1_m_d(blocks, _f16_bytes(rng.uniform(-0.05, 0.05, len(blocks))))
        if qtype in (Q.Q4_K, Q.Q5_K):  # sub-block scale 0 (with a nonzero minimum): sub-blocks 0-3, every 3rd block
            blocks[::3, 4:8] &= 0xC0
        if qtype == Q.Q2_K:  # sub-blocks 0-3 of every 3rd block: scale 0 (low nibble), minimum kept
            blocks[::3, 0:4] &= 0xF0
    blocks = raw.reshape(-1, type_size)
    d = D_OFFSETS[qtype][0]
    if qtype == Q.IQ1_M:
        set_iq1_m_d(blocks[::5], np.zeros((len(blocks[::5]), 2), np.uint8))
    else:
        blocks[::5, d:d + 2] = 0
    return raw


@pytest.mark.parametrize("qtype", list(EXACT_NBITS), ids=lambda q: q.name)
def test_gguf_exact(qtype: Q) -> None:
    raw = _raw_blocks(qtype, np.random.default_rng(int(qtype)))
    ref = gguf.quants.dequantize(raw, qtype)
    w = gguf_to_nbits(raw, qtype, (OUT, IN))
    assert (w.bits, w.group_size) == EXACT_NBITS[qtype]
    assert (w.out_features, w.in_features) == (OUT, IN)
    got = w.dequantize()
    if w.zero_points is None:
        np.testing.assert_array_equal(got, ref)
    else:  # (q - (-m / d)) * d vs d * q + m: float32 rounding only
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=4 * EPS * np.abs(ref).max())
        # groups whose scale is 0 hold their minimum exactly
        zero = np.repeat(w.zero_points == -1, w.group_size, axis=1)
        assert zero.any()
        np.testing.assert_array_equal(got[zero], ref[zero])
        assert (ref[zero] != 0).any()


# MXFP4's exponents at ggml's edges: subnormal scales (e < 2), 1, the largest (e >= 254: values past float32 are inf)
MXFP4_EDGES = (0, 1, 2, 3, 100, 127, 128, 129, 253, 254, 255)


def test_mxfp4_is_ggml_s_values_bit_for_bit_at_every_exponent() -> None:
    """Random MXFP4 blocks with every exponent 0..255 (and more of the edges): 8-bit codes value + 128 of 15 values,
    scales ggml's e8m0_to_fp32_half, and their product gguf-py's dequantization to the bit, infs included."""
    rng = np.random.default_rng(39)
    block, type_size = GGML_QUANT_SIZES[Q.MXFP4]
    raw = rng.integers(0, 256, (64, 16 * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    blocks[:256, 0] = np.arange(256)
    blocks[256:, 0] = rng.choice(MXFP4_EDGES, len(blocks) - 256)
    w = gguf_to_nbits(raw, Q.MXFP4, (64, 16 * block))
    assert (w.bits, w.group_size, w.zero_points) == (8, 32, None)
    assert set(np.unique(w.codes)) == {116, 120, 122, 124, 125, 126, 127, 128, 129, 130, 131, 132, 134, 136, 140}
    np.testing.assert_array_equal(w.scales.reshape(-1), np.ldexp(1.0, blocks[:, 0].astype(int) - 128))
    with np.errstate(over="ignore"):  # 12 x 2^127 is inf, in ggml too
        ref = gguf.quants.dequantize(raw, Q.MXFP4)
        got = w.dequantize()
    assert np.isinf(ref).any() and (ref[np.isfinite(ref)] != 0).any()
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_gguf_reader_layout(tmp_path) -> None:
    """What GGUFReader gives for quantized tensors (uint8 [out, row bytes]) converts as is."""
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raws = {q: _raw_blocks(q, np.random.default_rng(1)) for q in EXACT_NBITS}
    for q, raw in raws.items():
        writer.add_tensor(f"t.{q.name}", raw, raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = gguf.GGUFReader(path).tensors
    assert len(tensors) == len(raws)
    for t in tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        assert shape == (OUT, IN) and t.data.dtype == np.uint8
        w = gguf_to_nbits(t.data, t.tensor_type, shape)
        np.testing.assert_allclose(w.dequantize(), gguf.quants.dequantize(t.data, t.tensor_type), rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.F16, Q.F32, Q.BF16, Q.Q8_1])
def test_gguf_without_exact_form(qtype: Q) -> None:
    assert qtype not in EXACT_NBITS
    assert gguf_to_nbits(np.zeros((OUT, 8), np.uint8), qtype, (OUT, IN)) is None


def test_gguf_bad_input() -> None:
    raw = _raw_blocks(Q.Q4_0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="uint8 raw blocks"):
        gguf_to_nbits(raw[:, :-18], Q.Q4_0, (OUT, IN))
    with pytest.raises(ValueError, match="uint8 raw blocks"):
        gguf_to_nbits(raw.view(np.int8), Q.Q4_0, (OUT, IN))
    with pytest.raises(ValueError, match="multiple of 256"):
        gguf_to_nbits(raw, Q.Q4_K, (OUT * 4, IN // 4))
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        gguf_to_nbits(raw, Q.Q4_0, (OUT, IN, 1))


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_codes(bits: int) -> None:
    codes = np.random.default_rng(0).integers(0, 1 << bits, (5, 64), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 64 * bits // 8) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_codes(packed, bits), codes)
    if bits == 4:  # input 2j in the low nibble
        assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    with pytest.raises(ValueError, match="must lie in"):
        pack_codes(codes.astype(np.int16) + (1 << bits), bits)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        pack_codes(codes, 2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 64, None])
def test_quantize_rtn_error_bound(bits: int, group_size: int | None) -> None:
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((33, 256)) * rng.uniform(1e-3, 10, (33, 1))).astype(np.float32)
    w[3] = 0
    q = quantize_rtn(w, bits, group_size)
    g = group_size or 256
    assert (q.bits, q.group_size, q.zero_points) == (bits, g, None)
    assert q.codes.shape == (33, 256 * bits // 8) and q.scales.shape == (33, 256 // g)
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(w.reshape(33, -1, g)).max(-1)
    np.testing.assert_allclose(q.scales[amax > 0], amax[amax > 0] / qmax, rtol=1e-7)
    assert (q.scales[3] == 1).all()
    codes = unpack_codes(q.codes, bits)
    assert (codes[3] == 2 ** (bits - 1)).all()
    assert codes.min() >= 1 and codes.max() <= 2 ** bits - 1  # symmetric: -qmax..qmax around the zero point
    err = np.abs(q.dequantize() - w).reshape(33, -1, g)
    assert (err <= q.scales[..., None] * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_rtn_round_trip(bits: int) -> None:
    """Weights that are integers times a per-group scale (with the group's amax at +-qmax) come back exactly."""
    rng = np.random.default_rng(0)
    qmax = 2 ** (bits - 1) - 1
    k = rng.integers(-qmax, qmax + 1, (16, 128))
    k[:, ::32] = qmax  # every group of 32 reaches qmax
    scale = rng.uniform(0.01, 1, (16, 4)).astype(np.float16).astype(np.float32)  # scale * qmax is exact
    w = (k.reshape(16, 4, 32) * scale[..., None]).reshape(16, 128).astype(np.float32)
    q = quantize_rtn(w, bits, 32)
    np.testing.assert_array_equal(q.scales, scale)
    np.testing.assert_array_equal(q.dequantize(), w)
    np.testing.assert_array_equal(unpack_codes(q.codes, bits).astype(int) - 2 ** (bits - 1), k)
    per_channel = quantize_rtn(w.astype(np.float16), bits, None)
    assert per_channel.group_size == 128 and per_channel.scales.shape == (16, 1)
    reblocked = per_channel.with_group_size(16)
    assert reblocked.scales.shape == (16, 8)
    np.testing.assert_array_equal(reblocked.dequantize(), per_channel.dequantize())


def test_quantize_rtn_bad_input() -> None:
    w = np.ones((4, 96), np.float32)
    for kwargs, match in [
        (dict(bits=3, group_size=32), "bits must be 4 or 8"),
        (dict(bits=4, group_size=64), "positive divisor"),
        (dict(bits=4, group_size=0), "positive divisor"),
    ]:
        with pytest.raises(ValueError, match=match):
            quantize_rtn(w, **kwargs)
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(w[0], 8, 32)
    with pytest.raises(ValueError, match="even number"):
        quantize_rtn(np.ones((4, 33), np.float32), 4, None)
    with pytest.raises(ValueError, match="floating-point"):
        quantize_rtn(np.ones((4, 96), np.int32), 8, 32)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rtn(np.full((4, 96), np.inf, np.float32), 8, 32)


def test_nbits_weight_validates() -> None:
    codes, scales = np.zeros((4, 32), np.uint8), np.ones((4, 2), np.float32)
    NBitsWeight(4, 32, codes, scales)
    with pytest.raises(ValueError, match="scales must be float32"):
        NBitsWeight(4, 16, codes, scales)
    with pytest.raises(ValueError, match="does not divide"):
        NBitsWeight(4, 48, codes, scales)
    with pytest.raises(ValueError, match="zero_points"):
        NBitsWeight(4, 32, codes, scales, np.ones((4, 2), np.float64))
    with pytest.raises(ValueError, match="codes must be uint8"):
        NBitsWeight(8, 32, codes.astype(np.int8), scales)


def _matmul_nbits(a: np.ndarray, w: NBitsWeight) -> np.ndarray:
    """Run one com.microsoft::MatMulNBits node on w as the engine will lay it out."""
    n, k, g = w.out_features, w.in_features, w.group_size
    inits = [numpy_helper.from_array(w.codes.reshape(n, k // g, g * w.bits // 8), "B"),
             numpy_helper.from_array(w.scales.reshape(-1), "scales")]
    if w.zero_points is not None:
        inits.append(numpy_helper.from_array(w.zero_points.reshape(-1), "zero_points"))
    node = helper.make_node("MatMulNBits", ["A"] + [t.name for t in inits], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=w.bits, block_size=g, accuracy_level=1)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"A": a})[0]


def _random_zp_weight(rng: np.random.Generator) -> NBitsWeight:
    codes = rng.integers(0, 16, (OUT, IN), dtype=np.uint8)
    shape = (OUT, IN // 16)
    return NBitsWeight(4, 16, pack_codes(codes, 4), rng.uniform(-0.1, 0.1, shape).astype(np.float32),
                       rng.uniform(-4, 20, shape).astype(np.float32))


@pytest.mark.parametrize("case", ["rtn4_g32", "rtn4_g16", "rtn8_g32", "rtn8_g16", "Q4_0", "Q8_0", "Q5_0", "Q6_K",
                                  "Q4_1", "Q4_K", "MXFP4", "zp4_g16"])
def test_matmul_nbits_reads_the_layout(case: str) -> None:
    rng = np.random.default_rng(7)
    if case.startswith("rtn"):
        bits, group = int(case[3]), int(case.split("_g")[1])
        w = quantize_rtn(rng.standard_normal((OUT, IN)).astype(np.float32), bits, group)
    elif case == "zp4_g16":
        w = _random_zp_weight(rng)
    else:
        w = gguf_to_nbits(_raw_blocks(Q[case], rng), Q[case], (OUT, IN))
    a = rng.standard_normal((5, IN)).astype(np.float32)
    ref = a.astype(np.float64) @ w.dequantize().T.astype(np.float64)
    got = _matmul_nbits(a, w)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
