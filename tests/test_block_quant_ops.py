"""BlockQuantMatMul and BlockQuantGather (cpu_ops/block_matmul.cc, block_gather.cc) against their numpy references.

The references are plugins/block_quant_matmul.py's, in every form `pack` stores: 2- to 8-bit codes, blocks of 32
and 16, float32, float16 and two-level (int8 x float16 per 256) scales, with and without minimums, codebooks
(GGUF's IQ types and MXFP4); and what the ops refuse. test_moe_ops.py imports this file's helpers.
"""

from __future__ import annotations

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import BLOCK_QUANT, needs_block_quant
from onnx import TensorProto, helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.builder.convert import gguf_quants
from trtbuild.builder.convert.weight_only import NBitsWeight
from trtbuild.builder.native_linears import pack_nbits
from trtbuild.plugins.block_quant_matmul import (
    GATHER_OP_TYPE,
    HIGH_BITS,
    OP_TYPE,
    ZERO_POINT,
    PackedTable,
    compact,
    narrow,
    pack,
)
from trtbuild.plugins.block_quant_reference import reference_block_quant_gather, reference_block_quant_matmul

TABLE_INPUTS = ("B", "S", "S_super", "mins", "mins_super")


def block_quant_session(library: str, op: str, k: int, n: int, bits: int, table: PackedTable, block: int = 32,
                        codebook: tuple[int, ...] | None = None) -> ort.InferenceSession:
    """A one-node model of `op` over the packed `table` (input x [M, K], or ids [T] for the gather)."""
    first = "ids" if op == GATHER_OP_TYPE else "x"
    tensors = table.tensors()
    inputs = [first, *(name if value is not None else "" for name, value in zip(TABLE_INPUTS, tensors, strict=True))]
    if op == OP_TYPE:
        inputs.insert(3, "")  # the bias
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node(op, inputs, ["y"], domain=cpu_ops.DOMAIN, K=k, N=n, bits=bits, block_size=block,
                            **({"codebook": list(codebook)} if codebook is not None else {}), **table.attributes())
    x = helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"]) if op == GATHER_OP_TYPE else \
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(v, name) for name, v in zip(TABLE_INPUTS, tensors, strict=True)
                               if v is not None])
    return custom_op_session(library, graph)


def custom_op_session(library: str, graph: onnx.GraphProto) -> ort.InferenceSession:
    """A session of `graph` with the native CPU ops, on 2 threads."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(cpu_ops.DOMAIN,
                                                                                                     1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def k_quant_values(rng: np.random.Generator, n: int, blocks: int, per_super: int, largest: int,
                   low: int) -> np.ndarray:
    """Per-block values as ggml's k-quants make them: float16 d per super-block times int8 sub-values in [low, 127]
    (the super-block's largest in magnitude `largest`), products in float32: [n, blocks]."""
    d = (rng.random((n, blocks // per_super)) * 1e-3 + 1e-5).astype(np.float16).astype(np.float32)
    sub = rng.integers(low, 128, (n, blocks)) * abs(largest) // 128
    sub.reshape(n, -1, per_super)[:, :, 1] = largest
    return np.repeat(d, per_super, axis=1) * sub.astype(np.float32)


def codes_of(rng: np.random.Generator, bits: int, n: int, k: int, mins: bool = False) -> np.ndarray:
    """Codes as the checkpoint holds them (5/6-bit ones as 8-bit codes near 128, as GGUF's Q5_0 / Q6_K convert;
    2/3-bit ones as 4-bit codes near 8, as Q3_K does; with minimums from 0, as Q2_K / Q5_K), narrowed as the build
    does."""
    stored = 8 if bits in (5, 6) else 4 if bits in (2, 3) else bits
    low = 0 if mins else ZERO_POINT[stored] - ZERO_POINT[bits]
    wide = rng.integers(low, low + (1 << bits), (n, k), dtype=np.uint8)
    codes, packed_bits = narrow(wide, stored, zero_point=not mins)
    assert packed_bits == bits
    if not mins:
        np.testing.assert_array_equal(codes.astype(int) - ZERO_POINT[bits], wide.astype(int) - ZERO_POINT[stored])
    return codes


# (bits, block, scales, minimums, K): scales float32 / float16 (exact in it) / k-quant (two-level products)
FORMATS = [(bits, block, scales, None, 352) for bits in (2, 3, 4, 5, 6, 8) for block in (32, 16)
           for scales in ("float32", "float16")] + [
    (6, 16, "k-quant", None, 512),  # GGUF's Q6_K
    (8, 16, "k-quant", None, 512),
    (3, 16, "k-quant", None, 512),  # Q3_K
    (2, 16, "k-quant", "k-quant", 512),  # Q2_K
    (2, 16, "float16", "float16", 352),
    (5, 16, "float32", "float32", 352),
    (4, 32, "k-quant", "k-quant", 512),  # Q4_K
    (4, 32, "float16", "float16", 352),  # Q4_1
    (4, 32, "float32", "float32", 352),  # float zero points from elsewhere
    (4, 32, "k-quant", "k-quant", 352),  # K not a multiple of 256: one-level float32 scales
]
STORED = {"float32": np.float32, "float16": np.float16, "k-quant": np.int8, "lattice": np.int8}


def format_case(bits: int, block: int, scales_kind: str, mins_kind: str | None, k: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    codes = codes_of(rng, bits, n, k, mins=mins_kind is not None)
    blocks = k // block

    def values(kind: str, largest: int, low: int) -> np.ndarray:
        if kind == "k-quant" and k % 256 == 0:
            return k_quant_values(rng, n, blocks, 256 // block, largest, low)
        if kind == "k-quant":  # products of ggml's kind whose super-blocks do not tile K
            return (rng.random((n, blocks)) * 1e-3).astype(np.float16).astype(np.float32) * \
                rng.integers(1, 64, (n, blocks)).astype(np.float32)
        v = rng.random((n, blocks), dtype=np.float32) * 0.02 + 1e-3
        return v.astype(np.float16).astype(np.float32) if kind == "float16" else v

    # (the largest sub-value, the smallest) of ggml's k-quant scales: Q2_K's (and minimums), Q3_K's, Q6_K's, Q4_K's
    largest, low = {2: (15, 0), 3: (-32, -32), 6: (-128, -128), 8: (-128, -128)}.get(bits, (63, 0))
    scales = values(scales_kind, largest, low)
    mins = values(mins_kind, 15 if bits == 2 else 63, 0) if mins_kind else None
    return codes, scales, mins


@needs_block_quant
@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", FORMATS)
def test_block_quant_matmul_matches_its_reference(library, bits, block, scales_kind, mins_kind, k):
    """Token counts around the tiles of 16 and 8, every tail of AVX2's tiles (1-7) and a task's tokens; rows not a
    multiple of 16 nor of a task's 64 or 128; a zero block in x; every form of scales `pack` chooses."""
    n = 200
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=bits + block + k)
    table = pack(codes, scales, bits, mins)
    two = scales_kind == "k-quant" and k % 256 == 0
    nibbles = two and bits == 2  # Q2_K's sub-values 0..15 (format_case), two a byte
    assert table.scales.dtype == (np.uint8 if nibbles else np.int8 if two else
                                  np.float32 if scales_kind == "k-quant" else STORED[scales_kind])
    assert (table.super_scales is not None) == two and (table.mins is not None) == (mins is not None)
    sess = block_quant_session(library, OP_TYPE, k, n, bits, table, block)
    rng = np.random.default_rng(k)
    # 760: past one task's tokens at K 352 (256 KiB of codes)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 25, 64, 70, 760):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, 32:64] = 0.0
        want = reference_block_quant_matmul(x, codes, scales, bits, mins)
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        w = reference_block_quant_gather(np.arange(n), codes, scales, bits, mins)
        assert np.abs(got - x @ w.T).max() < 0.02 * np.abs(x @ w.T).max()  # and near the float product


@needs_block_quant
@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", [f for f in FORMATS if f[0] in (3, 5, 6)])
def test_both_layouts_of_the_further_bits_give_the_same_products_and_rows(library, bits, block, scales_kind,
                                                                           mins_kind, k):
    """A 3/5/6-bit table whose further bits are packed as its base (what builds on AVX2 CPUs choose) multiplies to
    the very floats its byte-mask planes give (the same integers), and gathers the same rows."""
    n = 37
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=bits + k)
    planes, packed = (pack(codes, scales, bits, mins, high_bits) for high_bits in HIGH_BITS)
    assert packed.attributes().get("high_bits") == "packed" and "high_bits" not in planes.attributes()
    assert packed.codes.shape == planes.codes.shape and not np.array_equal(packed.codes, planes.codes)
    x = np.random.default_rng(bits).standard_normal((19, k)).astype(np.float32)  # a tile, a half tile, the rest
    ys = [block_quant_session(library, OP_TYPE, k, n, bits, t, block).run(None, {"x": x})[0] for t in (planes, packed)]
    np.testing.assert_array_equal(ys[1], ys[0])
    want = reference_block_quant_matmul(x, codes, scales, bits, mins)
    np.testing.assert_allclose(ys[1], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    ids = np.array([0, 15, 16, 36, 5], dtype=np.int64)
    rows = block_quant_session(library, GATHER_OP_TYPE, k, n, bits, packed, block).run(None, {"ids": ids})[0]
    np.testing.assert_array_equal(rows, reference_block_quant_gather(ids, codes, scales, bits, mins))


@needs_block_quant
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("minimums", [False, True])
@pytest.mark.parametrize("high_bits", HIGH_BITS)
def test_block_quant_matmul_sums_the_largest_codes_exactly(library, bits, minimums, high_bits):
    """Every code at its largest (or 0) against activation codes of +-127 (x of one magnitude per block): the dot
    products' largest sums, which the AVX2 tiles add in int16 before widening and would saturate if they added more
    (cpu_ops/block_tile_avx2.h). 8-bit codes without minimums are multiplied as signed there, where code 0 (-128)
    is the largest magnitude."""
    k, n, top = 352, 40, (1 << bits) - 1
    codes = np.full((n, k), top, dtype=np.uint8)
    codes[1::2, 1::2] = 0  # odd rows alternate top and 0
    codes[2::4] = 0
    scales = np.full((n, k // 32), 0.01, dtype=np.float32)
    mins = np.full((n, k // 32), 0.5, dtype=np.float32) if minimums else None
    sess = block_quant_session(library, OP_TYPE, k, n, bits, pack(codes, scales, bits, mins, high_bits))
    x = np.ones((9, k), dtype=np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs
    x[3:] *= np.random.default_rng(bits).choice([-3.0, 2.0], size=(6, k // 32)).repeat(32, axis=1)
    want = reference_block_quant_matmul(x, codes, scales, bits, mins)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", [f for f in FORMATS if f[2] != "float32"])
def test_block_quant_gather_reads_rows_of_the_packed_table_exactly(library, bits, block, scales_kind, mins_kind,
                                                                   k):
    n = 37  # the last group of 16 rows is partly padding
    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, n, seed=bits * block)
    sess = block_quant_session(library, GATHER_OP_TYPE, k, n, bits, pack(codes, scales, bits, mins), block)
    ids = np.array([0, 15, 16, 36, 5, 5], dtype=np.int64)
    np.testing.assert_array_equal(sess.run(None, {"ids": ids})[0],
                                  reference_block_quant_gather(ids, codes, scales, bits, mins))
    with pytest.raises(Exception, match="id 37 is outside the table's 37"):
        sess.run(None, {"ids": np.array([37], dtype=np.int64)})


IQ4_CODES = [int(c) for c in gguf_quants.IQ4_CODES]  # GGUF's IQ4_NL / IQ4_XS values + 128


# Codes of few values, as GGUF's IQ types convert (their integer values + 128): IQ4_NL / IQ4_XS's 16; IQ3_S's odd
# -15 .. 15 (all within 16 of 128: `narrow` alone would take 5 bits); IQ2's +-{8, 25, 43}; IQ1's 8 g +- 1; and 4.
IQ3_S_CODES = [128 + v for v in range(-15, 16, 2)]
IQ2_CODES = [128 + s * v for v in (8, 25, 43) for s in (-1, 1)]
IQ1_CODES = [128 + 8 * g + d for g in (-1, 0, 1) for d in (-1, 1)]
# (codes, the bits of their indices, block, scales, K, the largest int8 sub-scale of two-level scales)
CODEBOOK_CASES = [
    (IQ4_CODES, 4, 32, "float16", 352, None),  # IQ4_NL
    (IQ4_CODES, 4, 32, "k-quant", 512, -32),  # IQ4_XS: d * (sc - 32)
    (IQ4_CODES, 4, 16, "float32", 352, None),
    (IQ3_S_CODES, 4, 32, "k-quant", 512, 31),  # d * (1 + 2 s)
    (IQ2_CODES, 3, 32, "lattice", 512, None),  # IQ2_XXS: d * (0.5 + s) * 0.25, d a float16 near 1e-4
    (IQ2_CODES, 3, 16, "k-quant", 512, 31),
    (IQ1_CODES, 3, 16, "float32", 352, None),
    ([100, 128, 140, 200], 2, 32, "float16", 352, None),
]


def codebook_case(values, bits, block, scales_kind, k, largest) -> tuple:
    """(rng, the codebook's indices, the 8-bit codes, their scales, the packed table, its codebook) of a
    CODEBOOK_CASES case, checking that `compact` holds the codes as indices into a codebook and `pack` stores the
    scales as it should."""
    rng = np.random.default_rng(k + block + bits)
    n = 200
    wide = np.array(values, dtype=np.uint8)[rng.integers(0, len(values), (n, k))]
    codes, got_bits, codebook = compact(wide, 8)
    assert got_bits == bits and codebook[:len(values)] == tuple(sorted(values)) and codes.max() == len(values) - 1
    np.testing.assert_array_equal(np.array(codebook, np.uint8)[codes], wide)
    _, scales, _ = format_case(4, block, scales_kind, None, k, n, seed=k)
    if scales_kind == "k-quant":
        scales = k_quant_values(rng, n, k // block, 256 // block, largest, min(largest, 1))
    if scales_kind == "lattice":  # d / 8 lies below float16's normal range: stored 2^-scale_exponent times larger
        d = (rng.random((n, k // 256)) * 4e-4 + 1e-4).astype(np.float16).astype(np.float32)
        scales = np.repeat(d, 256 // block, axis=1) * (0.5 + rng.integers(0, 16, (n, k // block))) * np.float32(0.25)
        scales = scales.astype(np.float32)
    table = pack(codes, scales, bits)
    assert table.scales.dtype == STORED[scales_kind] and (table.scale_exponent < 0) == (scales_kind == "lattice")
    return rng, codes, wide, scales, table, codebook


@needs_block_quant
@pytest.mark.parametrize("values,bits,block,scales_kind,k,largest", CODEBOOK_CASES)
def test_codes_of_few_values_into_a_codebook(library, values, bits, block, scales_kind, k, largest):
    """8-bit codes that take 16 values or fewer (8, 4) are held as 4-bit (3-, 2-bit) indices into a codebook of
    those codes (`compact`), and multiplied as the 8-bit codes are."""
    rng, codes, wide, scales, table, codebook = codebook_case(values, bits, block, scales_kind, k, largest)
    sess = block_quant_session(library, OP_TYPE, k, len(wide), bits, table, block, codebook)
    for m in (1, 9, 70):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = reference_block_quant_matmul(x, codes, scales, bits, codebook=codebook)
        np.testing.assert_allclose(want, reference_block_quant_matmul(x, wide, scales, 8))  # what the 8-bit codes give
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("values,bits,block,scales_kind,k,largest", CODEBOOK_CASES)
def test_codes_of_few_values_are_gathered_through_their_codebook(library, values, bits, block, scales_kind, k,
                                                                 largest):
    """The rows BlockQuantGather reads from a codebook's indices are those of the 8-bit codes (any CPU: the gather
    needs no AVX-512)."""
    _, _, wide, scales, table, codebook = codebook_case(values, bits, block, scales_kind, k, largest)
    gather = block_quant_session(library, GATHER_OP_TYPE, k, len(wide), bits, table, block, codebook)
    ids = np.array([0, 15, 16, 199, 5], dtype=np.int64)
    np.testing.assert_array_equal(gather.run(None, {"ids": ids})[0],
                                  reference_block_quant_gather(ids, wide, scales, 8))


def mxfp4_weight(rng: np.random.Generator, n: int, k: int, magnitude: float = 1.0) -> tuple[np.ndarray, NBitsWeight]:
    """(raw GGUF MXFP4 blocks [n, k / 32 * 17], their nbits form) of random rows quantized by gguf-py (ggml's
    quantizer): magnitudes varying by row and by block, so exponents differ within a row; row 1's second block all
    zero (ggml gives it exponent 0: a scale of 2^-128)."""
    x = rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1)) * np.repeat(rng.uniform(0.1, 1, (n, k // 32)), 32,
                                                                               axis=1)
    x[1, 32:64] = 0
    raw = gguf.quants.quantize((x * magnitude).astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    return raw, gguf_quants.gguf_to_nbits(raw, gguf.GGMLQuantizationType.MXFP4, (n, k))


MXFP4_BOOK = (*sorted(set(int(c) for c in gguf_quants.MXFP4_CODES)), 128)  # its 15 distinct codes, then padding


MXFP4_CASES = pytest.mark.parametrize("k,magnitude,stored", [(352, 1.0, np.float16), (512, 1.0, np.int8),
                                                              (352, 1e-7, np.float32)],
                                      ids=["float16", "two_level", "below_float16"])


def mxfp4_case(k: int, magnitude: float, stored: type) -> tuple:
    """(rng, raw GGUF blocks, their nbits form, its packed table, bits, codebook) of an MXFP4_CASES case, checking
    that `pack_nbits` packs it as the build does."""
    rng = np.random.default_rng(k)
    raw, w = mxfp4_weight(rng, 200, k, magnitude)
    assert w.scales[1, 1] == 2.0 ** -128
    table, bits, codebook = pack_nbits(w.codes, w.scales, None, 200, k, 8)
    assert bits == 4 and codebook == MXFP4_BOOK and table.scales.dtype == stored
    assert (table.super_scales is not None) == (stored == np.int8)
    return rng, raw, w, table, bits, codebook


@needs_block_quant
@MXFP4_CASES
def test_mxfp4_weights_are_4_bit_indices_into_their_15_values(library, k, magnitude, stored):
    """GGUF's MXFP4 as converted (8-bit codes e2m1 x 2 + 128, scales 2^(e - 128)) packs as the build packs it
    (`pack_nbits`): 4-bit indices into a codebook of its 15 codes, scales in float16 where every one is exact in it
    (an all-zero block's 2^-128 does not count: its weights are 0 under any scale), as int8 x float16 per 256 where K
    allows, float32 where they lie below float16's range; BlockQuantMatMul computes the reference, and the gathered
    rows are gguf-py's dequantized values to the bit (test_mxfp4_rows_gather_as_gguf_py_dequantizes_them)."""
    rng, raw, w, table, bits, codebook = mxfp4_case(k, magnitude, stored)
    n = 200
    indices = compact(w.codes, 8).codes
    sess = block_quant_session(library, OP_TYPE, k, n, bits, table, 32, codebook)
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    for m in (1, 9, 70):
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = reference_block_quant_matmul(x, indices, w.scales, bits, codebook=codebook)
        np.testing.assert_allclose(want, reference_block_quant_matmul(x, w.codes, w.scales, 8))
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        exact = x.astype(np.float64) @ weight.T.astype(np.float64)
        assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()  # int8 activations' rounding only


@MXFP4_CASES
def test_mxfp4_rows_gather_as_gguf_py_dequantizes_them(library, k, magnitude, stored):
    """MXFP4 packed as the build packs it: BlockQuantGather's rows are gguf-py's dequantized values to the bit (any
    CPU: the gather needs no AVX-512)."""
    _, raw, _, table, bits, codebook = mxfp4_case(k, magnitude, stored)
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    gather = block_quant_session(library, GATHER_OP_TYPE, k, 200, bits, table, 32, codebook)
    ids = np.array([0, 1, 15, 16, 199], dtype=np.int64)
    np.testing.assert_array_equal(gather.run(None, {"ids": ids})[0], weight[ids])


@pytest.mark.skipif(BLOCK_QUANT, reason="this CPU has AVX-512 VNNI or AVX2: BlockQuantMatMul runs")
def test_block_quant_matmul_refuses_a_cpu_without_its_instructions(library):
    """Without AVX-512 VNNI or AVX2 the op refuses to run, saying how to build without it."""
    codes, scales, _ = format_case(4, 32, "float32", None, 352, 16, seed=0)
    with pytest.raises(Exception, match=r"this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C; rebuild the "
                                        r"engine with `--quant-linears ort`"):
        block_quant_session(library, OP_TYPE, 352, 16, 4, pack(codes, scales, 4)).run(
            None, {"x": np.zeros((1, 352), np.float32)})


@needs_block_quant
def test_block_quant_matmul_refuses_what_it_cannot_run(library):
    def run(k: int, table: PackedTable, bits: int = 4) -> None:
        block_quant_session(library, OP_TYPE, k, 8, bits, table).run(None, {"x": np.zeros((1, k), np.float32)})

    with pytest.raises(Exception, match="K must be a multiple of 32"):
        run(48, PackedTable(np.zeros((1, 1, 256), np.uint8), np.ones((1, 1, 16), np.float32)))
    with pytest.raises(Exception, match=r"do not hold ceil\(N / 16\) groups of 16 rows"):
        run(64, PackedTable(np.zeros((8, 2, 16), np.uint8), np.ones(16, np.float32)))  # MatMulNBits' layout
    with pytest.raises(Exception, match="scales must be float, float16, int8 or uint8"):
        run(64, PackedTable(np.zeros((1, 2, 256), np.uint8), np.ones((1, 2, 16), np.int32)))
    with pytest.raises(Exception, match="nibble \\(uint8\\) scales need block_size 16"):
        run(256, PackedTable(np.zeros((1, 8, 256), np.uint8), np.ones((1, 8, 16), np.uint8),
                             np.ones((1, 1, 16), np.float16)))
    with pytest.raises(Exception, match="int8 or uint8 scales need float16 super-scales"):
        run(256, PackedTable(np.zeros((1, 8, 256), np.uint8), np.ones((1, 8, 16), np.int8)))
    with pytest.raises(Exception, match="two-level scales need K a multiple of 256"):
        run(64, PackedTable(np.zeros((1, 2, 256), np.uint8), np.ones((1, 2, 16), np.int8),
                            np.ones((1, 0, 16), np.float16)))
    with pytest.raises(Exception, match='high_bits must be "planes" or "packed", got "masks"'):
        run(64, PackedTable(np.zeros((1, 2, 320), np.uint8), np.ones((1, 2, 16), np.float16), high_bits="masks"), 5)
    with pytest.raises(Exception, match="the minimums must have the scales' type and shape"):
        run(64, PackedTable(np.zeros((1, 2, 256), np.uint8), np.ones((1, 2, 16), np.float16), None,
                            np.ones((1, 2, 16), np.float32)))

    def run_codebook(bits: int, codebook: list[int], mins: bool = False) -> None:
        table = PackedTable(np.zeros((1, 2, 64 * bits), np.uint8), np.ones((1, 2, 16), np.float16), None,
                            np.ones((1, 2, 16), np.float16) if mins else None)
        block_quant_session(library, OP_TYPE, 64, 8, bits, table, codebook=codebook).run(
            None, {"x": np.zeros((1, 64), np.float32)})

    with pytest.raises(Exception, match="a codebook holds 16 codes, for 2-, 3- or 4-bit ones"):
        run_codebook(5, IQ4_CODES)
    with pytest.raises(Exception, match="a codebook holds 16 codes, for 2-, 3- or 4-bit ones"):
        run_codebook(4, IQ4_CODES[:8])
    with pytest.raises(Exception, match="codebook entries must be 8-bit codes"):
        run_codebook(4, [256] * 16)
    with pytest.raises(Exception, match="a codebook comes without minimums"):
        run_codebook(4, IQ4_CODES, mins=True)
