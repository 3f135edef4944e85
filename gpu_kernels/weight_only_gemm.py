"""Weight-only GEMM: y = x @ dequant(W)^T with W kept as int8 or int4 codes and dequantized inside the kernel.

The weights are taken exactly as the checkpoint stores them (builder/weight_only_linear.py, quantization.py):
  codes   uint8 [N, K] (8-bit) or [N, K/2] (4-bit: feature 2j in the low nibble of byte j, 2j+1 in the high one),
          or int8 [N, K] (int8_wo: signed codes, zero point 0)
  scales  [N, K/g], one per group of g input features ([N] or [N, 1]: per output channel)
  zero points  optional float [N, K/g]; absent: 2^(bits-1) for uint8 codes (128, or 8 as in int4_awq's q + 8)
  W[n, k] = (code[n, k] - zero_point[n, k // g]) * scale[n, k // g]
x is float16, bfloat16 or float32; the dot accumulates in float32 and y has x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weight_only_gemm_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, out_ptr, tokens, n_out, k_in, group,
                             stride_xm, stride_cn, stride_sn, stride_zn, stride_om,
                             BITS: tl.constexpr, ZERO_POINT: tl.constexpr, HAS_ZEROS: tl.constexpr,
                             PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < tokens, cols < n_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        if BITS == 4:
            byte = tl.load(codes_ptr + cols[None, :] * stride_cn + (ks // 2)[:, None], mask=w_ok, other=0)
            code = ((byte >> ((ks % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        else:
            code = tl.load(codes_ptr + cols[None, :] * stride_cn + ks[:, None], mask=w_ok, other=0).to(tl.float32)
        g = (ks // group)[:, None]
        scale = tl.load(scales_ptr + cols[None, :] * stride_sn + g, mask=w_ok, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + cols[None, :] * stride_zn + g, mask=w_ok, other=0.0).to(tl.float32)
        else:
            zero = ZERO_POINT
        w = ((code - zero) * scale).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def weight_only_gemm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     zero_points: torch.Tensor | None = None, *, block_m: int = 16, block_n: int = 64,
                     block_k: int = 64) -> torch.Tensor:
    """x [T, K] @ dequant(codes, scales, zero_points)^T -> [T, N]; bits are read from the codes' shape."""
    if x.ndim != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight_only_gemm takes float16, bfloat16 or float32 x [T, K], got {x.dtype} "
                         f"{list(x.shape)}")
    tokens, k_in = x.shape
    n_out = codes.shape[0]
    if codes.dtype == torch.int8 and codes.shape == (n_out, k_in):
        bits, zero_point = 8, 0
    elif codes.dtype == torch.uint8 and codes.shape[1] in (k_in, k_in // 2) and k_in % 2 == 0:
        bits = 8 if codes.shape[1] == k_in else 4
        zero_point = 1 << (bits - 1)
    else:
        raise ValueError(f"codes {codes.dtype} {list(codes.shape)} are not int8 [N, {k_in}] nor uint8 [N, {k_in}] / "
                         f"[N, {k_in // 2}] for x with K = {k_in}")
    scales = scales.reshape(n_out, -1)
    groups = scales.shape[1]
    if k_in % groups:
        raise ValueError(f"scales {list(scales.shape)}: {groups} groups do not divide K = {k_in}")
    if zero_points is not None:
        if codes.dtype == torch.int8:
            raise ValueError("zero points apply to uint8 codes, not to signed int8 ones")
        zero_points = zero_points.reshape(n_out, groups)
        zero_points = zero_points if zero_points.stride(1) == 1 else zero_points.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    codes = codes if codes.stride(1) == 1 else codes.contiguous()
    scales = scales if scales.stride(1) == 1 else scales.contiguous()
    zeros = zero_points if zero_points is not None else scales
    out = torch.empty((tokens, n_out), dtype=x.dtype, device=x.device)
    if tokens and n_out:
        grid = (triton.cdiv(tokens, block_m), triton.cdiv(n_out, block_n))
        _weight_only_gemm_kernel[grid](
            x, codes, scales, zeros, out, tokens, n_out, k_in, k_in // groups,
            x.stride(0), codes.stride(0), scales.stride(0), zeros.stride(0), out.stride(0),
            BITS=bits, ZERO_POINT=zero_point, HAS_ZEROS=zero_points is not None,
            # float32 activations: exact float32 products, not TF32 (the CPU engine's precision)
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
