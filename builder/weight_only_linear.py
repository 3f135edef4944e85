"""Weight-only linears (`quant_algo: weight_only`): int8 / int4 codes with blockwise scales and optional float zero
points, run as ONNX Runtime's MatMulNBits, whose layout the checkpoint already stores (docs/checkpoint.md); the
embedding table in the same form (`embedding_weight_only`) is gathered by GatherBlockQuantized (see emit_nbits_gather):

  P.weight              uint8 [out, in * bits / 8]  codes; 4-bit: input 2j in the low nibble, 2j+1 in the high one
  P.weights_scaling_factor  float32 [out, in / g]   one scale per group of g input features
  P.weights_zero_point      float32 [out, in / g]   optional (4-bit only); absent: 2^(bits-1)
  W[o, i] = (code[o, i] - zero_point[o, i // g]) * scale[o, i // g]

NOTE: the network emits MatMulNBits directly rather than a standard DequantizeLinear -> MatMul: ONNX's
DequantizeLinear takes only integer zero points, and the float zero points of GGUF's Q4_1 / Q4_K blocks are what
keeps those files exact. Bits and group size are read from each linear's tensors, so one checkpoint may mix them
(a GGUF Q4_K_M file has 4-bit groups of 32 and 8-bit groups of 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnx
import torch

from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder, GraphView
from trtbuild.errors import TrtbuildError

EMBEDDING, EMBEDDING_ROWS = "embedding", "embedding_codes"  # the float-zero-point gather's output and code rows
MAX_BLOCK = 256  # MatMulNBits block sizes: powers of two from 16; a larger group is cut into blocks of this or less
MIN_BLOCK = 16


@dataclass(frozen=True)
class NBitsLayout:
    """How one weight-only linear's tensors map onto MatMulNBits."""

    bits: int
    group_size: int  # input features per stored scale
    block_size: int  # MatMulNBits block: group_size, or a power of two dividing it (scales repeated)


def nbits_layout(prefix: str, in_features: int, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                 has_zero_point: bool) -> NBitsLayout:
    """Bits and group size of a weight-only linear from its tensors' shapes; refuses what MatMulNBits cannot run."""
    out = weight_shape[0]
    if len(weight_shape) != 2 or weight_shape[1] * 8 not in (4 * in_features, 8 * in_features):
        raise TrtbuildError(f"{prefix}.weight has shape {list(weight_shape)}; a weight_only linear with {in_features} "
                            f"input features stores [{out}, {in_features // 2}] (int4) or [{out}, {in_features}] "
                            "(int8) codes. The checkpoint is inconsistent: re-run `trtbuild convert`.")
    bits = weight_shape[1] * 8 // in_features
    groups = scale_shape[1] if len(scale_shape) == 2 and scale_shape[0] == out else 0
    if not groups or in_features % groups:
        raise TrtbuildError(f"{prefix}.weights_scaling_factor has shape {list(scale_shape)}, which is not "
                            f"[{out}, {in_features} / group size]; re-run `trtbuild convert`.")
    group = in_features // groups
    block = min(group & -group, MAX_BLOCK)  # the largest power of two dividing the group
    if block < MIN_BLOCK:
        raise TrtbuildError(f"{prefix} has groups of {group} input features; the CPU target runs groups that are "
                            f"multiples of {MIN_BLOCK}. Re-run `trtbuild convert` with --group-size 32, 64 or 128.")
    return NBitsLayout(bits, group, block)


def nbits_inputs(prefix: str, tensors, in_features: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None,
                                                                  NBitsLayout]:
    codes = tensors[prefix + ".weight"]
    if codes.dtype != torch.uint8:
        raise TrtbuildError(f"{prefix}.weight is {codes.dtype}; weight_only tensors store uint8 codes. The checkpoint "
                            "is inconsistent: re-run `trtbuild convert`.")
    scales = tensors[prefix + ".weights_scaling_factor"].to(torch.float32).numpy()
    zp_name = prefix + ".weights_zero_point"
    zero_points = tensors[zp_name].to(torch.float32).numpy() if zp_name in tensors else None
    layout = nbits_layout(prefix, in_features, tuple(codes.shape), scales.shape, zero_points is not None)
    repeat = layout.group_size // layout.block_size
    return (codes, np.repeat(scales, repeat, axis=1),
            None if zero_points is None else np.repeat(zero_points, repeat, axis=1), layout)


def emit_nbits_gather(g: GraphBuilder, ids: str, prefix: str, tensors, hidden: int) -> str:
    """Rows `ids` of the weight_only embedding table `prefix`, dequantized: one GatherBlockQuantized node, or, for
    codes with float zero points (which it does not take), a gather of the packed rows dequantized by standard ops:
    only the step's rows are ever unpacked."""
    codes, scales, zero_points, layout = nbits_inputs(prefix, tensors, hidden)
    data = g.weight(prefix + ".weight_nbits", codes.numpy())
    if zero_points is None:
        return g.op("GatherBlockQuantized", [data, ids, g.weight(prefix + ".scales_nbits", scales)],
                    domain=MS_DOMAIN, name="embedding", bits=layout.bits, block_size=layout.block_size,
                    gather_axis=0, quantize_axis=1)
    groups = hidden // layout.block_size
    rows = g.op("Gather", [data, ids], axis=0, name=EMBEDDING_ROWS)  # [T, H * bits / 8] uint8
    if layout.bits == 4:
        rows = g.op("Concat", [g.op("Unsqueeze", [n, g.const(np.array([-1]), "axis_last")]) for n in (
            g.op("BitwiseAnd", [rows, g.const(np.uint8(0x0F), "low_nibble")]),
            g.op("BitShift", [rows, g.const(np.uint8(4), "nibble_bits")], direction="RIGHT"))], axis=-1)
    q = g.op("Reshape", [rows, g.const(np.array([0, groups, layout.block_size]), "embedding_blocks")])
    q = g.op("Cast", [q], to=onnx.TensorProto.FLOAT)
    per_block = [g.op("Unsqueeze", [g.op("Gather", [g.weight(f"{prefix}.{what}_nbits", table), ids], axis=0),
                                    g.const(np.array([-1]), "axis_last")])
                 for what, table in (("scales", scales), ("zero_points", zero_points))]
    x = g.op("Mul", [g.op("Sub", [q, per_block[1]]), per_block[0]])
    return g.op("Reshape", [x, g.const(np.array([0, hidden]), "embedding_rows")], name=EMBEDDING)


class FloatZeroPointGather(NamedTuple):
    """The tensors of the gather emit_nbits_gather writes for a table with float zero points."""

    ids: str
    codes: str  # uint8 [V, K * bits / 8], 4-bit: element 2j in the low nibble of byte j
    scales: str  # float32 [V, K / g]
    zero_points: str  # float32 [V, K / g]
    hidden: int  # K
    output: onnx.NodeProto  # the node that yields the rows


def find_float_zero_point_gather(view: GraphView) -> FloatZeroPointGather | None:
    """The embedding gather emit_nbits_gather writes for float zero points, read back from `view` (a backend that
    has one kernel for it replaces the nodes between the ids and its output), or None."""
    rows = next((n for n in view.graph.node if n.name == EMBEDDING_ROWS and n.op_type == "Gather"), None)
    out = next((n for n in view.graph.node if n.name == EMBEDDING and n.op_type == "Reshape"), None)
    if rows is None or out is None or not rows.input[0].endswith(".weight_nbits"):
        return None
    prefix = rows.input[0].removesuffix(".weight_nbits")
    scales, zero_points = f"{prefix}.scales_nbits", f"{prefix}.zero_points_nbits"
    shape = view.constant(out.input[1])
    if any(t not in view.initializers for t in (rows.input[0], scales, zero_points)) or shape is None:
        return None
    return FloatZeroPointGather(rows.input[1], rows.input[0], scales, zero_points, int(shape[-1]), out)


def emit_nbits_matmul(g: GraphBuilder, x: str, prefix: str, tensors, in_features: int, accuracy_level: int,
                      outputs: list[str] | None = None) -> str:
    """y = x @ W^T for the weight-only linear `prefix`: one MatMulNBits node, with float zero points as its fourth
    input when the linear has them. NOTE: ONNX Runtime has no fast kernel for float zero points; the CPU lowering
    (builder/passes/lower_quant_cpu.py) rewrites them exactly, after merging sibling linears."""
    codes, scales, zero_points, layout = nbits_inputs(prefix, tensors, in_features)
    out = codes.shape[0]
    blocks = in_features // layout.block_size
    inputs = [x, g.weight(prefix + ".weight_nbits",
                          codes.numpy().reshape(out, blocks, layout.block_size * layout.bits // 8)),
              g.weight(prefix + ".scales_nbits", scales.reshape(-1))]
    if zero_points is not None:
        inputs.append(g.weight(prefix + ".zero_points_nbits", zero_points.astype(np.float32).reshape(-1)))
    return g.op("MatMulNBits", inputs, name=prefix, outputs=outputs, domain=MS_DOMAIN, K=in_features, N=out,
                bits=layout.bits, block_size=layout.block_size, accuracy_level=accuracy_level)
