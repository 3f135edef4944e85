"""The CPU lowering of 4/8-bit linears onto trtbuild::BlockQuantMatMul (cpu_ops/block_matmul.cc), llama.cpp's way
of multiplying block-quantized weights: activations quantized to int8 blocks once per linear, integer dot
products, 16 rows per vector so that one tile of tokens reuses each weight load.

Each eligible MatMulNBits (4 or 8 bits, blocks of 16 or 32, with the default zero point or with float zero points,
as GGUF's Q2_K / Q4_K / Q5_K / Q4_1 / Q5_1 tensors are converted) becomes a BlockQuantMatMul over a packed copy of its
weights (plugins/block_quant_matmul.py: the layout; codes packed in as few bits as hold them, as GGUF's Q5_0 / Q5_K /
Q6_K tensors' 8-bit codes fit in 5 or 6, Q2_K / Q3_K's 4-bit ones in 2 or 3, and IQ4_NL / IQ4_XS's (and MXFP4's)
8-bit ones, 16 (15) values, in 4-bit indices into a codebook; k-quants' scales and minimums in their two-level
form), and the MatMulNBits initializers nobody else reads are dropped, so the engine file holds each linear once.
Measured on the 2-core AVX-512 VM (docs/performance.md): faster than MLAS's MatMulNBits at every token count from 1
to 256, which is why there is one graph for all steps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx

from trtbuild.builder.graph import MS_DOMAIN, GraphView, drop_dead_nodes, node_attrs, topological_sort, use_opset
from trtbuild.builder.weight_only_linear import find_float_zero_point_gather
from trtbuild.plugins import block_quant_matmul as bq


def eligible(node: onnx.NodeProto) -> bool:
    """A MatMulNBits the native kernel computes: 4 or 8 bits, K % 32 == 0, blocks of 16 or 32, with the default zero
    point or with zero points (as minimums: zp * scale)."""
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
        return False
    inputs = len([i for i in node.input if i])
    a = node_attrs(node)
    if a.get("bits") not in (4, 8) or a["K"] % bq.BLOCK:
        return False
    zero_points = inputs == 4 and len(node.input) == 4
    return (inputs == 3 or zero_points) and a.get("block_size") in bq.WEIGHT_BLOCKS


def count_eligible(model: onnx.ModelProto) -> int:
    return sum(eligible(n) for n in model.graph.node)


def native_problem(int4_accuracy_level: int) -> str | None:
    """Why BlockQuantMatMul cannot run for this build on this machine, or None."""
    from trtbuild import cpu_ops

    return ("int4_accuracy_level 1 asks for fp32 compute" if int4_accuracy_level != 4 else
            "this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C" if not cpu_ops.runs_block_quant() else
            cpu_ops.unavailable_reason())


def count_native(model: onnx.ModelProto) -> int:
    """BlockQuantMatMul nodes the network wrote itself (a mixture of experts' tables of experts)."""
    return sum(n.op_type == bq.OP_TYPE and n.domain == bq.DOMAIN for n in model.graph.node)


class Packed(NamedTuple):
    """A linear's weights in the native layout: one initializer per bq.PackedTable field (None where absent), the
    bits the codes are packed in and the codebook they index (bq.compact), its rows (N), and the attributes its
    bq.PackedTable sets (scale_exponent, high_bits)."""

    tensors: tuple[onnx.TensorProto | None, ...]
    bits: int
    rows: int
    codebook: tuple[int, ...] | None = None
    table_attributes: dict | None = None

    def attributes(self, k: int, block: int) -> dict:
        """The op's attributes for this table, K columns in blocks of `block`."""
        codebook = {"codebook": list(self.codebook)} if self.codebook else {}
        return {"K": k, "N": self.rows, "bits": self.bits, "block_size": block, **codebook,
                **(self.table_attributes or {})}

    def inputs(self, first: str, bias_slot: bool) -> list[str]:
        """The op's inputs: `first` (x or ids), B, scales, then the optional ones (BlockQuantMatMul's bias slot
        left empty), without trailing empty ones."""
        codes, scales, *optional = (t.name if t is not None else "" for t in self.tensors)
        names = [first, codes, scales, *([""] if bias_slot else []), *optional]
        while not names[-1]:
            names.pop()
        return names


class NativeLinears:
    """Rewrites eligible linears in place; packs each weight once however many graph copies it lowers (the
    autotuner lowers a copy per candidate), keeping the packed initializers as they were staged. The embedding's
    gather becomes a BlockQuantGather: over the lm_head's packed table when it is tied to it (the same codes, scales
    and zero points), so the engine holds that table once; else over its own. `high_bits`: how the tables hold 3/5/6-bit
    codes' further bits (bq.HIGH_BITS; cpu_ops.high_bits_layout says which this machine's tiles read fastest)."""

    def __init__(self, high_bits: str = "planes") -> None:
        self.high_bits = high_bits
        # keyed by a weight's MatMulNBits-form initializers: codes, scales and any zero points
        self._packed: dict[tuple[str, ...], Packed] = {}
        self._tied: dict[tuple[str, ...], tuple[str, ...] | None] = {}  # a table's -> its linear's

    def _tied_linear(self, view: GraphView, table: tuple[str, ...], bits: int, block: int,
                     linears: dict[tuple[str, ...], dict]) -> tuple[str, ...] | None:
        """The key of a rewritten linear whose weights are the table `table` (codes, scales[, zero points]), or
        None."""
        if table not in self._tied:
            shape, found = view.shape_of(table[0]), None
            for linear, la in linears.items():
                if len(linear) != len(table) or (la["bits"], la["block_size"]) != (bits, block) or shape is None or \
                        shape[0] != la["N"] or np.prod(shape) * 8 != la["N"] * la["K"] * la["bits"]:
                    continue
                if all(np.array_equal(view.constant(mine).reshape(-1), view.constant(theirs).reshape(-1))
                       for mine, theirs in zip(table, linear, strict=True)):
                    found = linear
                    break
            self._tied[table] = found
        return self._tied[table]

    def _table(self, view: GraphView, key: tuple[str, ...], n: int, k: int, bits: int) -> Packed:
        """The packed form of weights `key`, packed now if no graph copy has been lowered with them yet."""
        if key not in self._packed:
            self._packed[key] = _pack(view, key, n, k, bits, self.high_bits)
        packed = self._packed[key]
        for t in packed.tensors:
            if t is not None:
                view.attach(t)
        return packed

    def _lower_gather(self, view: GraphView, node: onnx.NodeProto, linears: dict[tuple[str, ...], dict]) -> None:
        """Turn a GatherBlockQuantized of rows (default zero points) into a BlockQuantGather over the lm_head's
        packed table when it is that table, else over its own (as compact as the linears': GGUF's Q3_K token table
        in 3.6 bits a weight, not GatherBlockQuantized's 6)."""
        a = node_attrs(node)
        bits, block = a.get("bits", 4), a.get("block_size", 128)
        table = (node.input[0], node.input[2])
        shape = view.shape_of(table[0])
        if ((a.get("gather_axis", 0), a.get("quantize_axis", 1)) != (0, 1) or bits not in (4, 8)
                or block not in bq.WEIGHT_BLOCKS or shape is None or len(shape) != 2
                or any(t not in view.initializers for t in table)):
            return
        n, k = shape[0], shape[1] * 8 // bits
        if k % bq.BLOCK:
            return
        table = self._tied_linear(view, table, bits, block, linears) or table
        packed = self._table(view, table, n, k, bits)
        _become(node, bq.GATHER_OP_TYPE, packed.inputs(node.input[1], bias_slot=False), packed.attributes(k, block))

    def _lower_embedding(self, view: GraphView, model: onnx.ModelProto, linears: dict[tuple[str, ...], dict]
                         ) -> bool:
        """Replace the embedding gather of a table with float zero points (builder/weight_only_linear.py:
        emit_nbits_gather) by a BlockQuantGather; returns whether it did."""
        e = find_float_zero_point_gather(view)
        if e is None:
            return False
        codes, scales = view.shape_of(e.codes), view.shape_of(e.scales)
        bits, block = codes[1] * 8 // e.hidden, e.hidden // scales[1]
        if bits not in (4, 8) or block not in bq.WEIGHT_BLOCKS:
            return False
        table = (e.codes, e.scales, e.zero_points)
        table = self._tied_linear(view, table, bits, block, linears) or table
        packed = self._table(view, table, codes[0], e.hidden, bits)
        gather = onnx.helper.make_node(bq.GATHER_OP_TYPE, packed.inputs(e.ids, bias_slot=False), list(e.output.output),
                                       name=e.output.name, domain=bq.DOMAIN, **packed.attributes(e.hidden, block))
        model.graph.node.remove(e.output)
        model.graph.node.append(gather)
        drop_dead_nodes(model)
        topological_sort(model.graph)
        return True

    def lower(self, model: onnx.ModelProto) -> int:
        """Replace the eligible MatMulNBits of `model` (and the embedding's gather, as the class says); returns how
        many linears."""
        view = GraphView(model)
        linears: dict[tuple[str, ...], dict] = {}
        for node in model.graph.node:
            key = tuple(i for i in node.input[1:] if i)
            if not eligible(node) or any(i not in view.initializers for i in key):
                continue
            a = node_attrs(node)
            packed = self._table(view, key, a["N"], a["K"], a["bits"])
            linears[key] = a
            _become(node, bq.OP_TYPE, packed.inputs(node.input[0], bias_slot=True),
                    packed.attributes(a["K"], a["block_size"]))
        for node in model.graph.node:
            if node.op_type == "GatherBlockQuantized" and node.domain == MS_DOMAIN and len(node.input) == 3:
                self._lower_gather(view, node, linears)
        embedding = self._lower_embedding(view, model, linears)
        if linears or embedding:
            view.drop_unused_initializers()
            use_opset(model, bq.DOMAIN)
        return len([n for n in model.graph.node if n.op_type == bq.OP_TYPE and n.domain == bq.DOMAIN])


def pack_nbits(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, bits: int,
               high_bits: str = "planes") -> tuple[bq.PackedTable, int, tuple[int, ...] | None]:
    """MatMulNBits-form weights (codes, scales and optional float zero points) in the native layout, 3/5/6-bit codes'
    further bits as `high_bits` says: (the table, the bits its codes are packed in, the codebook they index or
    None)."""
    codes = bq.unpack_nbits(codes, n, k, bits)
    scales = scales.reshape(n, -1)
    mins = None
    if zero_points is not None:  # (code - zp) * scale = code * scale - zp * scale
        mins = (zero_points.reshape(n, -1).astype(np.float64) * scales).astype(np.float32)
    else:
        scales = _zero_blocks_unscaled(codes, scales, bq.ZERO_POINT[bits])
    codes, bits, codebook = bq.compact(codes, bits, zero_point=mins is None)
    return bq.pack(codes, scales, bits, mins, high_bits), bits, codebook


def _zero_blocks_unscaled(codes: np.ndarray, scales: np.ndarray, zero_point: int) -> np.ndarray:
    """`scales` [N, blocks] with 0 for the blocks whose codes [N, K] are all the zero point: their weights are 0 under
    any scale, and an odd one must not decide the form every other scale is stored in (ggml's MXFP4 quantizer gives
    an all-zero block exponent 0, a scale of 2^-128 that float16 does not hold). Rows a chunk at a time: a token
    table's comparison is not GBs."""
    n, blocks = scales.shape
    zero = np.zeros((n, blocks), dtype=bool)
    step = max(1, (1 << 24) // codes.shape[1])
    for r in range(0, n, step):
        zero[r:r + step] = (codes[r:r + step].reshape(-1, blocks, codes.shape[1] // blocks) == zero_point).all(axis=2)
    if not zero.any():
        return scales
    scales = scales.copy()
    scales[zero] = 0
    return scales


def _pack(view: GraphView, inputs: tuple[str, ...], n: int, k: int, bits: int, high_bits: str) -> Packed:
    """Pack a linear's or table's MatMulNBits-form weights (`inputs`: codes, scales and, if any, float zero points)
    into new initializers named after them."""
    table, bits, codebook = pack_nbits(view.constant(inputs[0]), view.constant(inputs[1]),
                                       view.constant(inputs[2]) if len(inputs) == 3 else None, n, k, bits, high_bits)
    tensors = []
    for field, value in zip(bq.TABLE_FIELDS, table.tensors(), strict=True):  # in the op's input order
        if value is not None:
            name = {"codes": f"{inputs[0]}.bq", "scales": f"{inputs[1]}.bq"}.get(field, f"{inputs[1]}.bq_{field}")
            view.add_initializer(name, value)
            value = view.initializers[name]
        tensors.append(value)
    return Packed(tuple(tensors), bits, n, codebook, table.attributes())


def _become(node: onnx.NodeProto, op_type: str, inputs: list[str], attrs: dict) -> None:
    """Turn `node` into the trtbuild op `op_type` over `inputs`, with attributes `attrs` (Packed.attributes)."""
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]
    node.attribute.extend(onnx.helper.make_attribute(k, v) for k, v in attrs.items())
    node.op_type, node.domain = op_type, bq.DOMAIN


def describe_tables(model: onnx.ModelProto) -> str:
    """The packed tables of a lowered `model` by form, for the build log: how many, their codes (bits, codebook,
    scale block) and the bits a weight they hold, codes, scales and minimums together (a shared table once)."""
    sizes = {t.name: t for t in model.graph.initializer}
    forms: dict[str, list[int]] = {}  # form -> [tables, bits held, weights]
    seen = set()
    for node in model.graph.node:
        if node.domain != bq.DOMAIN or node.op_type not in (bq.OP_TYPE, bq.GATHER_OP_TYPE) or node.input[1] in seen:
            continue
        seen.add(node.input[1])
        a = node_attrs(node)
        tables = [node.input[i] for i in range(1, len(node.input)) if node.input[i] and node.input[i] in sizes
                  and not (node.op_type == bq.OP_TYPE and i == 3)]  # not the bias
        held = sum(8 * _nbytes(sizes[name]) for name in tables)
        mins = 5 if node.op_type == bq.OP_TYPE else 4  # the minimums' input
        form = (f"{a['bits']}-bit{' codebook' if 'codebook' in a else ''}, blocks of {a['block_size']}"
                f"{', minimums' if len(node.input) > mins and node.input[mins] else ''}")
        entry = forms.setdefault(form, [0, 0, 0])
        entry[0] += 1
        entry[1] += held
        entry[2] += -(-a["N"] // bq.ROWS) * bq.ROWS * a["K"]
    return "; ".join(f"{n} x {form} ({bits / weights:.4g} bits a weight)"
                     for form, (n, bits, weights) in sorted(forms.items(), key=lambda f: -f[1][2]))


def _nbytes(t: onnx.TensorProto) -> int:
    size = int(np.prod(t.dims)) if t.dims else 1
    return size * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
