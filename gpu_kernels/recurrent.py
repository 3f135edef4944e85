"""The recurrent layers' scans on the GPU: `trtbuild::GatedDeltaNet` (Qwen3.5, plugins/gated_delta.py) and
`trtbuild::Mamba2Scan` (Granite 4.0-H, Nemotron-H; plugins/mamba2.py) are the contracts.

Each program owns one sequence, one head and a tile of the state's columns (value dims / state rows), which stay in
registers, float32, while the program walks the sequence's new tokens in order; it reads the state from the
sequence's slot (zero for a sequence without a past) and writes it back once at the end (and, given
`state_checkpoints`, once more into the checkpoint's slot after the checkpoint's token). The gated norms that close
both ops span whole heads (Mamba2's: whole groups of heads), so they run after the scan, in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _checkpoint(ckpt_ptr, seq, start, HAS_CKPT: tl.constexpr):
    """(the token after which the sequence's state is also kept, -1: none; the checkpoint's slot)."""
    if HAS_CKPT:
        n = tl.load(ckpt_ptr + 2 * seq)
        return tl.where(n > 0, start + n - 1, -1), tl.maximum(tl.load(ckpt_ptr + 2 * seq + 1), 0)
    return start * 0 - 1, start * 0


@triton.jit
def _gated_delta_kernel(qkv_ptr, b_ptr, a_ptr, decay_ptr, dt_bias_ptr, state_ptr, slots_ptr, past_ptr, qsl_ptr,
                        ckpt_ptr, o_ptr, stride_qkv, stride_ab, stride_o, stride_ss, stride_sl, stride_sh, state_layer,
                        KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        TILED: tl.constexpr, HAS_CKPT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq, h = tl.program_id(0), tl.program_id(1)
    kh = h % KEY_HEADS if TILED else h // (VALUE_HEADS // KEY_HEADS)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i_ok, j_ok = i < DK, j < DV
    head = state_layer * stride_sl + h * stride_sh + i[:, None] * DV + j[None, :]
    tile = state_ptr + tl.load(slots_ptr + seq) * stride_ss + head
    ckpt_token, ckpt_slot = _checkpoint(ckpt_ptr, seq, start, HAS_CKPT)
    ckpt_tile = state_ptr + ckpt_slot * stride_ss + head
    mask = i_ok[:, None] & j_ok[None, :]
    s = tl.load(tile, mask=mask & (tl.load(past_ptr + seq) > 0), other=0.0).to(tl.float32)
    rate, bias = tl.load(decay_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32)
    kd = KEY_HEADS * DK
    for t in range(start, end):
        row = qkv_ptr + t * stride_qkv
        q = _silu(tl.load(row + kh * DK + i, mask=i_ok, other=0.0).to(tl.float32))
        k = _silu(tl.load(row + kd + kh * DK + i, mask=i_ok, other=0.0).to(tl.float32))
        v = _silu(tl.load(row + 2 * kd + h * DV + j, mask=j_ok, other=0.0).to(tl.float32))
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK * 1.0)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        beta = tl.sigmoid(tl.load(b_ptr + t * stride_ab + h).to(tl.float32))
        decay = tl.exp(rate * _softplus(tl.load(a_ptr + t * stride_ab + h).to(tl.float32) + bias))
        delta = (v - decay * tl.sum(s * k[:, None], axis=0)) * beta
        s = decay * s + k[:, None] * delta[None, :]
        tl.store(ckpt_tile, s, mask=mask & (t == ckpt_token))
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_o + h * DV + j, o.to(o_ptr.dtype.element_ty), mask=j_ok)
    if end > start:
        tl.store(tile, s, mask=mask)


def gated_delta(mixed_qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, decay: torch.Tensor,
                dt_bias: torch.Tensor, norm_weight: torch.Tensor, states: torch.Tensor, state_slots: torch.Tensor,
                past_lengths: torch.Tensor, query_start_loc: torch.Tensor,
                state_checkpoints: torch.Tensor | None = None, *, state_layer: int, epsilon: float,
                tiled: bool = False, block_v: int = 32) -> torch.Tensor:
    """y [T, value heads x value dim] (the compute dtype) of plugins/gated_delta.py; `states` updated in place."""
    value_heads, dk, dv = states.shape[2:]
    key_heads = (mixed_qkv.shape[1] - value_heads * dv) // (2 * dk)
    tokens = mixed_qkv.shape[0]
    o = torch.empty((tokens, value_heads * dv), dtype=torch.float32, device=mixed_qkv.device)
    grid = (len(past_lengths), value_heads, triton.cdiv(dv, block_v))
    _gated_delta_kernel[grid](mixed_qkv, b, a, decay, dt_bias, states, state_slots, past_lengths, query_start_loc,
                              state_slots if state_checkpoints is None else state_checkpoints, o,
                              mixed_qkv.stride(0), b.stride(0), o.stride(0), states.stride(0), states.stride(1),
                              states.stride(2), state_layer, KEY_HEADS=key_heads, VALUE_HEADS=value_heads, DK=dk,
                              DV=dv, TILED=tiled, HAS_CKPT=state_checkpoints is not None,
                              BLOCK_K=triton.next_power_of_2(dk),
                              BLOCK_V=min(block_v, triton.next_power_of_2(dv)))
    o = o.view(tokens, value_heads, dv)
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + epsilon) * norm_weight.float()
    return (normed * torch.nn.functional.silu(z.float().view(tokens, value_heads, dv))).reshape(
        tokens, -1).to(mixed_qkv.dtype)


@triton.jit
def _mamba2_kernel(xbc_ptr, dt_ptr, decay_ptr, dt_bias_ptr, skip_ptr, state_ptr, slots_ptr, past_ptr, qsl_ptr,
                   ckpt_ptr, y_ptr, stride_x, stride_dt, stride_y, stride_ss, stride_sl, stride_sh, state_layer,
                   HEADS: tl.constexpr, GROUPS: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                   HAS_CKPT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    seq, h = tl.program_id(0), tl.program_id(1)
    g = h // (HEADS // GROUPS)
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    i = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    j = tl.arange(0, BLOCK_N)
    i_ok, j_ok = i < P, j < N
    head = state_layer * stride_sl + h * stride_sh + i[:, None] * N + j[None, :]
    tile = state_ptr + tl.load(slots_ptr + seq) * stride_ss + head
    ckpt_token, ckpt_slot = _checkpoint(ckpt_ptr, seq, start, HAS_CKPT)
    ckpt_tile = state_ptr + ckpt_slot * stride_ss + head
    mask = i_ok[:, None] & j_ok[None, :]
    s = tl.load(tile, mask=mask & (tl.load(past_ptr + seq) > 0), other=0.0).to(tl.float32)
    rate, bias = tl.load(decay_ptr + h).to(tl.float32), tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = tl.load(skip_ptr + h).to(tl.float32)
    inner = HEADS * P
    for t in range(start, end):
        row = xbc_ptr + t * stride_x
        x = _silu(tl.load(row + h * P + i, mask=i_ok, other=0.0).to(tl.float32))
        bb = _silu(tl.load(row + inner + g * N + j, mask=j_ok, other=0.0).to(tl.float32))
        cc = _silu(tl.load(row + inner + (GROUPS + g) * N + j, mask=j_ok, other=0.0).to(tl.float32))
        step = _softplus(tl.load(dt_ptr + t * stride_dt + h).to(tl.float32) + bias)
        s = s * tl.exp(step * rate) + (step * x)[:, None] * bb[None, :]
        tl.store(ckpt_tile, s, mask=mask & (t == ckpt_token))
        y = tl.sum(s * cc[None, :], axis=1) + skip * x
        tl.store(y_ptr + t * stride_y + h * P + i, y.to(y_ptr.dtype.element_ty), mask=i_ok)
    if end > start:
        tl.store(tile, s, mask=mask)


def mamba2_scan(xbc: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, dt_bias: torch.Tensor,
                skip: torch.Tensor, norm_weight: torch.Tensor, states: torch.Tensor, state_slots: torch.Tensor,
                past_lengths: torch.Tensor, query_start_loc: torch.Tensor,
                state_checkpoints: torch.Tensor | None = None, *, state_layer: int, num_groups: int,
                epsilon: float, block_p: int = 16) -> torch.Tensor:
    """y [T, heads x head dim] (the compute dtype) of plugins/mamba2.py; `states` updated in place."""
    heads, p, n = states.shape[2:]
    tokens = xbc.shape[0]
    y = torch.empty((tokens, heads * p), dtype=torch.float32, device=xbc.device)
    grid = (len(past_lengths), heads, triton.cdiv(p, block_p))
    _mamba2_kernel[grid](xbc, dt, decay, dt_bias, skip, states, state_slots, past_lengths, query_start_loc,
                         state_slots if state_checkpoints is None else state_checkpoints, y,
                         xbc.stride(0), dt.stride(0), y.stride(0), states.stride(0), states.stride(1),
                         states.stride(2), state_layer, HEADS=heads, GROUPS=num_groups, P=p, N=n,
                         HAS_CKPT=state_checkpoints is not None, BLOCK_P=min(block_p, triton.next_power_of_2(p)),
                         BLOCK_N=triton.next_power_of_2(n))
    gated = (y * torch.nn.functional.silu(z.float())).view(tokens, num_groups, -1)
    normed = gated * torch.rsqrt(gated.square().mean(-1, keepdim=True) + epsilon)
    return (normed.reshape(tokens, -1) * norm_weight.float()).to(xbc.dtype)
