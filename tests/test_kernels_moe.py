"""The CUDA target's mixture-of-experts kernels (gpu_kernels/fused_moe.py, and SwiGLU's clamped form) against numpy
references, run as tests/test_kernels.py runs the others (Triton's interpreter on the CPU, or compiled for the GPU by
scripts/gpu_check.sh)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import DEVICE, DTYPES, TOL, K, _dev, assert_close

from trtbuild.plugins.moe_route import reference_moe_route
from trtbuild.plugins.swiglu import GPT_OSS_SWIGLU, reference_swiglu


def reference_moe(x: np.ndarray, logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray, k: int, normalize: bool,
                  gate_up_bias: np.ndarray | None = None, down_bias: np.ndarray | None = None,
                  **swiglu_form: float) -> np.ndarray:
    """ONNX Runtime's MoE (softmax routing, SwiGLU experts, gate rows then up rows per expert) in float64, token by
    token, its routing from plugins/moe_route.py's reference."""
    rows, weights, offsets, _ = reference_moe_route(logits, k, normalize)
    out = np.zeros((x.shape[0], down.shape[1]))
    for e in range(gate_up.shape[0]):
        for r in range(int(offsets[e]), int(offsets[e + 1])):
            t = rows[r]
            h = gate_up[e].astype(np.float64) @ x[t] + (0 if gate_up_bias is None else gate_up_bias[e])
            y = down[e].astype(np.float64) @ reference_swiglu(h, **swiglu_form) + (0 if down_bias is None else
                                                                                  down_bias[e])
            out[t] += weights[r, 0] * y
    return out


def moe_problem(tokens: int, experts: int, hidden: int, inter: int, seed: int, bias: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    problem = {"x": rng.standard_normal((tokens, hidden)).astype(np.float32),
               "logits": rng.standard_normal((tokens, experts)).astype(np.float32) * 2,
               "gate_up": (rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(np.float32),
               "down": (rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)).astype(np.float32)}
    if bias:
        problem["gate_up_bias"] = rng.standard_normal((experts, 2 * inter)).astype(np.float32) * 0.1
        problem["down_bias"] = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1
    return problem


# (tokens, experts, k, hidden, intermediate, tiles): a decode token (every run padded), more pairs than a tile per
# expert, experts no token chose, dimensions that are not multiples of the tiles
SHAPES = [(1, 8, 2, 32, 16, dict(block_m=16, block_n=16, block_k=16)),
          (37, 4, 2, 48, 24, dict(block_m=16, block_n=32, block_k=16)),
          (5, 16, 4, 40, 20, dict(block_m=16, block_n=16, block_k=32))]


@DTYPES
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "softmax_weights"])
@pytest.mark.parametrize("shape", SHAPES, ids=["decode", "prefill", "sparse"])
def test_fused_moe_matches_reference(dtype, normalize, shape):
    tokens, experts, k, hidden, inter, tiles = shape
    p = moe_problem(tokens, experts, hidden, inter, seed=tokens)
    got = K["fused_moe"].fused_moe(*(_dev(p[n]).to(dtype) for n in ("x", "logits", "gate_up", "down")), k, normalize,
                                   **tiles)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # the reference routes on the logits as the kernel sees them (float16 rounds them)
    p = {n: _dev(v).to(dtype).float().cpu().numpy() for n, v in p.items()}
    assert_close(got, reference_moe(p["x"], p["logits"], p["gate_up"], p["down"], k, normalize), dtype, "moe")


@DTYPES
def test_fused_moe_with_biases_and_the_clamped_swiglu(dtype):
    """gpt-oss's experts: biased projections and min(g, 7) * sigmoid(1.702 g) * (clamp(u, -7, 7) + 1)."""
    p = moe_problem(9, 8, 32, 16, seed=3, bias=True)
    p["x"] *= 8  # pre-activations past the limit, so the clamps matter
    got = K["fused_moe"].fused_moe(*(_dev(p[n]).to(dtype) for n in ("x", "logits", "gate_up", "down")), 2, True,
                                   _dev(p["gate_up_bias"]).to(dtype), _dev(p["down_bias"]).to(dtype),
                                   **GPT_OSS_SWIGLU, block_m=16, block_n=16, block_k=16)
    p = {n: _dev(v).to(dtype).float().cpu().numpy() for n, v in p.items()}
    want = reference_moe(p["x"], p["logits"], p["gate_up"], p["down"], 2, True, p["gate_up_bias"], p["down_bias"],
                         **GPT_OSS_SWIGLU)
    assert np.abs(want).max() > 7, "the problem should reach the clamp"
    np.testing.assert_allclose(got.float().cpu().numpy(), want, **{k: v * 8 for k, v in TOL[dtype].items()})


def test_align_pads_each_expert_to_whole_tiles():
    """Pairs sorted by expert, then pair index; each expert's run padded with the sentinel T * k to a multiple of the
    tile; tiles past the last run are -1 (their programs return at once)."""
    experts = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    pairs, tile_experts = K["fused_moe"].align(experts, num_experts=4, block_m=4)
    s = 6  # the sentinel: T * k
    assert pairs.tolist()[:12] == [1, 4, s, s, 3, s, s, s, 0, 2, 5, s]
    assert pairs.tolist()[12:] == [s] * (len(pairs) - 12)
    assert tile_experts.tolist() == [0, 1, 2] + [-1] * (len(tile_experts) - 3)
    assert len(tile_experts) == -(-(6 + 4 * 3) // 4)  # every run's worst-case padding fits


@DTYPES
def test_swiglu_clamped_form(dtype):
    rng = np.random.default_rng(5)
    gate_up = (rng.standard_normal((3, 40)) * 6).astype(np.float32)
    out = K["swiglu"].swiglu(_dev(gate_up).to(dtype), block=16, **GPT_OSS_SWIGLU)
    x = _dev(gate_up).to(dtype).float().cpu().numpy()
    assert_close(out, reference_swiglu(x, **GPT_OSS_SWIGLU), dtype, "clamped swiglu")


def test_fused_moe_refuses_shapes_that_disagree():
    p = moe_problem(2, 4, 16, 8, seed=0)
    with pytest.raises(ValueError, match="do not agree"):
        K["fused_moe"].fused_moe(_dev(p["x"]), _dev(p["logits"][:, :3]), _dev(p["gate_up"]), _dev(p["down"]), 2,
                                 True)
