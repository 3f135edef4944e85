"""The CUDA target's Triton kernels (gpu_kernels/) against numpy references, run by Triton's interpreter on the CPU.

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

from trtbuild.gpu_kernels.load import load_kernels  # noqa: E402
from trtbuild.plugins import speculative_accept as sa  # noqa: E402
from trtbuild.plugins import swiglu as sw  # noqa: E402
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


# ---- SpeculativeAccept (PagedAttention: tests/test_kernels_attention.py) ---------------------------------------
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


# ---- int8 x int8 GEMM (int8_sq) ------------------------------------------------------------------------------
@DTYPES
@pytest.mark.parametrize("per_token", [False, True], ids=["static_scale", "per_token"])
def test_int8_gemm_matches_reference(dtype, per_token):
    """Activations rounded half to even and saturated at [-128, 127] (ties and values past the range included), int8
    products summed exactly, then both scales; 2 row and 3 column tiles, K off the tile."""
    rng = np.random.default_rng(7)
    tokens, k_in, n_out = 19, 72, 40
    x = rng.standard_normal((tokens, k_in)).astype(np.float32)
    x_scale = (np.abs(x).max(axis=1, keepdims=True) / 127 if per_token else np.array([0.02])).astype(np.float32)
    x[0, :4] = np.array([2.5, -3.5, 0.5, 400.0]) * x_scale.reshape(-1)[0]  # ties, and one past the range
    w = rng.integers(-127, 128, (n_out, k_in)).astype(np.int8)
    w_scale = rng.uniform(0.001, 0.01, n_out).astype(np.float32)
    tx = _dev(x).to(dtype)
    got = K["int8_gemm"].int8_gemm(tx, _dev(x_scale), _dev(w), _dev(w_scale), block_m=16, block_n=16, block_k=32)
    xs = tx.float().cpu().numpy()
    q = np.clip(np.rint(xs / x_scale), -128, 127)
    assert q[0, 3] == 127 and (dtype != torch.float32 or (q[0, 0], q[0, 1]) == (2, -4))  # saturated; ties to even
    # (float16 rounds x, so its ties are gone)
    want = (q.astype(np.float64) @ w.T.astype(np.float64)) * x_scale * w_scale[None, :]
    assert got.dtype == dtype
    assert_close(got, want, dtype, "int8 gemm")


def test_int8_gemm_refuses_scales_that_do_not_fit():
    with pytest.raises(ValueError, match="do not agree"):
        K["int8_gemm"].int8_gemm(_dev(np.zeros((3, 8), np.float32)), _dev(np.ones(2, np.float32)),
                                 _dev(np.zeros((4, 8), np.int8)), _dev(np.ones(4, np.float32)))
