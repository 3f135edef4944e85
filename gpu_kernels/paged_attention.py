"""`trtbuild::PagedAttention` (plugins/README.md) as Triton kernels: one launch for a packed batch of prefill chunks
and decode tokens over the paged pool [NB, L, 2, KVH, BS, D], checked against
`plugins.paged_attention.reference_paged_attention`.

The kernels:
- `_rope_k_kernel` (only when rotary=1) rotates the new tokens' K once into `k_new`, the op's output; attention
  then reads this step's keys from `k_new` and past keys from the pool, so no program rotates a key twice.
- `_paged_attention_kernel`, one program per (sequence, tile of its new tokens, KV head). Its rows are BLOCK_Q new
  tokens x the GROUP query heads sharing that KV head (GQA), so a decode token still fills a tile with its query
  heads and each key tile loaded serves all of them. It walks the past keys BLOCK_N slots at a time, each slot's
  block looked up in the block table (any BS, any table order), then the new keys causally, with an online
  softmax (flash attention). Only slots below past_lengths[b] are loaded: free blocks are never read.
- with `num_splits` > 1 (split-K), the past keys of a sequence are shared among that many programs, which write
  unnormalized partial states; `_reduce_splits_kernel` merges them per (token, query head).
An int8 pool (kv_cache_quant_algo="int8") is attended in units of its scales; fp8 pools are not implemented.
Attention sinks (gpt-oss, `sinks` [H]): each query head's sink is one more score without a value, folded into the
finished softmax state once: by the attention program without split-K, by `_reduce_splits_kernel` with it (never by
each split, which would count it SPLITS times).
Head vectors are handled as two halves (rotate-half RoPE pairs d with d + D/2), so RoPE of q needs no shuffles and
each score is dot(q1, k1) + dot(q2, k2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16 on the GPU
# bfloat16 is accepted but untested: the interpreter the tests run in computes it wrongly (README.md)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rope_k_kernel(k_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, num_kv_heads, half, stride_kt, stride_ot, stride_cos,
                   stride_sin, HEADS: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS)
    d = tl.arange(0, HALF)
    ok = (h < num_kv_heads)[:, None] & (d < half)[None, :]
    offs = h[:, None] * (2 * half) + d[None, :]
    x1 = tl.load(k_ptr + t * stride_kt + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + t * stride_kt + offs + half, mask=ok, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + d, mask=d < half, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + t * stride_ot + offs
    tl.store(out, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + half, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _online_softmax_step(s, v1, v2, m, denom, acc1, acc2, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] (masked keys at -inf) and its values into the running state."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    p = p.to(v1.dtype)
    acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=PRECISION)
    acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=PRECISION)
    return m_new, denom, acc1, acc2


@triton.jit
def _fake_quant_int8(x, scale):
    """x as an int8 pool stores it, in units of its scale: round(x / scale) half to even, clipped to +-127 (the
    runtime's KV write), so this step's keys and values are attended as they will be read back."""
    y = x.to(tl.float32) / scale
    r = tl.floor(y)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((y - r > 0.5) | ((y - r == 0.5) & odd), r + 1.0, r)
    return tl.minimum(tl.maximum(r, -127.0), 127.0)


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^-2|x| in (0, 1]: no overflow for any
    score. Scores in base-2 units stay so when cap is in them too."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _add_sink(sink, m, denom):
    """Fold a sink (base-2 units) into a finished softmax state (m, denom): -> (new maximum, new denominator, the
    factor that rescales the accumulated values to the new maximum). The sink has no value, so it only adds its
    own exponential to the denominator."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    return m_new, denom * alpha + tl.exp2(sink - m_new), alpha


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, pos_ptr, cos_ptr, sin_ptr, sinks_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, qk_scale, k_scale, v_scale, half, block_size, num_heads, window,
    softcap,
    stride_qt, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
    stride_cb, stride_ckv, stride_ch, stride_cs, stride_tb, stride_cos, stride_sin,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, ROTARY: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, KV_INT8: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    kvh = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    past = tl.load(past_ptr + b)
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    i = q_tile * BLOCK_Q + rows // GROUP_PAD  # new-token index within the sequence
    g = rows % GROUP_PAD
    row_ok = (i < q_len) & (g < GROUP)
    t = q_start + i
    h = kvh * GROUP + g
    d = tl.arange(0, HALF)
    d_ok = d < half
    q_ok = row_ok[:, None] & d_ok[None, :]
    q_offs = t[:, None] * stride_qt + h[:, None] * (2 * half) + d[None, :]
    q1 = tl.load(q_ptr + q_offs, mask=q_ok, other=0.0)
    q2 = tl.load(q_ptr + q_offs + half, mask=q_ok, other=0.0)
    if ROTARY:
        pos = tl.load(pos_ptr + t, mask=row_ok, other=0)
        c = tl.load(cos_ptr + pos[:, None] * stride_cos + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * stride_sin + d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        x1, x2 = q1.to(tl.float32), q2.to(tl.float32)
        q1 = (x1 * c - x2 * s).to(q_ptr.dtype.element_ty)
        q2 = (x2 * c + x1 * s).to(q_ptr.dtype.element_ty)

    # the oldest key position each row sees: with a sliding window, its last `window` keys (itself included)
    lo = tl.where(window > 0, past + i + 1 - window, 0)

    # A finite floor instead of -inf keeps alpha = exp2(m - m_new) defined for rows that saw no key yet.
    m = tl.full([BLOCK_Q * GROUP_PAD], -1.0e38, dtype=tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_Q * GROUP_PAD, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_Q * GROUP_PAD, HALF], dtype=tl.float32)

    # past keys: the pool, through the block table; every new token sees all of them. With SPLITS > 1 this program
    # takes one contiguous share of them (whole key tiles) and the last split also takes the new keys.
    chunk = tl.cdiv(past, SPLITS * BLOCK_N) * BLOCK_N
    past_lo = split * chunk
    past_hi = tl.minimum(past, past_lo + chunk)
    for j0 in range(past_lo, past_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < past_hi
        block = tl.load(tables_ptr + b * stride_tb + j // block_size, mask=j_ok, other=0)
        slot = block.to(tl.int64) * stride_cb + (j % block_size) * stride_cs + kvh * stride_ch
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k_offs = slot[:, None] + d[None, :]
        k1 = tl.load(cache_ptr + k_offs, mask=kv_ok, other=0.0)
        k2 = tl.load(cache_ptr + k_offs + half, mask=kv_ok, other=0.0)
        v1 = tl.load(cache_ptr + stride_ckv + k_offs, mask=kv_ok, other=0.0)
        v2 = tl.load(cache_ptr + stride_ckv + k_offs + half, mask=kv_ok, other=0.0)
        if KV_INT8:  # int8 values in units of the layer's K / V scale: qk_scale holds k_scale, the end v_scale
            k1, k2 = k1.to(q1.dtype), k2.to(q1.dtype)
            v1, v2 = v1.to(q1.dtype), v2.to(q1.dtype)
        scores = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        scores = tl.dot(q2, tl.trans(k2), scores, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            scores = _softcap(scores, softcap)
        scores = tl.where(j_ok[None, :] & (j[None, :] >= lo[:, None]), scores, float("-inf"))
        m, denom, acc1, acc2 = _online_softmax_step(scores, v1, v2, m, denom, acc1, acc2, PRECISION)

    # this step's keys (k_new, v), causal: new token i sees new tokens 0..i
    kv_end = tl.where(split == SPLITS - 1, tl.minimum(q_len, (q_tile + 1) * BLOCK_Q), 0)
    for j0 in range(0, kv_end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < kv_end
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k_offs = (q_start + j)[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        v_offs = (q_start + j)[:, None] * stride_vt + kvh * stride_vh + d[None, :]
        k1 = tl.load(k_ptr + k_offs, mask=kv_ok, other=0.0)
        k2 = tl.load(k_ptr + k_offs + half, mask=kv_ok, other=0.0)
        v1 = tl.load(v_ptr + v_offs, mask=kv_ok, other=0.0)
        v2 = tl.load(v_ptr + v_offs + half, mask=kv_ok, other=0.0)
        if KV_INT8:
            k1, k2 = _fake_quant_int8(k1, k_scale).to(q1.dtype), _fake_quant_int8(k2, k_scale).to(q1.dtype)
            v1, v2 = _fake_quant_int8(v1, v_scale).to(q1.dtype), _fake_quant_int8(v2, v_scale).to(q1.dtype)
        scores = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
        scores = tl.dot(q2, tl.trans(k2), scores, input_precision=PRECISION) * qk_scale
        if SOFTCAP:
            scores = _softcap(scores, softcap)
        visible = (j[None, :] <= i[:, None]) & (past + j[None, :] >= lo[:, None])
        scores = tl.where(j_ok[None, :] & visible, scores, float("-inf"))
        m, denom, acc1, acc2 = _online_softmax_step(scores, v1, v2, m, denom, acc1, acc2, PRECISION)

    if KV_INT8:
        acc1, acc2 = acc1 * v_scale, acc2 * v_scale
    if SPLITS == 1:
        if SINKS:  # NOTE: with split-K, _reduce_splits_kernel adds the sink once, after the merge
            sink = tl.load(sinks_ptr + h, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # base 2
            m, denom, alpha = _add_sink(sink, m, denom)
            acc1, acc2 = acc1 * alpha[:, None], acc2 * alpha[:, None]
        denom = tl.where(row_ok, denom, 1.0)
        out_offs = t[:, None] * stride_ot + h[:, None] * (2 * half) + d[None, :]
        tl.store(out_ptr + out_offs, (acc1 / denom[:, None]).to(out_ptr.dtype.element_ty), mask=q_ok)
        tl.store(out_ptr + out_offs + half, (acc2 / denom[:, None]).to(out_ptr.dtype.element_ty), mask=q_ok)
    else:  # unnormalized partial state, [T, H, SPLITS] (x D), merged by _reduce_splits_kernel
        part = (t * num_heads + h) * SPLITS + split
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, denom, mask=row_ok)
        acc_offs = part[:, None] * (2 * half) + d[None, :]
        tl.store(part_acc_ptr + acc_offs, acc1, mask=q_ok)
        tl.store(part_acc_ptr + acc_offs + half, acc2, mask=q_ok)


@triton.jit
def _reduce_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, out_ptr, num_heads, head_size,
                          stride_ot, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                          SINKS: tl.constexpr):
    """Merge the SPLITS partial softmax states of one (token, query head): rescale each to the common maximum. A
    sink joins here, once, as one more state with no value."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    part = (t * num_heads + h) * SPLITS + sp
    m = tl.load(part_max_ptr + part, mask=sp < SPLITS, other=-1.0e38)
    top = tl.max(m, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # LOG2E: the states are in base 2
        top = tl.maximum(top, sink)
    weight = tl.exp2(m - top)  # a split that saw no key has m = -1e38 and sum 0: weight 0
    denom = tl.sum(tl.load(part_sum_ptr + part, mask=sp < SPLITS, other=0.0) * weight, axis=0)
    if SINKS:
        denom += tl.exp2(sink - top)
    acc = tl.load(part_acc_ptr + part[:, None] * head_size + d[None, :],
                  mask=(sp < SPLITS)[:, None] & (d < head_size)[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / denom
    tl.store(out_ptr + t * stride_ot + h * head_size + d, out.to(out_ptr.dtype.element_ty), mask=d < head_size)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer_idx: int,
           num_heads: int, num_kv_heads: int, head_size: int, rope: list[torch.Tensor | None],
           kv_quant: str | None, kv_scale: tuple[float, float] | None) -> None:
    tokens = q.shape[0]
    if num_heads % num_kv_heads or head_size % 2:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, and head_size "
                         f"{head_size} even")
    want = {"q": (q, (tokens, num_heads * head_size)), "k": (k, (tokens, num_kv_heads * head_size)),
            "v": (v, (tokens, num_kv_heads * head_size))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {list(x.shape)}, expected {list(shape)}")
    if kv_cache.ndim != 6 or kv_cache.shape[2] != 2 or kv_cache.shape[3] != num_kv_heads or \
            kv_cache.shape[5] != head_size or not 0 <= layer_idx < kv_cache.shape[1]:
        raise ValueError(f"kv_cache {list(kv_cache.shape)} is not [NB, L, 2, {num_kv_heads}, BS, {head_size}] with "
                         f"layer {layer_idx}")
    if kv_quant not in (None, "int8"):
        raise ValueError(f"kv_cache_quant_algo {kv_quant!r}: this kernel reads float and int8 pools, not fp8 ones")
    if (kv_quant is None) != (kv_scale is None):
        raise ValueError("kv_cache_scale (K scale, V scale) comes with kv_cache_quant_algo, and only with it")
    if kv_quant and kv_cache.dtype != torch.int8:
        raise ValueError(f"an int8 KV cache must be an int8 tensor, got {kv_cache.dtype}")
    dtypes = {x.dtype for x in (q, k, v) + (() if kv_quant else (kv_cache,))}
    if len(dtypes) != 1 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q, k, v (and a float kv_cache) must share one dtype, float16, bfloat16 or float32; got "
                         f"{sorted(map(str, dtypes))}")
    if any(x is None for x in rope) != all(x is None for x in rope):
        raise ValueError("position_ids, rope_cos and rope_sin come together (rotary=1) or not at all")
    if rope[0] is not None and (rope[1].shape != rope[2].shape or rope[1].shape[1] != head_size // 2):
        raise ValueError(f"rope_cos {list(rope[1].shape)} and rope_sin {list(rope[2].shape)} must be [P, "
                         f"{head_size // 2}]")


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    past_lengths: torch.Tensor, query_start_loc: torch.Tensor, *, layer_idx: int, num_heads: int,
    num_kv_heads: int, head_size: int, scale: float, position_ids: torch.Tensor | None = None,
    rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None, max_query_len: int | None = None,
    block_m: int = 16, block_n: int = 64, num_splits: int = 1, kv_cache_quant_algo: str | None = None,
    kv_cache_scale: tuple[float, float] | None = None, window: int = 0, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's semantics (plugins/README.md): -> attn_out [T, H*D], k_new [T, KVH, D] (after RoPE), v_new [T, KVH, D].
    v_new, and k_new when rotary=0, are the inputs viewed as [T, KVH, D] (no copy).

    `max_query_len` (the longest new-token run) sizes the grid; pass it when known (the scheduler knows it) to
    avoid reading query_start_loc back from the device. `block_m` is the rows of a program (new tokens x query
    heads of one KV head), `block_n` the keys per tile. `num_splits` > 1 divides each sequence's past keys among
    that many programs (split-K, for few sequences with long contexts: more programs than the batch alone gives),
    with a float32 workspace of T x H x num_splits x (D + 2) and a second kernel that merges the splits.
    `kv_cache_quant_algo="int8"` with `kv_cache_scale=(K scale, V scale)`: an int8 pool (read = stored * scale), and
    this step's K/V quantized the same way before attention; k_new/v_new stay unquantized (the runtime quantizes
    when it writes them). `window` > 0: a sliding window, each query sees its last `window` keys only. `softcap` > 0:
    each score becomes softcap * tanh(score / softcap) before the masks and softmax (Gemma 2). `sinks` [num_heads]
    (any float dtype): gpt-oss's attention sinks, each query head's logit that joins the softmax's denominator
    without a value (not soft-capped)."""
    _check(q, k, v, kv_cache, layer_idx, num_heads, num_kv_heads, head_size, [position_ids, rope_cos, rope_sin],
           kv_cache_quant_algo, kv_cache_scale)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if window < 0:
        raise ValueError(f"window must be 0 (none) or positive, got {window}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be 0 (none) or positive, got {softcap}")
    if sinks is not None and (tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be [{num_heads}] floats (one per query head), got {list(sinks.shape)} "
                         f"{sinks.dtype}")
    tokens, batch = q.shape[0], past_lengths.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or query_start_loc.shape != (batch + 1,):
        raise ValueError(f"block_tables {list(block_tables.shape)} / query_start_loc {list(query_start_loc.shape)} "
                         f"do not describe {batch} sequences")
    q = q if q.stride(1) == 1 else q.contiguous()
    k = k.reshape(tokens, num_kv_heads, head_size)
    v_new = v.reshape(tokens, num_kv_heads, head_size)
    if k.stride(2) != 1 or v_new.stride(2) != 1:
        k, v_new = k.contiguous(), v_new.contiguous()
    out = torch.empty_like(q)
    half = head_size // 2
    half_pad = max(MIN_DOT, triton.next_power_of_2(half))
    rotary = position_ids is not None
    if rotary:
        k_new = torch.empty((tokens, num_kv_heads, head_size), dtype=k.dtype, device=k.device)
        if tokens:
            _rope_k_kernel[(tokens,)](k, k_new, position_ids, rope_cos, rope_sin, num_kv_heads, half, k.stride(0),
                                      k_new.stride(0), rope_cos.stride(0), rope_sin.stride(0),
                                      HEADS=triton.next_power_of_2(num_kv_heads), HALF=half_pad)
    else:
        k_new = k
    if not tokens:
        return out, k_new, v_new
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, block_m // group_pad)
    cache = kv_cache[:, layer_idx]  # [NB, 2, KVH, BS, D], a strided view: no copy
    if cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_size) dimension")
    rope = (position_ids, rope_cos, rope_sin) if rotary else (past_lengths, q, q)  # unused pointers when rotary=0
    if num_splits > 1:
        part_acc = torch.empty((tokens, num_heads, num_splits, head_size), dtype=torch.float32, device=q.device)
        part_max, part_sum = (torch.empty((tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
                              for _ in range(2))
    else:
        part_acc = part_max = part_sum = out  # not touched
    k_scale, v_scale = map(float, kv_cache_scale) if kv_cache_scale is not None else (1.0, 1.0)
    sinks_arg = sinks if sinks is not None else q  # not read when SINKS is False
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_new, v_new, cache, block_tables, past_lengths, query_start_loc, *rope, sinks_arg, out,
        part_acc, part_max, part_sum, scale * LOG2E * k_scale, k_scale, v_scale, half, cache.shape[3], num_heads,
        window, softcap * LOG2E,  # NOTE: scores are in base-2 units here, and cap * tanh(s / cap) scales with them
        q.stride(0), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), out.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), block_tables.stride(0),
        rope[1].stride(0), rope[2].stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=max(MIN_DOT, block_n), HALF=half_pad,
        ROTARY=rotary, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=num_splits,
        KV_INT8=kv_cache_quant_algo == "int8", SOFTCAP=softcap > 0, SINKS=sinks is not None)
    if num_splits > 1:
        _reduce_splits_kernel[(tokens, num_heads)](
            part_acc, part_max, part_sum, sinks_arg, out, num_heads, head_size, out.stride(0), SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_size),
            SINKS=sinks is not None)
    return out, k_new, v_new
