"""The CUDA target's paged-attention Triton kernel (gpu_kernels/paged_attention.py) against the numpy reference, run as
tests/test_kernels.py runs the others (Triton's interpreter on the CPU, or compiled for the GPU by
scripts/gpu_check.sh)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import DEVICE, DTYPES, TOL, K, _dev, assert_close

from trtbuild.plugins.paged_attention import apply_rope, reference_paged_attention

HEAD, LAYERS, GARBAGE = 16, 2, 3e4  # garbage fits float16, and breaks any output it leaks into


def attention_batch(seqs: list[tuple[int, int]], block: int, heads: int, kv_heads: int, seed: int) -> dict:
    """A packed batch (past, new) per sequence over a pool whose free blocks, unwritten slots, other layer and
    table padding hold garbage; block tables are shuffled."""
    rng = np.random.default_rng(seed)
    needed = [-(-(p + n) // block) for p, n in seqs]
    num_blocks = sum(needed) + 3
    width = max(needed) + 2
    perm = rng.permutation(num_blocks)
    tables = np.full((len(seqs), width), perm[-1], dtype=np.int64)  # padding entries point at a free block
    cache = np.full((num_blocks, LAYERS, 2, kv_heads, block, HEAD), GARBAGE, dtype=np.float32)
    taken = 0
    for b, (p, _) in enumerate(seqs):
        tables[b, : needed[b]] = perm[taken: taken + needed[b]]
        taken += needed[b]
        for j in range(p):
            cache[tables[b, j // block], 1, :, :, j % block] = rng.standard_normal((2, kv_heads, HEAD))
    tokens = sum(n for _, n in seqs)
    angles = np.arange(64)[:, None] * 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)[None, :]
    return {
        "q": rng.standard_normal((tokens, heads * HEAD)).astype(np.float32),
        "k": rng.standard_normal((tokens, kv_heads * HEAD)).astype(np.float32),
        "v": rng.standard_normal((tokens, kv_heads * HEAD)).astype(np.float32),
        "kv_cache": cache, "block_tables": tables,
        "past_lengths": np.array([p for p, _ in seqs], dtype=np.int64),
        "query_start_loc": np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int64),
        "position_ids": np.concatenate([np.arange(p, p + n) for p, n in seqs]).astype(np.int64),
        "rope_cos": np.cos(angles).astype(np.float32), "rope_sin": np.sin(angles).astype(np.float32),
    }


def check_attention(data: dict, heads: int, kv_heads: int, rotary: bool, dtype: torch.dtype, window: int = 0,
                    softcap: float = 0.0, sinks: np.ndarray | None = None, **blocks) -> np.ndarray:
    """The kernel against the reference (attn_out, k_new, v_new); returns the kernel's attn_out. `sinks` reach the
    kernel as float32 whatever `dtype` (as the cuda plan stores them)."""
    floats = ("q", "k", "v", "kv_cache")
    t = {n: _dev(a).to(dtype) if n in floats else _dev(a) for n, a in data.items()}
    # the reference sees the very values the kernel gets (float16-rounded when testing float16)
    ref_in = {n: t[n].to(torch.float32).cpu().numpy() if n in floats else a for n, a in data.items()}
    rope = ("position_ids", "rope_cos", "rope_sin")
    attrs = dict(layer_idx=1, num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD, scale=HEAD ** -0.5,
                 window=window, softcap=softcap)
    pool = t["kv_cache"].clone()
    got = K["paged_attention"].paged_attention(
        *(t[n] for n in ("q", "k", "v", "kv_cache", "block_tables", "past_lengths", "query_start_loc")),
        **attrs, **({n: t[n] for n in rope} if rotary else {}), **blocks,
        **({} if sinks is None else {"sinks": _dev(sinks)}))
    want = reference_paged_attention(
        *(ref_in[n] for n in ("q", "k", "v", "kv_cache", "block_tables", "past_lengths", "query_start_loc")),
        **attrs, **({n: ref_in[n] for n in rope} if rotary else {}), sinks=sinks)
    for name, g, w in zip(("attn_out", "k_new", "v_new"), got, want, strict=True):
        assert g.dtype == dtype and tuple(g.shape) == w.shape, name
        assert_close(g, w, dtype, name)
    assert torch.equal(t["kv_cache"], pool), "the op must not write the pool"
    return got[0].to(torch.float32).cpu().numpy()


# fresh prefill, decode, continuing chunk, decode at a block boundary, a chunk spanning several key tiles
MIXED = [(0, 5), (13, 1), (7, 4), (16, 1), (21, 11)]


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_mixed_batch_fp32(block, group):
    kv_heads = 2
    data = attention_batch(MIXED, block, group * kv_heads, kv_heads, seed=block + group)
    check_attention(data, group * kv_heads, kv_heads, rotary=True, dtype=torch.float32, block_m=16, block_n=16)


@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_mixed_batch_fp16(group):
    data = attention_batch(MIXED, 8, group * 2, 2, seed=group)
    check_attention(data, group * 2, 2, rotary=True, dtype=torch.float16, block_m=16, block_n=16)


@DTYPES
def test_paged_attention_without_rope(dtype):
    data = attention_batch(MIXED, 8, 4, 2, seed=5)
    check_attention(data, 4, 2, rotary=False, dtype=dtype)


def test_paged_attention_long_multi_tile_queries_mqa_int32_metadata():
    """Several query tiles per sequence (tile = 4 tokens x 4 heads), one KV head for all query heads, and int32
    indices (a plugin boundary may cast the int64 metadata)."""
    data = attention_batch([(9, 14), (0, 17), (30, 2)], 8, 4, 1, seed=7)
    for name in ("block_tables", "past_lengths", "query_start_loc", "position_ids"):
        data[name] = data[name].astype(np.int32)
    check_attention(data, 4, 1, rotary=True, dtype=torch.float32, block_m=16, block_n=16)


@pytest.mark.parametrize("splits", [2, 3])
@DTYPES
def test_paged_attention_split_k(splits, dtype):
    """Past keys shared among splits: some splits of short or empty pasts see no key at all."""
    data = attention_batch([(40, 1), (0, 3), (5, 2), (33, 6)], 8, 4, 2, seed=splits)
    check_attention(data, 4, 2, rotary=True, dtype=dtype, block_m=16, block_n=16, num_splits=splits)


@pytest.mark.parametrize(("window", "splits"), [(1, 1), (6, 1), (9, 2), (30, 3)])
def test_paged_attention_sliding_window(window, splits):
    """Each query sees its last `window` keys: in the pool, across the pool / new-key boundary, among new keys only;
    split-K shares whose keys all fall outside the window."""
    data = attention_batch(MIXED, 8, 4, 2, seed=window)
    check_attention(data, 4, 2, rotary=True, dtype=torch.float32, window=window, block_m=16, block_n=16,
                    num_splits=splits)


@DTYPES
@pytest.mark.parametrize(("softcap", "window", "splits", "q_gain"),
                         [(1.0, 0, 1, 1.0), (50.0, 0, 2, 20.0), (2.0, 6, 3, 1.0), (5.0, 9, 2, 100.0)],
                         ids=["tight", "gemma2_cap", "windowed_split3", "huge_scores_windowed"])
def test_paged_attention_softcap(dtype, softcap, window, splits, q_gain):
    """Scores become softcap * tanh(score / softcap) before the masks: past and new keys, split-K, with a sliding
    window, and scores far past the cap (e^2x overflowing to inf inside tanh); the soft-cap changes the output."""
    data = attention_batch(MIXED, 8, 4, 2, seed=int(softcap))
    data["q"] *= np.float32(q_gain)
    got = check_attention(data, 4, 2, rotary=True, dtype=dtype, window=window, softcap=softcap, block_m=16,
                          block_n=16, num_splits=splits)
    floats = {n: _dev(a).to(dtype).to(torch.float32).cpu().numpy() if n in ("q", "k", "v", "kv_cache") else a
              for n, a in data.items()}
    uncapped = reference_paged_attention(*(floats[n] for n in list(data)[:7]), layer_idx=1, num_heads=4,
                                         num_kv_heads=2, head_size=HEAD, scale=HEAD ** -0.5, window=window,
                                         **{n: data[n] for n in ("position_ids", "rope_cos", "rope_sin")})[0]
    assert not np.allclose(got, uncapped, atol=0.05)


@DTYPES
@pytest.mark.parametrize(("window", "splits", "rotary", "gain"),
                         [(0, 1, True, 1.0), (0, 3, True, 1.0), (4, 2, True, 1.0), (0, 1, False, 1.0),
                          (6, 1, True, 1.0), (0, 2, True, 10.0)],
                         ids=["plain", "split3", "window4_split2", "no_rope", "window6", "large_sinks_split2"])
def test_paged_attention_sinks(dtype, window, splits, rotary, gain):
    """gpt-oss's sinks: each query head's logit joins the softmax's denominator once, whether or not split-K
    shares its keys (splits that see no key included), with a sliding window, in decode and prefill rows of one
    batch; sinks far above every score (`gain` 10: the sink is the maximum) and far below. The sinks change the
    output, and what they remove from a row is a fraction of its no-sink output."""
    heads, kv_heads = 4, 2
    data = attention_batch(MIXED, 8, heads, kv_heads, seed=20 + splits + window)
    sinks = (np.array([-1.5, 0.25, 2.0, -30.0]) * gain).astype(np.float32)
    got = check_attention(data, heads, kv_heads, rotary=rotary, dtype=dtype, window=window, sinks=sinks,
                          block_m=16, block_n=16, num_splits=splits)
    floats = {n: _dev(a).to(dtype).to(torch.float32).cpu().numpy() if n in ("q", "k", "v", "kv_cache") else a
              for n, a in data.items()}
    plain = reference_paged_attention(*(floats[n] for n in list(data)[:7]), layer_idx=1, num_heads=heads,
                                      num_kv_heads=kv_heads, head_size=HEAD, scale=HEAD ** -0.5, window=window,
                                      **({n: data[n] for n in ("position_ids", "rope_cos", "rope_sin")} if rotary
                                         else {}))[0]
    got, plain = got.reshape(-1, heads, HEAD), plain.reshape(-1, heads, HEAD)
    assert not np.allclose(got[:, :3], plain[:, :3], atol=0.05)  # the sinks that matter change the output
    # a sink only shrinks a row's weights: out = plain * (sum of exp) / (sum of exp + exp(sink)), one factor in
    # [0, 1] for a head's whole row; head 3's sink (-30, -300) takes nothing measurable
    ratio = np.sum(got * plain, axis=-1) / np.sum(plain * plain, axis=-1)
    assert (ratio > -1e-3).all() and (ratio < 1 + 1e-3).all()
    np.testing.assert_allclose(got, plain * ratio[..., None], **TOL[dtype])
    np.testing.assert_allclose(got[:, 3], plain[:, 3], **TOL[dtype])


def test_paged_attention_refuses_sinks_of_the_wrong_shape():
    data = attention_batch([(3, 2)], 4, 2, 1, seed=0)
    t = {n: _dev(a) for n, a in data.items()}
    args = [t[n] for n in ("q", "k", "v", "kv_cache", "block_tables", "past_lengths", "query_start_loc")]
    with pytest.raises(ValueError, match="sinks must be"):
        K["paged_attention"].paged_attention(*args, layer_idx=1, num_heads=2, num_kv_heads=1, head_size=HEAD,
                                             scale=0.25, sinks=torch.zeros(1, device=DEVICE))


def int8_kv(x: np.ndarray, scale: float) -> np.ndarray:
    """What the runtime stores for x in an int8 pool (runtime/kv_cache.py): round half to even, clip to +-127."""
    return np.clip(np.rint(x / np.float32(scale)), -127, 127).astype(np.int8)


@pytest.mark.parametrize(("dtype", "splits", "ties"), [(torch.float32, 1, False), (torch.float32, 2, False),
                                                     (torch.float16, 1, False), (torch.float32, 1, True)],
                         ids=["fp32", "fp32-split2", "fp16", "fp32-ties"])
def test_paged_attention_int8_kv_cache(dtype, splits, ties):
    """An int8 pool read as stored * scale, and this step's K/V attended as the pool will store them. `ties`: new
    K/V on multiples of scale / 2 without RoPE, so that every one rounds half to even."""
    heads, kv_heads, scales = 4, 2, ((0.25, 0.25) if ties else (0.03, 0.02))
    data = attention_batch(MIXED, 8, heads, kv_heads, seed=11)
    if ties:
        data["k"], data["v"] = (np.round(data[n] * 8) / 8 for n in ("k", "v"))

    def rnd(a: np.ndarray) -> torch.Tensor:
        return _dev(np.ascontiguousarray(a, dtype=np.float32)).to(dtype)

    def f(x: torch.Tensor) -> np.ndarray:
        return x.to(torch.float32).cpu().numpy()

    pool = np.concatenate([int8_kv(data["kv_cache"][:, :, i:i + 1], s) for i, s in enumerate(scales)], axis=2)
    tokens, pos = data["q"].shape[0], data["position_ids"]
    meta = [_dev(data[n]) for n in ("block_tables", "past_lengths", "query_start_loc")]
    rope = {} if ties else {n: _dev(data[n]) for n in ("position_ids", "rope_cos", "rope_sin")}
    q, k, v = rnd(data["q"]), rnd(data["k"]), rnd(data["v"])
    attrs = dict(layer_idx=1, num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD, scale=HEAD ** -0.5)
    out, k_new, v_new = K["paged_attention"].paged_attention(
        q, k, v, _dev(pool), *meta, **attrs, **rope, num_splits=splits, block_n=16,
        kv_cache_quant_algo="int8", kv_cache_scale=scales)

    def rotated(x: torch.Tensor, n: int) -> np.ndarray:  # RoPE, then rounded to dtype as the kernel stores it
        if ties:
            return f(x).reshape(tokens, n, HEAD)
        return f(rnd(apply_rope(f(x).reshape(tokens, n, HEAD), pos, data["rope_cos"], data["rope_sin"])))

    k_rot = rotated(k, kv_heads)
    assert_close(k_new, k_rot, dtype, "k_new")
    assert_close(v_new, f(v).reshape(tokens, kv_heads, HEAD), dtype, "v_new")
    # the reference without RoPE, on rotated queries and on the values the int8 pool holds, dequantized
    deq = pool.astype(np.float32) * np.array(scales, dtype=np.float32)[None, None, :, None, None, None]
    k_q = int8_kv(k_rot, scales[0]).astype(np.float32).reshape(tokens, -1) * np.float32(scales[0])
    v_q = int8_kv(f(v), scales[1]).astype(np.float32) * np.float32(scales[1])
    want, _, _ = reference_paged_attention(rotated(q, heads).reshape(tokens, -1), k_q, v_q, deq,
                                           *(data[n] for n in ("block_tables", "past_lengths", "query_start_loc")),
                                           **attrs)
    assert_close(out, want, dtype, "attn_out")


def test_paged_attention_refuses_mixed_dtypes_and_partial_rope():
    data = attention_batch([(3, 2)], 4, 2, 1, seed=0)
    t = {n: _dev(a) for n, a in data.items()}
    args = [t[n] for n in ("q", "k", "v", "kv_cache", "block_tables", "past_lengths", "query_start_loc")]
    attrs = dict(layer_idx=1, num_heads=2, num_kv_heads=1, head_size=HEAD, scale=0.25)
    with pytest.raises(ValueError, match="one dtype"):
        K["paged_attention"].paged_attention(args[0].half(), *args[1:], **attrs)
    with pytest.raises(ValueError, match="come together"):
        K["paged_attention"].paged_attention(*args, **attrs, position_ids=t["position_ids"])
    with pytest.raises(ValueError, match="not fp8"):
        K["paged_attention"].paged_attention(*args, **attrs, kv_cache_quant_algo="fp8", kv_cache_scale=(1.0, 1.0))


