"""`pack` and its helpers (plugins/block_quant_matmul.py): codebooks, two-level scales, narrowing, row chunks, the
layouts of the further bits."""

from __future__ import annotations

import numpy as np
import pytest
from test_block_quant_ops import IQ3_S_CODES, format_case, k_quant_values

from trtbuild.plugins import block_quant_matmul as bq
from trtbuild.plugins.block_quant_matmul import (
    compact,
    compact_form,
    narrow,
    pack,
    two_level,
    unpack_nbits,
)
from trtbuild.plugins.block_quant_reference import reference_block_quant_gather


def test_compact_takes_a_codebook_only_where_it_holds_8_bit_codes_in_fewer_bits():
    rng = np.random.default_rng(3)
    assert compact(rng.integers(0, 256, (4, 64)).astype(np.uint8), 8).codebook is None  # Q8_0
    assert compact(rng.integers(112, 144, (4, 64)).astype(np.uint8), 8)[1:] == (5, None)  # Q5_0: narrowed
    few = np.array([[3, 200, 3, 77]], dtype=np.uint8)
    codes, bits, codebook = compact(few, 8)
    assert bits == 2 and codebook[:3] == (3, 77, 200) and codes.tolist() == [[0, 2, 0, 1]]
    assert compact(few, 8, zero_point=False).codebook is None  # minimums: the codes are the weights' own
    assert compact(rng.integers(0, 16, (4, 64)).astype(np.uint8), 4).codebook is None
    assert compact_form(np.array([IQ3_S_CODES], np.uint8), 8) == (4, tuple(IQ3_S_CODES))


def test_two_level_takes_each_super_blocks_smallest_sub_values():
    """Sub-values as small as exact factors allow, so that 0..15 fit nibbles: a Q2_K-like super-block whose largest
    sub-scale is 13 keeps 13 (not 8 x 13 under d / 8); multiples a first candidate fitted are divided back (63 = 9 x
    7, an IQ1_M super-block's), and all-negative ones made positive."""
    from trtbuild.plugins.block_quant_matmul import _smallest_factors

    d = np.float32(2.0 ** -9)
    sub, sup = two_level((d * np.array([[13, 1, 7, 0, 5, 9, 11, 3] * 2], np.float32)), 16)
    assert sub.tolist() == [[13, 1, 7, 0, 5, 9, 11, 3] * 2] and sup.item() == d
    sub, sup = two_level(-(d * np.array([[7, 21, 14, 0] * 4], np.float32)), 16)
    assert sub.tolist() == [[1, 3, 2, 0] * 4] and sup.item() == -7 * d
    sub, sup = _smallest_factors(np.array([[63, 9, 27, 45], [-4, -8, 0, -12]], np.int8),
                                 np.array([2.0 ** -12, 2.0 ** -10], np.float16))
    assert sub.tolist() == [[7, 1, 3, 5], [1, 2, 0, 3]] and sup.tolist() == [9 * 2.0 ** -12, -4 * 2.0 ** -10]


def test_two_level_factors_ggml_products_exactly_and_nothing_else():
    rng = np.random.default_rng(0)
    q4_k = k_quant_values(rng, 48, 32, 8, 63, 0)
    sub, sup = two_level(q4_k, 8)
    np.testing.assert_array_equal(np.repeat(sup.astype(np.float32), 8, axis=1) * sub.astype(np.float32), q4_k)
    q6_k = k_quant_values(rng, 48, 32, 16, -128, -128)
    sub, sup = two_level(q6_k, 16)
    assert sub.min() == -128
    np.testing.assert_array_equal(np.repeat(sup.astype(np.float32), 16, axis=1) * sub.astype(np.float32), q6_k)
    odd = k_quant_values(rng, 48, 32, 8, 31, 0)
    sub, sup = two_level(odd, 8)  # the largest need not be 63: other sub-values are tried
    np.testing.assert_array_equal(np.repeat(sup.astype(np.float32), 8, axis=1) * sub.astype(np.float32), odd)
    assert two_level(rng.random((48, 32), dtype=np.float32), 8) is None
    nudged = q4_k.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(1))
    assert two_level(nudged, 8) is None  # one ulp off: not exact
    sub, sup = two_level(nudged, 8, tolerance=1e-6)  # minimums recovered from float zero points: within 1e-6
    np.testing.assert_array_equal(np.repeat(sup.astype(np.float32), 8, axis=1) * sub.astype(np.float32), q4_k)


def test_two_level_tries_the_samples_sub_values_first_and_the_rest_after():
    """Past a sample, the sub-values its super-blocks' largest took are tried first (a max / 127 quantizer's 127,
    ~250th in the candidates' order); super-blocks those miss still get every candidate, and one that factors
    nowhere still fails the table."""
    from trtbuild.plugins.block_quant_matmul import _SAMPLE

    rng = np.random.default_rng(1)
    table = k_quant_values(rng, 512, 32, 8, 127, 0)  # 4 super-blocks a row: the sample is the first 16 rows
    table[128:] = k_quant_values(rng, 384, 32, 8, 100, 0)
    sub, sup = two_level(table, 8)
    np.testing.assert_array_equal(np.repeat(sup.astype(np.float32), 8, axis=1) * sub.astype(np.float32), table)
    assert sub[:_SAMPLE // 4].max() == 127 and sub[128:].max() == 100
    table[300, :8] = rng.random(8, dtype=np.float32)
    assert two_level(table, 8) is None


def test_distinct_codes_stop_counting_past_the_limit(monkeypatch):
    from trtbuild.plugins import block_quant_matmul as bqm

    monkeypatch.setattr(bqm, "_COUNT_CHUNK", 64)
    few = np.array([[7, 130, 7, 9] * 64], dtype=np.uint8)
    assert bqm._distinct(few, 4).tolist() == [7, 9, 130]
    assert bqm._distinct(few, 2) is None
    late = np.zeros((4, 256), dtype=np.uint8)
    late[3, :20] = np.arange(20)  # the 20 values only in the last chunk
    assert bqm._distinct(late, 16) is None and len(bqm._distinct(late, 32)) == 20


def test_a_block_of_zero_codes_keeps_two_level_scales_with_minimums():
    """A GGUF Q4_K block whose scale rounded to 0 is converted as codes 0, scale = its minimum, zero point -1
    (builder/convert/gguf_quants.py): its scale is free, so it must not cost the linear its compact form."""
    rng = np.random.default_rng(1)
    n, k = 16, 256
    scales, mins = k_quant_values(rng, n, 8, 8, 63, 0), k_quant_values(rng, n, 8, 8, 63, 0)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    codes[2, 64:96] = 0
    scales[2, 2] = np.float32(-0.123)  # not a product of the super-block's scale
    table = pack(codes, scales, 4, mins)
    assert table.scales.dtype == np.int8
    np.testing.assert_array_equal(reference_block_quant_gather(np.arange(n), codes, scales, 4, mins)[2, 64:96],
                                  -mins[2, 2])


def test_codes_near_the_zero_point_are_narrowed_to_the_fewest_bits_that_hold_them():
    codes, bits = narrow(np.array([[112, 143, 128, 120]], dtype=np.uint8), 8)
    assert bits == 5 and codes.tolist() == [[0, 31, 16, 8]]
    codes, bits = narrow(np.array([[96, 159, 128, 111]], dtype=np.uint8), 8)
    assert bits == 6 and codes.tolist() == [[0, 63, 32, 15]]
    codes, bits = narrow(np.array([[4, 11, 8]], dtype=np.uint8), 4)  # GGUF's Q3_K: q + 4
    assert bits == 3 and codes.tolist() == [[0, 7, 4]]
    codes, bits = narrow(np.array([[6, 9, 8]], dtype=np.uint8), 4)
    assert bits == 2 and codes.tolist() == [[0, 3, 2]]
    codes, bits = narrow(np.array([[0, 3, 1]], dtype=np.uint8), 4, zero_point=False)  # Q2_K: q, with minimums
    assert bits == 2 and codes.tolist() == [[0, 3, 1]]
    codes, bits = narrow(np.array([[0, 7]], dtype=np.uint8), 4, zero_point=False)
    assert bits == 3 and codes.tolist() == [[0, 7]]
    for codes, bits in ((np.array([[95, 128]], np.uint8), 8), (np.array([[128, 160]], np.uint8), 8),
                        (np.array([[0, 15]], np.uint8), 4), (np.array([[3, 8]], np.uint8), 4)):
        same, kept = narrow(codes, bits)
        assert kept == bits and same is codes


def test_unpack_nbits_reads_matmul_nbits_layout():
    rng = np.random.default_rng(2)
    wide = rng.integers(0, 16, (8, 64), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_nbits((wide[:, 0::2] | (wide[:, 1::2] << 4)).reshape(8, 2, 16), 8, 64, 4),
                                  wide)


@pytest.mark.parametrize("bits,block,scales_kind,mins_kind,k", [(6, 16, "k-quant", None, 512),
                                                                  (3, 16, "k-quant", None, 512),
                                                                  (2, 16, "k-quant", "k-quant", 512),
                                                                  (4, 32, "k-quant", "k-quant", 512),
                                                                  (4, 32, "float16", "float16", 352)])
def test_packing_in_row_chunks_gives_the_same_tables(monkeypatch, bits, block, scales_kind, mins_kind, k):
    """`pack` works through a big table a few hundred groups of rows at a time (build memory); the result is the
    same as in one piece."""
    from trtbuild.plugins import block_quant_matmul

    codes, scales, mins = format_case(bits, block, scales_kind, mins_kind, k, 200, seed=5)
    whole = pack(codes, scales, bits, mins)
    monkeypatch.setattr(block_quant_matmul, "_PACK_GROUPS", 3)  # 48 rows a chunk: 5 chunks, the last one short
    chunked = pack(codes, scales, bits, mins)
    assert chunked.scale_exponent == whole.scale_exponent
    for got, want in zip(chunked.tensors(), whole.tensors(), strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_further_bits_are_laid_out_as_the_contract_says(bits):
    """Each code read back from B by the module docstring's formulas, in both layouts of its further bits."""
    rng = np.random.default_rng(bits)
    n, k = 20, 64  # two groups, the second half padding; two chunks
    codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    base, high = bq.base_bits(bits), bits - bq.base_bits(bits)
    for layout in bq.HIGH_BITS:
        b = bq.pack(codes, np.ones((n, k // 32), np.float32), bits, high_bits=layout).codes
        assert b.shape == (2, 2, 16 * 32 * bits // 8)
        for row, col in [(0, 0), (3, 5), (15, 63), (16, 31), (19, 40)]:
            g, r, c, j, i = row // 16, row % 16, col // 32, col % 32 // 4, col % 4
            chunk = b[g, c]
            code = int(chunk[j % base * 64 + 4 * r + i] >> (base * (j // base))) & ((1 << base) - 1)
            further = chunk[base * 64:]
            if layout == "packed":
                code |= (int(further[j % high * 64 + 4 * r + i] >> (high * (j // high))) & ((1 << high) - 1)) << base
            else:
                bit = 64 * j + 4 * r + i
                for plane in range(high):
                    code |= (int(further[plane * 64 + bit // 8] >> (bit % 8)) & 1) << (base + plane)
            assert code == codes[row, col], (layout, row, col)
