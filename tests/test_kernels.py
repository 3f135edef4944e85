"""The CUDA target's Triton kernels (kernels/) against numpy references, run by Triton's interpreter on the CPU.

TRITON_INTERPRET=1 is set only while the kernel modules are imported (triton.jit reads it when it decorates;
conftest.py imports triton's own library the same way), so the variable does not leak into other tests. Only float32
and float16 are tested: bf16 arithmetic in the interpreter is wrong (cpu-stack-facts.md, "Triton in interpreter mode").
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev]); the kernels need it")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from trtbuild.kernels.load import load_kernels  # noqa: E402
from trtbuild.plugins import speculative_accept as sa  # noqa: E402
from trtbuild.plugins import swiglu as sw  # noqa: E402
from trtbuild.plugins.paged_attention import apply_rope, reference_paged_attention  # noqa: E402
from trtbuild.quantization import pack_int4, unpack_int4  # noqa: E402

# NOTE: TRTBUILD_KERNELS_DEVICE=cuda (scripts/gpu_check.sh) compiles the kernels for the GPU and runs these tests on
# GPU tensors; otherwise they run in Triton's interpreter on CPU tensors
DEVICE = "cuda" if os.environ.get("TRTBUILD_KERNELS_DEVICE") == "cuda" else "cpu"


def _dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a)).to(DEVICE)


if DEVICE == "cpu" and "triton" in sys.modules and \
        not isinstance(tl.standard.sigmoid, interpreter.InterpretedFunction):
    pytest.skip("triton was imported before tests/conftest.py could load it in interpreter mode; run these tests "
                "with TRITON_INTERPRET=1", allow_module_level=True)
# the kernel modules decorated for the interpreter (with its numpy >= 2.4 fix) or, on a GPU, compiled
K = load_kernels(interpret=DEVICE == "cpu")


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def assert_close(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype, what: str) -> None:
    np.testing.assert_allclose(got.to(torch.float32).cpu().numpy(), want, err_msg=what, **TOL[dtype])


# ---- fused residual add + RMSNorm, SwiGLU ---------------------------------------------------------------------
@DTYPES
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no_residual"])
def test_add_rmsnorm(dtype, with_residual):
    rng = np.random.default_rng(0)
    x, residual = (rng.standard_normal((5, 48)).astype(np.float32) for _ in range(2))
    weight = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    tx, tr, tw = (_dev(a).to(dtype) for a in (x, residual, weight))
    out, new_residual = K["rmsnorm"].add_rmsnorm(tx, tw, 1e-6, tr if with_residual else None)
    s = (tx.double() + tr.double() if with_residual else tx.double()).to(dtype).double().cpu().numpy()
    want = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6) * tw.double().cpu().numpy()
    assert out.dtype == new_residual.dtype == dtype
    assert_close(out, want, dtype, "normalized")
    assert_close(new_residual, s, dtype, "residual")


@DTYPES
def test_swiglu_splits_the_fused_gate_up_output_gate_first(dtype):
    gate_up = _dev(np.random.default_rng(1).standard_normal((3, 2 * 40)).astype(np.float32)).to(dtype)
    out = K["swiglu"].swiglu(gate_up, block=16)  # 3 column tiles, the last one partial
    g, u = gate_up.double().cpu().numpy()[:, :40], gate_up.double().cpu().numpy()[:, 40:]
    assert out.shape == (3, 40) and out.dtype == dtype
    assert_close(out, g / (1 + np.exp(-g)) * u, dtype, "swiglu")


@DTYPES
def test_geglu_splits_the_fused_gate_up_output_gate_first(dtype):
    """gelu_tanh(gate) * up, with the gelu's tails (-30, 30) and 3 column tiles, the last one partial."""
    x = np.random.default_rng(3).standard_normal((3, 2 * 40)).astype(np.float32) * 3
    x[0, 0], x[1, 1] = -30.0, 30.0
    gate_up = _dev(x).to(dtype)
    out = K["swiglu"].geglu(gate_up, block=16)
    assert out.shape == (3, 40) and out.dtype == dtype
    assert_close(out, sw.reference_geglu(gate_up.double().cpu().numpy()), dtype, "geglu")


# ---- weight-only GEMM ------------------------------------------------------------------------------------------
def gemm_case(kind: str, rng: np.random.Generator, n: int, k: int, group: int):
    """(codes, scales, zero points or None, dequantized W [n, k] in float64), stored as the checkpoint stores them."""
    groups = k // group
    scales = rng.uniform(0.01, 0.05, (n, groups)).astype(np.float32)
    if kind == "int8_wo":  # signed int8, one scale per output channel
        codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
        scales = scales[:, :1].reshape(n)
        return _dev(codes), _dev(scales), None, codes * scales.astype(np.float64)[:, None]
    if kind.startswith("int4"):
        q = rng.integers(-8, 8, (n, k)).astype(np.int8)
        codes = pack_int4(q)
        values = unpack_int4(codes).astype(np.float64) + 8  # the stored nibbles
        zero = 8.0
    else:  # uint8 codes, zero point 128
        codes = values = rng.integers(0, 256, (n, k)).astype(np.uint8)
        values, zero = values.astype(np.float64), 128.0
    zeros = None
    if kind.endswith("zp"):  # GGUF Q4_1-style float zero points
        zeros = rng.uniform(5, 10, (n, groups)).astype(np.float32)
        zero = np.repeat(zeros.astype(np.float64), group, axis=1)
    w = (values - zero) * np.repeat(scales.astype(np.float64), group, axis=1)
    return _dev(codes), _dev(scales), None if zeros is None else _dev(zeros), w


@DTYPES
@pytest.mark.parametrize(("kind", "group"), [("int4", 16), ("int4", 80), ("int4_zp", 16), ("uint8", 16),
                                             ("int8_wo", 80)])
def test_weight_only_gemm(dtype, kind, group):
    rng = np.random.default_rng(2)
    tokens, n, k = 20, 40, 80  # K is not a multiple of block_k; T and N span two tiles, the last partial
    codes, scales, zeros, w = gemm_case(kind, rng, n, k, group)
    x = _dev(rng.standard_normal((tokens, k)).astype(np.float32)).to(dtype)
    y = K["weight_only_gemm"].weight_only_gemm(x, codes, scales, zeros, block_m=16, block_n=32, block_k=32)
    assert y.shape == (tokens, n) and y.dtype == dtype
    assert_close(y, x.double().cpu().numpy() @ w.T, dtype, kind)


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_gemm_runs_what_convert_writes(bits):
    """Codes and scales from `trtbuild convert --weight-only`'s quantizer, against its own dequantization."""
    from trtbuild.builder.convert.weight_only import quantize_rtn

    rng = np.random.default_rng(bits)
    nbits = quantize_rtn(rng.standard_normal((24, 64)).astype(np.float32), bits, group_size=32)
    x = _dev(rng.standard_normal((3, 64)).astype(np.float32))
    y = K["weight_only_gemm"].weight_only_gemm(x, _dev(nbits.codes), _dev(nbits.scales))
    assert_close(y, x.double().cpu().numpy() @ nbits.dequantize().astype(np.float64).T, torch.float32, f"{bits} bits")


def test_weight_only_gemm_refuses_codes_that_do_not_match_x():
    with pytest.raises(ValueError, match="codes"):
        K["weight_only_gemm"].weight_only_gemm(torch.zeros(2, 32), torch.zeros(4, 20, dtype=torch.uint8),
                                               torch.ones(4, 2))


# ---- PagedAttention --------------------------------------------------------------------------------------------
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


# ---- SpeculativeAccept -----------------------------------------------------------------------------------------
def accept_batch(rng: np.random.Generator, lens: list[int], temperatures: list[float], vocab: int, k: int) -> dict:
    """Each sequence's rows between unrelated ones; drafts are the row's argmax about 70% of the time, so sequences
    stop at every position, and the first argmax of some rows is tied with a later tile."""
    rows, starts, drafts = [rng.normal(size=(2, vocab))], [], np.zeros((len(lens), k), dtype=np.int64)
    offset = 2
    for a, n in enumerate(lens):
        logits = rng.normal(size=(n + 1, vocab)) * 3
        for i in range(n + 1):
            if rng.random() < 0.3:  # a tie: the maximum again in the last tile
                logits[i, -1] = logits[i].max()
            if i < n:
                drafts[a, i] = np.argmax(logits[i]) if rng.random() < 0.7 else rng.integers(vocab)
        rows.append(logits)
        starts.append(offset)
        offset += n + 1
    rows.append(rng.normal(size=(1, vocab)))
    return dict(logits=np.concatenate(rows).astype(np.float32), accept_rows=np.array(starts, dtype=np.int64),
                draft_tokens=drafts, draft_lens=np.array(lens, dtype=np.int64),
                temperatures=np.array(temperatures, dtype=np.float64), uniforms=rng.random((len(lens), k + 1)))


@DTYPES
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_speculative_accept_matches_the_reference(dtype, temperature):
    k, vocab = 4, 100  # 4 tiles of 32, the last partial
    got_accepted, got_tokens, want_accepted = [], [], []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        lens = [0, 1, 2, 3, 4, 4, 4, 2, 0]
        # mostly `temperature`, with the other kind of sequence in the same batch
        temps = [temperature if a % 3 else (0.0 if temperature else 0.7) for a in range(len(lens))]
        data = accept_batch(rng, lens, temps, vocab, k)
        logits = torch.from_numpy(data["logits"]).to(dtype)
        data["logits"] = logits.to(torch.float32).numpy()  # the values the kernel reads
        want = sa.reference_speculative_accept(**data)
        got = K["speculative_accept"].speculative_accept(
            logits.to(DEVICE), *(_dev(data[n]) for n in sa.INPUTS[1:]), block=32)
        got_accepted.append(got[0].cpu().numpy())
        got_tokens.append(got[1].cpu().numpy())
        want_accepted.append(want[0])
        np.testing.assert_array_equal(got_accepted[-1], want[0], err_msg=f"num_accepted, seed {seed}")
        np.testing.assert_array_equal(got_tokens[-1], want[1], err_msg=f"next_tokens, seed {seed}")
    accepted, lens = np.concatenate(want_accepted), np.array(lens * 4)
    assert (accepted > 0).any() and (accepted < lens).any() and (accepted[lens > 0] == lens[lens > 0]).any()


def test_speculative_accept_draws_never_pick_zero_probability_tokens():
    # -1e4 / 0.5 lies 2e4 below the maximum: exp underflows to exactly 0 in float64, as in the reference
    logits = np.full((1, 70), -1e4, dtype=np.float32)
    logits[0, [5, 40]] = [0.0, 1.0]
    inputs = dict(logits=logits, accept_rows=np.zeros(1, np.int64), draft_tokens=np.zeros((1, 2), np.int64),
                  draft_lens=np.zeros(1, np.int64), temperatures=np.full(1, 0.5))
    for u in (0.0, 0.01, 0.5, 0.999999):
        inputs["uniforms"] = np.full((1, 3), u)
        want = sa.reference_speculative_accept(**inputs)
        got = K["speculative_accept"].speculative_accept(*(_dev(inputs[n]) for n in sa.INPUTS), block=16)
        assert int(got[1][0]) == int(want[1][0]) in (5, 40), u
