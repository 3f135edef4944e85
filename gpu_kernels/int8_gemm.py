"""int8 x int8 GEMM with an int32 accumulator (SmoothQuant's W8A8, `int8_sq`): y = (q(x) @ W^T) * s_x * s_w.

The activations are quantized first (`quantize_int8`, in torch: round(x / s_x) half to even, saturated to
[-128, 127], as ONNX QuantizeLinear and the CPU engine do), with one scale for the tensor (a calibrated static scale)
or one per token ([T, 1]: per-token activations). The kernel multiplies int8 tiles into int32 (exact), then scales
each output by its row's activation scale and its column's weight scale (per output channel) in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_gemm_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, tokens, n_out, k_in, stride_xm, stride_wn, stride_sx,
                      stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < tokens, cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(x, w, out_dtype=tl.int32)
    s_x = tl.load(sx_ptr + rows * stride_sx, mask=row_ok, other=0.0)
    s_w = tl.load(sw_ptr + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * s_x[:, None] * s_w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale) half to even, saturated to [-128, 127], int8; `scale` [1] or [T, 1], divided in float32."""
    return torch.round(x.float() / scale.float()).clamp_(-128, 127).to(torch.int8)


def int8_gemm(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, *,
              block_m: int = 16, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """x [T, K] float (quantized here with x_scale [1] or [T, 1]) @ weight [N, K] int8 (w_scale [N]) -> [T, N] in
    x's dtype."""
    tokens, k_in = x.shape
    n_out = weight.shape[0]
    if weight.dtype != torch.int8 or weight.shape[1] != k_in or w_scale.numel() != n_out or \
            x_scale.numel() not in (1, tokens):
        raise ValueError(f"int8_gemm: x {list(x.shape)}, x_scale {list(x_scale.shape)}, weight {weight.dtype} "
                         f"{list(weight.shape)}, w_scale {list(w_scale.shape)} do not agree")
    xq = quantize_int8(x, x_scale)
    s_x = x_scale.float().reshape(-1).contiguous()
    s_w = w_scale.float().reshape(-1).contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty((tokens, n_out), dtype=x.dtype, device=x.device)
    if tokens and n_out:
        grid = (triton.cdiv(tokens, block_m), triton.cdiv(n_out, block_n))
        _int8_gemm_kernel[grid](xq, weight, s_x, s_w, out, tokens, n_out, k_in, xq.stride(0), weight.stride(0),
                                0 if s_x.numel() == 1 else 1, out.stride(0),
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
