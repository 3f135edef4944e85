"""`trtbuild::PagedShortConv` on the GPU (LFM2's short convolution; plugins/short_conv.py is the contract).

y[t, c] = bias[c] + sum over taps i < L of weight[c, i] * u(p - L + 1 + i)[c], where p is token t's position in its
sequence and u(q) the sequence's row at position q: zero before 0, a past row read from the paged pool, else this
step's row of x. A past row lies over `entries` consecutive layer slots of its block, cut in (slot, K|V, head,
value) order, so channel c sits in slot layer_idx + c // (2 KVH D), half (c // (KVH D)) % 2, head (c // D) % KVH,
value c % D. One program is one (sequence, tile of its new tokens, tile of channels); each tap is one masked load
from x and one from the pool, weighted in float32. The pool is only read: `write_rows` stores this step's rows after
the node (as kv_write does for K/V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _short_conv_kernel(x_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, w_ptr, bias_ptr, y_ptr, hidden, layer_idx,
                       block_size, stride_x, stride_y, stride_cb, stride_cl, stride_ckv, stride_ch, stride_cs,
                       stride_tb, stride_w, KV_HEADS: tl.constexpr, HEAD: tl.constexpr, TAPS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - start
    if tl.program_id(1) * BLOCK_T >= q_len:
        return
    past = tl.load(past_ptr + b)
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # new-token index within the sequence
    t_ok = i < q_len
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < hidden
    per_slot = 2 * KV_HEADS * HEAD
    within = c % per_slot
    channel = (layer_idx + c // per_slot) * stride_cl + (within // (KV_HEADS * HEAD)) * stride_ckv + \
        ((within // HEAD) % KV_HEADS) * stride_ch + within % HEAD
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(TAPS):
        q = past + i - (TAPS - 1) + tap  # the source row's position
        new = t_ok & (q >= past)
        pooled = t_ok & (q >= 0) & (q < past)
        u = tl.load(x_ptr + (start + q - past)[:, None] * stride_x + c[None, :], mask=new[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        held = tl.maximum(q, 0)
        block = tl.load(tables_ptr + b * stride_tb + held // block_size, mask=pooled, other=0)
        u += tl.load(cache_ptr + block[:, None] * stride_cb + (held % block_size)[:, None] * stride_cs +
                     channel[None, :], mask=pooled[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * stride_w + tap, mask=c_ok, other=0.0).to(tl.float32)
        acc += u * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + (start + i)[:, None] * stride_y + c[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


def paged_short_conv(x: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, past_lengths: torch.Tensor,
                     query_start_loc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     layer_idx: int, max_query_len: int | None = None, block_t: int = 16,
                     block_c: int = 128) -> torch.Tensor:
    """y [T, H] in x's dtype for x [T, H], the pool [NB, slots, 2, KVH, BS, D] and weight [H, L] (oldest tap first);
    `max_query_len` sizes the grid (read back from query_start_loc, a device sync, when omitted)."""
    tokens, hidden = x.shape
    _, slots, _, kv_heads, block_size, head = kv_cache.shape
    entries = -(-hidden // (2 * kv_heads * head))
    if weight.shape[0] != hidden or layer_idx + entries > slots or kv_cache.stride(5) != 1:
        raise ValueError(f"paged_short_conv: x {list(x.shape)}, weight {list(weight.shape)}, pool "
                         f"{list(kv_cache.shape)} (contiguous rows) and layer_idx {layer_idx} do not agree")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty_like(x)
    if not tokens:
        return y
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (past_lengths.shape[0], triton.cdiv(max_query_len, block_t), triton.cdiv(hidden, block_c))
    _short_conv_kernel[grid](
        x, kv_cache, block_tables, past_lengths, query_start_loc, weight, bias if bias is not None else weight, y,
        hidden, layer_idx, block_size, x.stride(0), y.stride(0), *kv_cache.stride()[:5], block_tables.stride(0),
        weight.stride(0), KV_HEADS=kv_heads, HEAD=head, TAPS=weight.shape[1], HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_C=block_c)
    return y


def write_rows(kv_cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, layer_idx: int) -> None:
    """This step's rows x [T, H] into their pool slots, each over the layer's `entries` slots (zero-padded), in the
    layout the kernel reads: O(T), on the device."""
    tokens, hidden = x.shape
    _, _, _, kv_heads, block_size, head = kv_cache.shape
    per_slot = 2 * kv_heads * head
    entries = -(-hidden // per_slot)
    rows = torch.zeros((tokens, entries * per_slot), dtype=kv_cache.dtype, device=x.device)
    rows[:, :hidden] = x
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # NOTE: the advanced indices (blocks, offsets) around the slices put the token axis first: [T, E, 2, KVH, D]
    kv_cache[blocks, layer_idx:layer_idx + entries, :, :, offsets] = rows.view(tokens, entries, 2, kv_heads, head)
