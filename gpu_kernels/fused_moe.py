"""A mixture of experts' experts in one pass per projection (the CUDA plan's `moe` step; in the CPU graph ONNX
Runtime's com.microsoft MoE): the routing and sorting in torch, both projections in one grouped-GEMM Triton kernel.

1. route: softmax of the router's logits in float32, each token's top k (ties: the lower expert), renormalized over
   the k where `normalize` (as plugins/moe_route.py: reference_moe_route).
2. align: the T * k (token, expert) pairs sorted by expert, each expert's run padded to a multiple of `block_m`
   with the sentinel pair T * k, so that a tile of `block_m` sorted rows belongs to one expert; `tile_experts[i]`
   is tile i's expert, -1 past the last tile in use (that program returns at once). Shapes depend on T only, and
   nothing is read back to the host, so a CUDA graph can capture the step.
3. gate|up: each tile's rows x[pair // k] times its expert's [2I, H] rows (+ their bias) -> h[pair], [T * k, 2I];
   SwiGLU over h (gpu_kernels/swiglu.py, gpt-oss's clamped form included).
4. down: each tile's rows h'[pair] times its expert's [H, I] rows (+ bias), times the pair's routing weight ->
   y[pair], [T * k, H]; each token sums its k rows.

Weights are [E, out, in] (as cuBLAS reads x @ W^T) with gate | up stacked along `out` per expert (gate rows first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trtbuild.gpu_kernels.swiglu import swiglu


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, bias_ptr, weights_ptr, out_ptr, pairs_ptr, tile_experts_ptr,
                         num_pairs, top_k, n_out, k_in, stride_xm, stride_we, stride_wn, stride_be, stride_om,
                         BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr,
                         PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # the sentinel pads an expert's run to whole tiles
    rows = pairs // top_k if BY_TOKEN else pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_in
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if WEIGHTED:
        acc *= tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, k] int64, weights [T, k] float32): each token's top k experts by softmax probability."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1, sorted=True)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [tiles * block_m], tile_experts [tiles]) of the flattened pairs' experts [T * k], as the module
    docstring's step 2; tiles = cdiv(T * k + E * (block_m - 1), block_m), every run's worst-case padding."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    tiles = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # by expert, then by pair
    sorted_experts = flat[order]
    starts = torch.cumsum(counts, 0) - counts  # each expert's first position among the sorted pairs
    rank = torch.arange(num_pairs, device=flat.device) - starts[sorted_experts]
    destination = (padded_ends - padded)[sorted_experts] + rank
    pairs = torch.full((tiles * block_m,), num_pairs, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, destination, order)
    tile_starts = torch.arange(tiles, device=flat.device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return pairs, tile_experts


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, tile_experts: torch.Tensor, top_k: int,
                 by_token: bool, bias: torch.Tensor | None = None, weights: torch.Tensor | None = None, *,
                 block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    """out[p] = x[p // top_k if by_token else p] @ w[e]^T (+ bias[e]) (* weights[p]) for every pair p of expert e in
    the aligned order; out is [T * top_k, N] in x's dtype (rows of no pair are never written: there are none)."""
    num_pairs = (x.shape[0] * top_k) if by_token else x.shape[0]
    n_out, k_in = w.shape[1], w.shape[2]
    if w.stride(2) != 1:
        w = w.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((num_pairs, n_out), dtype=x.dtype, device=x.device)
    if num_pairs and n_out:
        grid = (tile_experts.numel(), triton.cdiv(n_out, block_n))
        _grouped_gemm_kernel[grid](
            x, w, bias if bias is not None else w, weights if weights is not None else w, out, pairs, tile_experts,
            num_pairs, top_k, n_out, k_in, x.stride(0), w.stride(0), w.stride(1),
            bias.stride(0) if bias is not None else 0, out.stride(0),
            BY_TOKEN=by_token, HAS_BIAS=bias is not None, WEIGHTED=weights is not None,
            # float32 activations: exact float32 products, not TF32 (the CPU engine's precision)
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int,
              normalize: bool, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              alpha: float = 1.0, beta: float = 0.0, limit: float | None = None, *, block_m: int = 16,
              block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [T, H], logits [T, E], gate_up [E, 2I, H], down [E, H, I] (biases [E, 2I], [E, H]) -> [T, H] in x's dtype:
    sum over each token's k experts of weight * down(swiglu(gate_up(x))); `alpha`, `beta`, `limit`: the SwiGLU's
    clamped form (gpt-oss), as plugins/swiglu.py."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    if logits.shape != (tokens, num_experts) or down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"fused_moe: x {list(x.shape)}, logits {list(logits.shape)}, gate_up {list(gate_up.shape)}, "
                         f"down {list(down.shape)} do not agree")
    if not tokens:
        return torch.empty_like(x)
    experts, weights = route(logits, k, normalize)
    pairs, tile_experts = align(experts, num_experts, block_m)
    tiles = dict(block_m=block_m, block_n=block_n, block_k=block_k)
    h = grouped_gemm(x, gate_up, pairs, tile_experts, k, True, gate_up_bias, **tiles)
    act = swiglu(h, alpha=alpha, beta=beta, limit=limit)
    y = grouped_gemm(act, down, pairs, tile_experts, k, False, down_bias, weights.reshape(-1), **tiles)
    return y.view(tokens, k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
