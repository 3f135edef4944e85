"""The CPU lowering of 4/8-bit linears onto trtbuild::BlockQuantMatMul (cpu_ops/block_matmul.cc), llama.cpp's way
of multiplying block-quantized weights: activations quantized to int8 blocks once per linear, integer dot
products, 16 rows per vector so that one tile of tokens reuses each weight load.

Each eligible MatMulNBits (4 or 8 bits, blocks of 16 or 32 with the default zero point, or blocks of 32 with float
zero points, as GGUF's Q4_K / Q5_K / Q4_1 / Q5_1 tensors are converted) becomes a BlockQuantMatMul over a packed copy
of its weights (plugins/block_quant_matmul.py: the layout; 8-bit codes that fit in 5 or 6 bits, as GGUF's Q5_0 /
Q5_K / Q6_K tensors do, packed in 5 or 6; k-quants' scales and minimums in their two-level form), and the MatMulNBits
initializers nobody else reads are dropped, so the engine file holds each linear once. Measured on the 2-core
AVX-512 VM (docs/performance.md): faster than MLAS's MatMulNBits at every token count from 1 to 256, which is why
there is one graph for all steps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx

from trtbuild.builder.graph import MS_DOMAIN, GraphView, node_attrs, use_opset
from trtbuild.plugins import block_quant_matmul as bq


def eligible(node: onnx.NodeProto) -> bool:
    """A MatMulNBits the native kernel computes: 4 or 8 bits, K % 32 == 0, blocks of 16 or 32 with the default zero
    point, or blocks of 32 with zero points (as minimums: zp * scale)."""
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
        return False
    inputs = len([i for i in node.input if i])
    a = node_attrs(node)
    if a.get("bits") not in (4, 8) or a["K"] % bq.BLOCK:
        return False
    if inputs == 4 and len(node.input) == 4:
        return a.get("block_size") == bq.BLOCK
    return inputs == 3 and a.get("block_size") in bq.WEIGHT_BLOCKS


def count_eligible(model: onnx.ModelProto) -> int:
    return sum(eligible(n) for n in model.graph.node)


_TABLE_INPUTS = ("codes", "scales", "super_scales", "mins", "super_mins")  # bq.PackedTable's fields, in input order


class Packed(NamedTuple):
    """A linear's weights in the native layout: one initializer per bq.PackedTable field (None where absent), and the
    bits the codes are packed in (5 or 6 where the checkpoint's 8-bit codes fit: bq.narrow)."""

    tensors: tuple[onnx.TensorProto | None, ...]
    bits: int

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
    autotuner lowers a copy per candidate), keeping the packed initializers as they were staged. A tied embedding
    (a GatherBlockQuantized over the same codes and scales as a rewritten linear, the lm_head) becomes a
    BlockQuantGather over the packed table, so the engine holds that table once."""

    def __init__(self) -> None:
        self._packed: dict[tuple[str, str], Packed] = {}
        self._tied: dict[tuple[str, str], tuple[str, str] | None] = {}  # gather's (data, scales) -> linear's

    def _tied_linear(self, view: GraphView, gather: onnx.NodeProto, linears: dict[tuple[str, str], dict]
                     ) -> tuple[str, str] | None:
        """The (B, scales) of a rewritten linear whose weights are this gather's table, or None."""
        key = (gather.input[0], gather.input[2])
        if key not in self._tied:
            a = node_attrs(gather)
            shape, found = view.shape_of(key[0]), None
            for linear, la in linears.items():
                if (la["bits"], la["block_size"]) != (a.get("bits"), a.get("block_size")) or shape is None or \
                        shape[0] != la["N"] or np.prod(shape) * 8 != la["N"] * la["K"] * la["bits"]:
                    continue
                if all(np.array_equal(view.constant(mine).reshape(-1), view.constant(theirs).reshape(-1))
                       for mine, theirs in zip(key, linear, strict=True)):
                    found = linear
                    break
            self._tied[key] = found
        return self._tied[key]

    def lower(self, model: onnx.ModelProto) -> int:
        """Replace the eligible MatMulNBits of `model` (and a tied embedding's gather); returns how many linears."""
        view = GraphView(model)
        linears: dict[tuple[str, str], dict] = {}
        for node in model.graph.node:
            if not eligible(node) or any(i not in view.initializers for i in node.input[1:3]):
                continue
            a = node_attrs(node)
            key = (node.input[1], node.input[2])
            if key not in self._packed:
                self._packed[key] = _pack(view, node, a)
            packed = self._packed[key]
            for t in packed.tensors:
                if t is not None:
                    view.attach(t)
            linears[key] = a
            _become(node, bq.OP_TYPE, packed.inputs(node.input[0], bias_slot=True), {**a, "bits": packed.bits})
        for node in model.graph.node:
            if (node.op_type == "GatherBlockQuantized" and node.domain == MS_DOMAIN and len(node.input) == 3
                    and (node_attrs(node).get("gather_axis", 0), node_attrs(node).get("quantize_axis", 1)) == (0, 1)
                    and (linear := self._tied_linear(view, node, linears)) is not None):
                packed = self._packed[linear]
                _become(node, bq.GATHER_OP_TYPE, packed.inputs(node.input[1], bias_slot=False),
                        {**linears[linear], "bits": packed.bits})
        if linears:
            view.drop_unused_initializers()
            use_opset(model, bq.DOMAIN)
        return len([n for n in model.graph.node if n.op_type == bq.OP_TYPE and n.domain == bq.DOMAIN])


def _pack(view: GraphView, node: onnx.NodeProto, a: dict) -> Packed:
    """Pack an eligible MatMulNBits' weights into new initializers named after its own."""
    n, k = a["N"], a["K"]
    codes = bq.unpack_nbits(view.constant(node.input[1]), n, k, a["bits"])
    scales = view.constant(node.input[2]).reshape(n, -1)
    mins = None
    if len(node.input) == 4:  # (code - zp) * scale = code * scale - zp * scale
        mins = (view.constant(node.input[3]).reshape(n, -1).astype(np.float64) * scales).astype(np.float32)
    codes, bits = bq.narrow(codes, a["bits"], zero_point=mins is None)
    table = bq.pack(codes, scales, bits, mins)
    tensors = []
    for field, value in zip(_TABLE_INPUTS, table, strict=True):
        if value is not None:
            name = {"codes": f"{node.input[1]}.bq", "scales": f"{node.input[2]}.bq"}.get(field,
                                                                                     f"{node.input[2]}.bq_{field}")
            view.add_initializer(name, value)
            value = view.initializers[name]
        tensors.append(value)
    return Packed(tuple(tensors), bits)


def _become(node: onnx.NodeProto, op_type: str, inputs: list[str], attrs: dict) -> None:
    """Turn `node` into the trtbuild op `op_type` over `inputs`, with the linear's K, N, bits and block size."""
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]
    node.attribute.extend(onnx.helper.make_attribute(k, attrs[k]) for k in ("K", "N", "bits", "block_size"))
    node.op_type, node.domain = op_type, bq.DOMAIN
