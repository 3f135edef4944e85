"""Fused residual add + RMSNorm: residual' = x + residual, out = residual' / rms(residual') * weight.

One program per token row. The sum is rounded to the activation dtype before it is normalized, so `out` equals the
unfused network's Add then RMSNormalization on the stored residual; the norm itself is computed in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, hidden], weight [hidden] -> (normalized [T, hidden], new residual [T, hidden]).

    Without `residual` this is a plain RMSNorm and the new residual is x itself."""
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rmsnorm takes x [T, hidden] and weight [hidden], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} does not match x {list(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    r = residual if residual is not None else x
    if x.shape[0]:
        _add_rmsnorm_kernel[(x.shape[0],)](
            x, r, weight, out, residual_out, x.shape[1], eps, x.stride(0), r.stride(0), out.stride(0),
            residual_out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, residual_out
