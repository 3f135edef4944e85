"""The CUDA target's recurrent scans (gpu_kernels/recurrent.py: trtbuild::GatedDeltaNet and trtbuild::Mamba2Scan)
against the numpy references of plugins/gated_delta.py and plugins/mamba2.py, run as tests/test_kernels.py runs the
others (Triton's interpreter on the CPU, or compiled for the GPU by scripts/gpu_check.sh), on the batches of
tests/test_gated_delta.py and tests/test_mamba2.py: a fresh prefill, a continuing chunk and decode tokens over
shuffled state slots (stale values in a slot without a past), value heads grouped or tiled over the key heads, and
Mamba2's heads in two groups; the states written back in place, and into the checkpoints' slots after their tokens
(or not, without state_checkpoints), the other slots and layers untouched."""

from __future__ import annotations

import numpy as np
import pytest
import test_gated_delta as gdt
import test_mamba2 as m2t
import torch
from test_kernels import DTYPES, K, _dev, assert_close

from trtbuild.plugins import gated_delta as gd
from trtbuild.plugins import mamba2

STATE_TOL = dict(rtol=1e-4, atol=1e-4)


def _run(inputs: dict[str, np.ndarray], names: tuple[str, ...], dtype: torch.dtype, activations: tuple[str, ...]
         ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The op's inputs on the device (activations in `dtype`) and, for the reference, as the kernel reads them."""
    dev = {n: _dev(inputs[n]) for n in names}
    for n in activations:
        dev[n] = dev[n].to(dtype)
        inputs[n] = dev[n].float().cpu().numpy()
    return dev, inputs


def _without_checkpoints(feeds: dict[str, np.ndarray], keep: bool) -> tuple[str, ...]:
    """The op's inputs, state_checkpoints among them or not (then the reference is given None)."""
    if keep:
        return tuple(feeds)
    feeds["state_checkpoints"] = None
    return tuple(n for n in feeds if n != "state_checkpoints")


@DTYPES
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "none"])
def test_gated_delta_matches_reference(dtype, tiled, checkpoints):
    feeds = gdt.inputs(seed=3)
    dev, feeds = _run(feeds, _without_checkpoints(feeds, checkpoints), dtype, ("mixed_qkv", "z", "b", "a"))
    want_state = feeds["recurrent_state"].copy()
    want = gd.reference_gated_delta(*(feeds[n] for n in gd.INPUTS[:7]), want_state,
                                    *(feeds[n] for n in gd.INPUTS[8:]), state_layer=1, epsilon=gdt.EPS, tiled=tiled)
    y = K["recurrent"].gated_delta(*(dev.get(n) for n in gd.INPUTS), state_layer=1, epsilon=gdt.EPS, tiled=tiled,
                                   block_v=8)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close(y, want, dtype, "gated delta")
    np.testing.assert_allclose(dev["recurrent_state"].cpu().numpy(), want_state, **STATE_TOL)


@DTYPES
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "none"])
def test_mamba2_scan_matches_reference(dtype, checkpoints):
    feeds = m2t.inputs(seed=3)
    dev, feeds = _run(feeds, _without_checkpoints(feeds, checkpoints), dtype, ("xbc", "z", "dt"))
    want_state = feeds["recurrent_state"].copy()
    want = mamba2.reference_mamba2(*(feeds[n] for n in mamba2.INPUTS[:7]), want_state,
                                   *(feeds[n] for n in mamba2.INPUTS[8:]), state_layer=1, num_groups=m2t.GROUPS,
                                   epsilon=m2t.EPS)
    y = K["recurrent"].mamba2_scan(*(dev.get(n) for n in mamba2.INPUTS), state_layer=1, num_groups=m2t.GROUPS,
                                   epsilon=m2t.EPS, block_p=4)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close(y, want, dtype, "mamba2 scan")
    np.testing.assert_allclose(dev["recurrent_state"].cpu().numpy(), want_state, **STATE_TOL)
