"""SwiGLU on the fused gate|up GEMM output: out = silu(gate) * up.

`builder/passes/fuse_gemms.fuse_gate_up` concatenates the gate projection's columns before the up projection's
(mlp.gate, then mlp.fc), so row t of the [T, 2I] input is gate[t] followed by up[t].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I] in the input dtype (computed in float32)."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu takes the fused gate|up output [T, 2I], got {list(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(inter))
    if tokens:
        _swiglu_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                             BLOCK=block)
    return out
