"""The CUDA target's short-convolution kernel (gpu_kernels/short_conv.py: LFM2's trtbuild::PagedShortConv) against
the numpy reference of plugins/short_conv.py, run as tests/test_kernels.py runs the others (Triton's interpreter on
the CPU, or compiled for the GPU by scripts/gpu_check.sh), on tests/test_short_conv.py's batches: decode tokens,
fresh and continuing prefills, taps reaching before position 0 and across shuffled 4-token blocks, rows over one
slot or zero-padded over several, released table entries pointing at a block of NaNs that must never be read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import DEVICE, DTYPES, K, _dev, assert_close
from test_short_conv import CASES, KV_HEADS, batch

from trtbuild.plugins import short_conv as sc


@DTYPES
@pytest.mark.parametrize(("hidden", "kernel", "slots", "layer", "bias"), CASES,
                         ids=[f"H{c[0]}_L{c[1]}_layer{c[3]}_bias_{c[4]}" for c in CASES])
def test_short_conv_matches_reference(hidden, kernel, slots, layer, bias, dtype):
    data = batch(hidden, kernel, slots, half=dtype == torch.float16, seed=hidden * 10 + kernel + layer)
    x = _dev(data["x"]).to(dtype)
    data["x"] = x.float().cpu().numpy()  # the reference convolves the rows as the kernel reads them
    with_bias = bias == "input"
    y = K["short_conv"].paged_short_conv(
        x, _dev(data["kv_cache"]).to(dtype), _dev(data["block_tables"]), _dev(data["past_lengths"]),
        _dev(data["query_start_loc"]), _dev(data["weight"]), _dev(data["bias"]) if with_bias else None,
        layer_idx=layer, max_query_len=int(np.diff(data["query_start_loc"]).max()), block_t=4, block_c=16)
    want, _ = sc.reference_short_conv(data["x"], data["kv_cache"], data["block_tables"], data["past_lengths"],
                                      data["query_start_loc"], data["weight"], data["bias"] if with_bias else None,
                                      layer_idx=layer)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert_close(y, want, dtype, "short conv")


def test_write_rows_lays_each_row_over_its_slots():
    """write_rows stores what the CPU engine's new_entries put in the same slots, padding zeroed, other slots kept."""
    hidden, slots, layer = 40, 6, 2  # 40 values over 3 slots of 16, the last one zero-padded
    data = batch(hidden, 3, slots, half=False, seed=1)
    pool = _dev(data["kv_cache"])
    before = pool.clone()
    slot_mapping = torch.tensor([5, 12, 2], device=DEVICE)
    x = _dev(data["x"][:3])
    K["short_conv"].write_rows(pool, x, slot_mapping, layer)
    entries = sc.row_as_entries(data["x"][:3], 3, KV_HEADS, pool.shape[5])  # [E, 2, T, KVH, D]
    got = pool.cpu().numpy()
    for t, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, pool.shape[4])
        np.testing.assert_array_equal(got[block, layer:layer + 3, :, :, offset], entries[:, :, t])
        got[block, layer:layer + 3, :, :, offset] = before.cpu().numpy()[block, layer:layer + 3, :, :, offset]
    np.testing.assert_array_equal(got, before.cpu().numpy())  # nothing else written


def test_short_conv_refuses_a_pool_without_the_layers_slots():
    data = batch(40, 3, 2, half=False, seed=0)
    with pytest.raises(ValueError, match="do not agree"):
        K["short_conv"].paged_short_conv(*(_dev(data[n]) for n in ("x", "kv_cache", "block_tables", "past_lengths",
                                                                    "query_start_loc", "weight")), layer_idx=0)
