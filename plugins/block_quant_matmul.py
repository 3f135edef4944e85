"""The contract of `trtbuild::BlockQuantMatMul` (documented in plugins/README.md): its weight layout and the packing
into it (its numpy reference: plugins/block_quant_reference.py).

A 2/3/4/5/6/8-bit linear with a scale per block of 32 or 16 weights and the default zero point 2^(bits - 1), or
with a scale and a minimum per block (W = scale * code - minimum: GGUF's Q2_K, Q4_K, Q5_K, Q4_1 and Q5_1, whose
checkpoint form has float zero points), computed as llama.cpp does: activations rounded to int8 per block of 32,
exact integer dot products, each weight block scaled by its scale and the activation's; a minimum times the block's
sum of x as quantized. The weights are packed at build time, 16 rows interleaved (cpu_ops/block_matmul.cc says why):

  B uint8 [G, K / 32, 16 * 32 * bits / 8], G = ceil(N / 16): in chunk c of group g, the 8 vectors j of 64 bytes
    whose bytes 4r .. 4r + 3 hold row 16g + r's codes 32c + 4j .. +3. 8-bit: those. Else, with base b = 4 (4/5/6-bit)
    or 2 (2/3-bit), b stored vectors of the codes' low b bits, vector j in bits b * (j / b) .. of stored vector
    j % b (4-bit: j < 4 in the low nibbles, j + 4 in the high ones); then, for 3, 5 and 6 bits, the h = bits - b
    further bits of each code (`high_bits`, attribute, optional):
      "planes" (the default): one 64-byte plane per further bit, whose bit 64j + 4r + i is that of row 16g + r's
        element 32c + 4j + i (a byte mask of vector j: AVX-512 adds it under the mask in one instruction);
      "packed": h 64-byte vectors packed as the base is, vector j's further bits in bits h * (j / h) .. of stored
        vector j % h (one shift and mask a vector with AVX2, where expanding a mask to bytes takes five).
  scales [G, K / block, 16]: S[g, b, r] is the scale of row 16g + r in block b, stored (`pack`) in the first form
    that holds every scale exactly: int8 times a float16 super-scale [G, K / 256, 16] per row and 256 elements
    (GGUF's k-quants are such products: Q4_K then takes 4.6 bits a weight, not 6; in blocks of 16 with sub-values
    0..15, as Q2_K's, uint8 [G, K / 32, 16] nibbles, block 2c's low and 2c + 1's high), float16 (GGUF's Q4_0 / Q8_0
    scales: 11% fewer bytes per 4-bit weight than float32), else float32.
  mins (optional), in the scales' form: the minimums, recovered from the checkpoint's float zero points (zp * scale,
    to float32 rounding; a two-level or float16 form is taken when it matches them to 1e-6 relative, and then gives
    ggml's own products back).
  codebook (attribute, optional; 2/3/4-bit codes without minimums): 16 8-bit codes (zero point 128) that the
    codes index: `compact` finds one where a checkpoint's 8-bit codes take 16 values or fewer (8, 4), as GGUF's
    IQ4_NL / IQ4_XS tensors (their non-uniform values + 128), MXFP4 ones (15 values) and lattice types
    (builder/convert/gguf_lattice.py: IQ3's 16 values, IQ1's and IQ2's 6) are converted, and so holds them in 4 (3, 2)
    bits a weight.
  scale_exponent (attribute, optional): the weights are 2^scale_exponent times what the scales and minimums say:
    `pack` stores two-level values that much larger where their float16 super-scales would otherwise fall below
    float16's normal range and lose bits (GGUF's lattice types: d / 8 with d near 1e-4), which the kernel undoes
    exactly (a power of two).
Rows past N (padding) have code zp and scale 0. 2-, 3-, 5- and 6-bit codes are not a checkpoint format (MatMulNBits
has 4 and 8): `narrow` finds them among 8-bit ones, as GGUF's Q5_0 and Q6_K tensors are converted (code q - 16 + 128
or q - 32 + 128) and Q5_K / Q5_1 ones (code q, with minimums), and among 4-bit ones, as Q3_K (code q - 4 + 8) and
Q2_K (code q, with minimums) are, and packs them in as many bits a weight as they need, exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "BlockQuantMatMul"
GATHER_OP_TYPE = "BlockQuantGather"  # rows of a packed table, dequantized (a tied embedding reads its lm_head's)
BLOCK = 32  # activation blocks, and the weights' chunks
WEIGHT_BLOCKS = (16, 32)
ROWS = 16  # rows per group: one per int32 lane of a 512-bit vector
BITS = (2, 3, 4, 5, 6, 8)
HIGH_BITS = ("planes", "packed")  # how the codes' bits above the base are laid out (the module docstring)
ZERO_POINT = {bits: 1 << (bits - 1) for bits in BITS}
_NARROWER = {4: (2, 3), 8: (5, 6)}  # the packed widths a checkpoint's codes may fit in, smallest first
SUPER_BLOCK = 256  # elements per super-scale of two-level scales
MINS_TOLERANCE = 1e-6  # how near (relative) a compact form of the minimums must come to the checkpoint's


class PackedTable(NamedTuple):
    """A linear's weights in the kernel's layout: the inputs B, scales and the optional ones (plugins/README.md),
    and the attributes `scale_exponent` (the weights are 2^scale_exponent times what the inputs hold) and
    `high_bits` (how B holds the codes' bits above the base)."""

    codes: np.ndarray
    scales: np.ndarray  # float32, float16, or int8 with super_scales
    super_scales: np.ndarray | None = None
    mins: np.ndarray | None = None  # like scales, with super_mins where scales are int8
    super_mins: np.ndarray | None = None
    scale_exponent: int = 0
    high_bits: str = "planes"

    def tensors(self) -> tuple[np.ndarray | None, ...]:
        """The op's table inputs, in order (None where absent)."""
        return tuple(self)[:len(TABLE_FIELDS)]

    def attributes(self) -> dict:
        """The op's attributes that this table sets, beside K, N, bits and block_size (absent: the default)."""
        return {**({"scale_exponent": self.scale_exponent} if self.scale_exponent else {}),
                **({"high_bits": self.high_bits} if self.high_bits != "planes" else {})}


TABLE_FIELDS = PackedTable._fields[:5]  # the tensors


def unpack_nbits(b: np.ndarray, n: int, k: int, bits: int) -> np.ndarray:
    """MatMulNBits' B (uint8 [N, K / block, block * bits / 8]; 4-bit: element 2j in the low nibble of byte j) as
    codes [N, K]."""
    flat = b.reshape(n, -1)
    if bits == 8:
        return flat
    codes = np.empty((n, k), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = flat & 0x0F, flat >> 4
    return codes


class Compact(NamedTuple):
    """A checkpoint's codes as the kernel holds them: codes, their bits, and the codebook they index (or None)."""

    codes: np.ndarray
    bits: int
    codebook: tuple[int, ...] | None = None


CODEBOOK_SIZE = 16
CODEBOOK_BITS = (2, 3, 4)  # the widths of indices into a codebook
CODEBOOK_ZERO_POINT = 128


def _codebook(codes: np.ndarray, bits: int, zero_point: bool,
              narrow_bits: int) -> tuple[np.ndarray, int, tuple[int, ...]] | None:
    """(the codes used, the bits of indices into them, the 16-entry codebook of them) where 8-bit codes with the
    default zero point take so few values that indices need fewer bits than `narrow_bits`, else None."""
    widest = max((b for b in CODEBOOK_BITS if b < narrow_bits), default=None)
    if bits != 8 or not zero_point or not codes.size or widest is None:
        return None
    if (used := _distinct(codes, 1 << widest)) is None:
        return None
    index_bits = next(b for b in CODEBOOK_BITS if len(used) <= 1 << b)
    return used, index_bits, (*(int(c) for c in used), *[CODEBOOK_ZERO_POINT] * (CODEBOOK_SIZE - len(used)))


_COUNT_CHUNK = 1 << 20


def _distinct(codes: np.ndarray, limit: int) -> np.ndarray | None:
    """The distinct uint8 codes, or None as soon as there are more than `limit`. NOTE: counted a chunk at a time, so
    a table of many values stops after its first MB (and bincount's int64 copy of a token table is not GBs)."""
    flat = codes.reshape(-1)
    seen = np.zeros(256, dtype=bool)
    for start in range(0, flat.size, _COUNT_CHUNK):
        seen |= np.bincount(flat[start:start + _COUNT_CHUNK], minlength=256).astype(bool)
        if np.count_nonzero(seen) > limit:
            return None
    return np.flatnonzero(seen)


def compact(codes: np.ndarray, bits: int, zero_point: bool = True) -> Compact:
    """The fewest bits that hold a checkpoint's codes [N, K] exactly: `narrow`, or, for 8-bit codes with the default
    zero point that take at most 16 (8, 4) values, 4-bit (3-, 2-bit) indices into a codebook of those codes."""
    if (found := _codebook(codes, bits, zero_point, _narrow_bits(codes, bits, zero_point))) is None:
        return Compact(*narrow(codes, bits, zero_point))
    used, index_bits, book = found
    index = np.zeros(256, np.uint8)
    index[used] = np.arange(len(used))  # NOTE: a lookup, not searchsorted: its int64 indices of a token table are GBs
    return Compact(index[codes], index_bits, book)


def compact_form(codes: np.ndarray, bits: int, zero_point: bool = True) -> tuple[int, tuple[int, ...] | None]:
    """`compact`'s bits and codebook, without making its codes."""
    narrow_bits = _narrow_bits(codes, bits, zero_point)
    found = _codebook(codes, bits, zero_point, narrow_bits)
    return (narrow_bits, None) if found is None else (found[1], found[2])


def narrow(codes: np.ndarray, bits: int, zero_point: bool = True) -> tuple[np.ndarray, int]:
    """8-bit (4-bit) codes [N, K] that fit in 5 or 6 (2 or 3) bits as those, with the fewest bits that hold them; any
    other codes as they are, with `bits`. With the default zero point the codes must lie within 2^(narrow - 1) of it:
    they become code - (zp - narrow zp), e.g. 8-bit codes within 16 of 128 become code - 112, zero point 16. Without
    (minimums), codes below 2^narrow stay as they are."""
    if (narrower := _narrower(codes, bits, zero_point)) is None:
        return codes, bits
    narrow_bits, offset = narrower
    return codes - np.uint8(offset), narrow_bits


def _narrow_bits(codes: np.ndarray, bits: int, zero_point: bool) -> int:
    """The bits `narrow` packs the codes in."""
    return narrower[0] if (narrower := _narrower(codes, bits, zero_point)) is not None else bits


def _narrower(codes: np.ndarray, bits: int, zero_point: bool) -> tuple[int, int] | None:
    """(the fewest bits, the offset subtracted) of `narrow`, or None where the codes need all `bits`."""
    if codes.size and bits in _NARROWER:
        low, high = int(codes.min()), int(codes.max())
        for narrow_bits in _NARROWER[bits]:
            offset = ZERO_POINT[bits] - ZERO_POINT[narrow_bits] if zero_point else 0
            if low >= offset and high < offset + (1 << narrow_bits):
                return narrow_bits, offset
    return None


# The int8 sub-value a super-block's largest value most likely has, first: ggml's Q4_K scales and minimums
# (63), Q6_K scales (-128), Q3_K ones (-32) and Q2_K scales and minimums (15); the others are tried for what remains.
_FIRST_CANDIDATES = (63, -128, -32, 15)
# NOTE: the others smallest first: a super-block's smallest exact sub-values (its largest float16 super-scale), which
# fit nibbles where they can (a Q2_K super-block whose largest sub-scale is 13: 13 x d, not 104 x d / 8) and keep the
# super-scale away from float16's subnormals
_SUB_CANDIDATES = (*_FIRST_CANDIDATES,
                   *(c for m in range(1, 129) for c in (m, -m) if -128 <= c <= 127 and c not in _FIRST_CANDIDATES))
_SAMPLE = 64  # super-blocks tried with every candidate before all the rest are


def two_level(values: np.ndarray, per_super: int, tolerance: float = 0.0) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-block values [rows, blocks] as int8 sub-values [rows, blocks] times a float16 per row and `per_super`
    blocks [rows, blocks / per_super], whose float32 products equal them (tolerance 0) or lie within `tolerance`
    (relative) of them; None when some super-block has no such factors."""
    rows, blocks = values.shape
    want = values.reshape(-1, per_super).astype(np.float32)
    largest_at = np.abs(want).argmax(axis=1)
    big = want[np.arange(len(want)), largest_at].astype(np.float64)
    sub = np.zeros(want.shape, np.int8)
    sup = np.zeros(len(want), np.float16)

    def solve(todo: np.ndarray, candidates: tuple[int, ...]) -> np.ndarray:
        """Factor super-blocks `todo` with the first of `candidates` that works; returns those left."""
        for c in candidates:
            if not len(todo):
                break
            w = want[todo]
            # NOTE: float32 is enough: where d * q gives w exactly, w / d is within an ulp of the integer q. A d of 0
            # or inf gives q or products of inf / nan, which the checks below reject.
            with np.errstate(all="ignore"):
                d = (big[todo] / c).astype(np.float16)
                d32 = d.astype(np.float32)[:, None]
                q = np.rint(w / d32)
                product = d32 * q
                close = product == w if not tolerance else np.abs(product - w) <= tolerance * np.abs(w)
            ok = np.all((q >= -128) & (q <= 127) & close, axis=1)
            sub[todo[ok]], sup[todo[ok]] = q[ok].astype(np.int8), d[ok]
            todo = todo[~ok]
        return todo

    first = len(_FIRST_CANDIDATES)
    todo = solve(np.flatnonzero(big != 0), _FIRST_CANDIDATES)  # an all-zero super-block is 0 x 0
    # NOTE: a float model's scales factor nowhere: a sample tells before ~250 passes over all of them
    sample, todo = todo[:_SAMPLE], todo[_SAMPLE:]
    if len(solve(sample, _SUB_CANDIDATES[first:])):
        return None
    # NOTE: one quantizer's super-blocks share the sub-value of their largest (127 for a max / 127 convention): the
    # sample's go first, so the rest take a pass or two, not one per candidate before it
    found = np.unique(sub[sample, largest_at[sample]], return_counts=True)
    learned = tuple(int(c) for c in found[0][np.argsort(-found[1], kind="stable")])
    todo = solve(todo, learned)
    if len(solve(todo, tuple(c for c in _SUB_CANDIDATES[first:] if c not in learned))):
        return None
    sub, sup = _smallest_factors(sub, sup)
    return sub.reshape(rows, blocks), sup.reshape(rows, blocks // per_super)


def _smallest_factors(sub: np.ndarray, sup: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each super-block's factors with the sub-values divided by their common divisor (and made positive where all
    are <= 0), the super-scale multiplied by it where float16 holds that exactly: the same float32 products. (A
    first candidate can fit in a multiple: an IQ1_M super-block whose sub-scales 1 + 2 s reach 7 factors as 63 =
    9 x 7 first; divided back, sub-values of 0..15 fit nibbles.)"""
    g = np.gcd.reduce(np.abs(sub.astype(np.int32)), axis=1)
    negative = (sub <= 0).all(axis=1) & (sub.min(axis=1, initial=0) >= -127)
    factor = np.where(g == 0, 1, g) * np.where(negative, -1, 1)
    with np.errstate(over="ignore"):
        bigger = (sup.astype(np.float32) * factor).astype(np.float16)
    ok = bigger.astype(np.float32) == sup.astype(np.float32) * factor
    factor = np.where(ok, factor, 1)
    return (sub.astype(np.int32) // factor[:, None]).astype(np.int8), np.where(ok, bigger, sup)


_SMALLEST_NORMAL_HALF = 2.0 ** -14


def _super_shifts(values: list[np.ndarray], per_super: int) -> tuple[int, ...]:
    """The powers of two to try scaling the per-block values by before factoring them: 0, then, where some super-block
    is so small that its super-scale would fall below float16's normal range (which holds fewer bits), the one that
    lifts every super-scale into it (GGUF's lattice types: scales d * (1 + 2 s) / 8, d a float16 near 1e-4)."""
    largest = np.concatenate([np.abs(v.reshape(-1, per_super)).max(axis=1) for v in values])
    smallest = largest[largest > 0].min(initial=np.inf)
    if not np.isfinite(smallest):
        return (0,)
    shift = int(np.ceil(np.log2(np.iinfo(np.int8).max * _SMALLEST_NORMAL_HALF / smallest)))
    return (0, shift) if shift > 0 else (0,)


def _half(values: np.ndarray, tolerance: float = 0.0) -> np.ndarray | None:
    """`values` as float16 when that holds each exactly (or within `tolerance`, relative), else None."""
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)
    back = half.astype(np.float32)
    ok = np.array_equal(back, values) if not tolerance else np.all(np.abs(back - values) <= tolerance * np.abs(values))
    return half if ok else None


def base_bits(bits: int) -> int:
    """The bits per code of the packed layout's base vectors (the rest are `high_bits`): 2, 4 or 8."""
    return 2 if bits <= 3 else 4 if bits <= 6 else 8


_PACK_GROUPS = 512  # groups of 16 rows packed at a time: a vocabulary-sized table's temporaries stay ~10 MB


def _interleave(c: np.ndarray, width: int) -> np.ndarray:
    """Codes c [G, r, c, j, i] of `width` bits packed as the base is: vector j in bits width * (j // width) of
    stored vector j % width; [G, chunks, width * 64] bytes."""
    stored = np.bitwise_or.reduce([c[:, :, :, s * width:(s + 1) * width] << np.uint8(s * width)
                                   for s in range(8 // width)], axis=0)
    return np.ascontiguousarray(stored.transpose(0, 2, 3, 1, 4)).reshape(c.shape[0], c.shape[2], -1)


def _pack_codes(codes: np.ndarray, bits: int, pad: int, high_bits: str) -> np.ndarray:
    """B of the contract for codes [rows, K], rows past the last multiple of 16 padded with code `pad`."""
    n, k = codes.shape
    groups, chunks = -(-n // ROWS), k // BLOCK
    padded = np.full((groups * ROWS, k), pad, dtype=np.uint8)
    padded[:n] = codes
    # [G, r, c, j, i]: element 32c + 4j + i of row 16g + r
    c = padded.reshape(groups, ROWS, chunks, 8, 4)
    base = base_bits(bits)
    if base == 8:
        return np.ascontiguousarray(c.transpose(0, 2, 3, 1, 4)).reshape(groups, chunks, -1)
    high = []
    if bits > base and high_bits == "packed":
        high.append(_interleave(c >> np.uint8(base), bits - base))
    else:
        for plane in range(bits - base):  # [G, c, j, r, i] the further bits, 64 per j
            mask = ((c >> (base + plane)) & 1).transpose(0, 2, 3, 1, 4).reshape(groups, chunks, 8, 64)
            high.append(np.packbits(mask, axis=-1, bitorder="little").reshape(groups, chunks, 64))
    return np.concatenate([_interleave(c & np.uint8((1 << base) - 1), base), *high], axis=2)


def _two_level_by_rows(values: np.ndarray, per_super: int, tolerance: float) -> tuple[np.ndarray, np.ndarray] | None:
    """two_level over row chunks (it is row by row: only the temporaries shrink)."""
    step = _PACK_GROUPS * ROWS
    parts = []
    for r in range(0, len(values), step):
        if (part := two_level(values[r:r + step], per_super, tolerance)) is None:
            return None
        parts.append(part)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def pack(codes: np.ndarray, scales: np.ndarray, bits: int, mins: np.ndarray | None = None,
         high_bits: str = "planes") -> PackedTable:
    """The kernel's tensors from codes [N, K] (0 .. 2^bits - 1), per-block scales [N, K / block] and, for W = scale *
    code - minimum (the codes then have no zero point), per-block minimums like the scales; 3/5/6-bit codes' further
    bits laid out as `high_bits` says (HIGH_BITS)."""
    if high_bits not in HIGH_BITS:
        raise ValueError(f"high_bits must be one of {HIGH_BITS}, got {high_bits!r}")
    if bits == base_bits(bits):  # no further bits: the attribute stays at its default
        high_bits = "planes"
    n, k = codes.shape
    groups = -(-n // ROWS)
    blocks = scales.size // n
    step = _PACK_GROUPS * ROWS
    b = np.concatenate([_pack_codes(codes[r:r + step], bits, 0 if mins is not None else ZERO_POINT[bits], high_bits)
                        for r in range(0, n, step)])
    values = [np.zeros((groups * ROWS, blocks), dtype=np.float32) for _ in range(1 if mins is None else 2)]
    values[0][:n] = scales.reshape(n, blocks)
    if mins is not None:
        values[1][:n] = mins.reshape(n, blocks)
        # a block whose codes are all 0 is its minimum alone: its scale is free, and 0 factors with any super-scale
        values[0][:n][codes.reshape(n, blocks, -1).max(axis=2) == 0] = 0
    tolerances = (0.0, MINS_TOLERANCE)

    def layout(t: np.ndarray) -> np.ndarray:  # [G * 16, columns] -> [G, columns, 16]
        return np.ascontiguousarray(t.reshape(groups, ROWS, -1).transpose(0, 2, 1))

    per_super = SUPER_BLOCK * blocks // k
    for shift in _super_shifts(values, per_super) if k % SUPER_BLOCK == 0 else ():
        split = [_two_level_by_rows(v * np.float32(2.0 ** shift), per_super, tol)
                 for v, tol in zip(values, tolerances, strict=False)]
        if all(f is not None for f in split):
            if blocks * BLOCK == 2 * k and all(sub.min() >= 0 and sub.max() < 16 for sub, _ in split):
                # blocks of 16 whose sub-values are 0..15 (GGUF's Q2_K, IQ1_M): two a byte, block 2c's low nibble
                split = [((sub[:, 0::2] | (sub[:, 1::2] << 4)).view(np.uint8), sup) for sub, sup in split]
            (sub, sup), *rest = split
            mins_tables = tuple(layout(t) for t in rest[0]) if rest else (None, None)
            tables = (layout(sub), layout(sup), *mins_tables)
            return PackedTable(b, *tables, scale_exponent=-shift, high_bits=high_bits)
    halves = [_half(v, tol) for v, tol in zip(values, tolerances, strict=False)]
    stored = halves if all(h is not None for h in halves) else values
    return PackedTable(b, layout(stored[0]), None, layout(stored[1]) if mins is not None else None,
                       high_bits=high_bits)
