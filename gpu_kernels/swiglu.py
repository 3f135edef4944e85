"""SwiGLU and GeGLU on the fused gate|up GEMM output: out = silu(gate) * up, or gelu_tanh(gate) * up (Gemma).

`builder/passes/fuse_gemms.fuse_gate_up` concatenates the gate projection's columns before the up projection's
(mlp.gate, then mlp.fc), so row t of the [T, 2I] input is gate[t] followed by up[t]. One kernel serves both, the
activation a constexpr: gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) is computed as
g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), the same function.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _glu_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, alpha, beta, limit, BLOCK: tl.constexpr,
                GELU: tl.constexpr, CLAMPED: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:  # gpt-oss: min(g, limit) * sigmoid(alpha min(g, limit)) * (clamp(u, -limit, limit) + beta)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + beta
        z = alpha * gate
    else:
        z = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate) if GELU else gate  # 2 sqrt(2 / pi) (...)
    out = gate * tl.sigmoid(z) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _glu(gate_up: torch.Tensor, block: int, gelu: bool, clamp: tuple[float, float, float] | None = None
         ) -> torch.Tensor:
    name = "geglu" if gelu else "swiglu"
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{name} takes the fused gate|up output [T, 2I], got {list(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(inter))
    if tokens:
        alpha, beta, limit = clamp or (1.0, 0.0, 0.0)
        _glu_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                          alpha, beta, limit, BLOCK=block, GELU=gelu,
                                                          CLAMPED=clamp is not None)
    return out


def swiglu(gate_up: torch.Tensor, block: int = 1024, *, alpha: float = 1.0, beta: float = 0.0,
           limit: float | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I] in the input dtype (computed in float32);
    `alpha`, `beta`, `limit` other than (1, 0, None): gpt-oss's clamped form (plugins/swiglu.py)."""
    plain = (alpha, beta, limit) == (1.0, 0.0, None)
    return _glu(gate_up, block, gelu=False, clamp=None if plain else (alpha, beta, limit if limit is not None
                                                                        else float("inf")))


def geglu(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2I] -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:], [T, I] in the input dtype (computed in
    float32)."""
    return _glu(gate_up, block, gelu=True)
