"""Quantized linears of the fused graph (builder/quantized.py's Q/DQ forms) as CUDA plan steps (builder/cuda_plan.py).

  MatMul(x, DQ(int4 W [K, N], scales [K/g, N], axis 0))   weight_only_linear: codes W^T + 8, two per byte (low
                                                          nibble first), scales [N, K/g] (int4_awq; its prequant
                                                          Mul before is a `mul` step)
  MatMul(x, DQ(int8 W [K, N], s_w [N], axis 1))           weight_only_linear on int8 codes W^T (int8_wo: lm_head)
  MatMul(DQ(Q(x, s_x, int8)), DQ(int8 W, s_w, axis 1))    int8_linear (gpu_kernels/int8_gemm.py): x quantized with
                                                          s_x ([1] static, or [T, 1] per token: the steps that
                                                          compute it stay in the plan), int8 x int8 -> int32
  MatMul(DQ(Q(x, s_x, fp8)), DQ(fp8 W [K, N], s_w))       fp8_linear: torch._scaled_mm where the GPU has it
  MatMulNBits (weight-only int8/int4: convert --weight-only, GGUF)   weight_only_linear on the node's own tensors
The weights' DequantizeLinear nodes, and an activation's QuantizeLinear / DequantizeLinear whose every reader is such
a linear, become no step of their own. A weight-only embedding table is dequantized at build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import helper

from trtbuild.builder.graph import GraphView
from trtbuild.errors import TrtbuildError
from trtbuild.quantization import unpack_int4


@dataclass(frozen=True)
class QuantizedLinear:
    kind: str  # "int4", "int8_wo", "int8", "fp8"
    x: str  # the activation the step reads (before its quantization, for int8 and fp8)
    weight: str  # the DequantizeLinear's weight initializer
    weight_scale: str
    x_scale: str = ""  # int8 / fp8: the activation scale (an initializer, or a per-token tensor)


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def find_quantized_linears(view: GraphView) -> tuple[dict[str, QuantizedLinear], set[str]]:
    """({MatMul node name: its QuantizedLinear}, the DequantizeLinear / QuantizeLinear nodes they absorb)."""
    found: dict[str, QuantizedLinear] = {}
    absorbed: set[str] = set()
    for n in view.graph.node:
        if n.op_type != "MatMul":
            continue
        dq_w = view.producer.get(n.input[1])
        if dq_w is None or dq_w.op_type != "DequantizeLinear" or dq_w.input[0] not in view.initializers:
            continue
        w = view.constant(dq_w.input[0])
        dq_x = view.producer.get(n.input[0])
        q_x = view.producer.get(dq_x.input[0]) if dq_x is not None and dq_x.op_type == "DequantizeLinear" else None
        if q_x is not None and q_x.op_type == "QuantizeLinear":
            kind = "fp8" if w.dtype.name.startswith("float8") else "int8"
            found[n.name] = QuantizedLinear(kind, q_x.input[0], dq_w.input[0], dq_w.input[1], q_x.input[1])
        elif w.dtype.name == "int4" and _attr(dq_w, "axis") == 0:
            found[n.name] = QuantizedLinear("int4", n.input[0], dq_w.input[0], dq_w.input[1])  # groups: the scales
        elif w.dtype == np.int8 and _attr(dq_w, "axis") == 1:
            found[n.name] = QuantizedLinear("int8_wo", n.input[0], dq_w.input[0], dq_w.input[1])
        else:
            raise TrtbuildError(f"{n.name}: the cuda target runs no {w.dtype} weights of this form")
        absorbed.add(dq_w.name)
    # an activation's Q/DQ pair goes with its linears when they are its only readers
    for linear in found.values():
        if not linear.x_scale:
            continue
        q_x = next(c for c in view.consumers[linear.x] if c.op_type == "QuantizeLinear" and c.input[1] ==
                   linear.x_scale)
        dq_x = view.consumers[q_x.output[0]]
        readers = [r for d in dq_x for r in view.consumers.get(d.output[0], [])]
        if all(d.op_type == "DequantizeLinear" for d in dq_x) and all(r.name in found for r in readers):
            absorbed |= {q_x.name} | {d.name for d in dq_x}
    return found, absorbed


def int4_codes(w: np.ndarray) -> np.ndarray:
    """Signed int4 W [K, N] -> uint8 codes [N, K / 2] of W^T + 8, low nibble first, as weight_only_gemm reads them."""
    codes = (w.astype(np.int16).T + 8).astype(np.uint8)
    if codes.shape[1] % 2:
        raise TrtbuildError(f"int4 weights with an odd number of input features ({codes.shape[1]})")
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))


def fp8_tensor(w: np.ndarray) -> torch.Tensor:
    """A float8 e4m3fn numpy array (ml_dtypes) [K, N] -> torch float8_e4m3fn [N, K] (its bits, transposed)."""
    bits = np.ascontiguousarray(w.T).view(np.uint8)
    return torch.from_numpy(bits).view(torch.float8_e4m3fn).contiguous()


class QuantizedSteps:
    """The quantized linears' and tables' steps of builder/cuda_plan.py's writer (which sets these attributes and
    defines `weight`, `const` and `emit`)."""

    view: GraphView
    weights: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedLinear]

    if TYPE_CHECKING:
        def weight(self, name: str, value: np.ndarray, dtype: torch.dtype | None = None,
                   key: str | None = None) -> str: ...

        def const(self, name: str) -> np.ndarray: ...

        def emit(self, kernel: str, node: onnx.NodeProto, inputs: list[str], outputs: list[str], **attrs) -> None: ...

    def quantized_linear(self, n: onnx.NodeProto) -> None:
        """A quantized linear of builder/cuda_plan_quant.py's forms as its step."""
        q = self.quantized[n.name]
        w, scale = self.const(q.weight), self.const(q.weight_scale).astype(np.float32)
        if q.kind == "fp8":
            self.weights.setdefault(q.weight, fp8_tensor(w))
            inputs = [q.x, self.weight(q.x_scale, self.const(q.x_scale), torch.float32), q.weight,
                      self.weight(q.weight_scale, scale, torch.float32)]
            self.emit("fp8_linear", n, inputs, list(n.output))
            return
        codes = int4_codes(w) if q.kind == "int4" else w.T
        inputs = [q.x, self.weight(q.weight, codes), self.weight(q.weight_scale, scale.T, torch.float32)]
        if q.kind != "int8":  # int4 (group scales [N, K / g]) or int8_wo (per channel) weights, float activations
            self.emit("weight_only_linear", n, inputs, list(n.output))
            return
        x_scale = q.x_scale  # a per-token scale [T, 1] is a step's output; a static one a constant
        if x_scale in self.view.initializers:
            x_scale = self.weight(x_scale, self.const(x_scale), torch.float32)
        self.emit("int8_linear", n, [q.x, x_scale, *inputs[1:]], list(n.output))

    def weight_only(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        """MatMulNBits' tensors as weight_only_gemm reads them: codes [N, K * bits / 8], scales [N, K / block],
        float zero points [N, K / block] when present (absent: 2^(bits-1), which the kernel applies itself)."""
        k, out_features, bits = a["K"], a["N"], a["bits"]
        codes = self.const(n.input[1]).reshape(out_features, k * bits // 8)
        scales = self.const(n.input[2]).reshape(out_features, -1)
        inputs = [n.input[0], self.weight(n.input[1], codes), self.weight(n.input[2], scales, torch.float32)]
        if len(n.input) > 3 and n.input[3]:
            zp = self.const(n.input[3])
            if zp.dtype != np.float32:
                raise TrtbuildError(f"{n.name}: packed integer zero points are not supported by the cuda target")
            inputs.append(self.weight(n.input[3], zp.reshape(out_features, -1), torch.float32))
        self.emit("weight_only_linear", n, inputs, list(n.output))

    def dequantized_table(self, n: onnx.NodeProto, a: dict[str, Any]) -> np.ndarray:
        """A weight-only embedding table dequantized at build time: the engine gathers rows of the step's tokens
        from it (the codes would only save memory, and one table of the compute dtype is simple)."""
        codes, scales, bits = self.const(n.input[0]), self.const(n.input[2]), a.get("bits", 4)
        # NOTE: unpack_int4 returns code - 8; the raw code is what the zero point applies to
        raw = unpack_int4(codes).astype(np.float32) + 8 if bits == 4 else codes.astype(np.float32)
        block = raw.shape[1] // scales.shape[1]
        return (raw - (1 << (bits - 1))) * np.repeat(scales.astype(np.float32), block, axis=1)
