"""The contract of `trtbuild::Mamba2Scan` (documented in plugins/README.md) and its numpy reference.

Granite 4.0-H's Mamba2 layers (selective state space, SSD) carry a state per sequence and head, S [head dim, state
size], through their tokens:

    S <- S * exp(dt A) + dt x B^T;  y = S C + D x

with x the head's channels, B and C its group's [state size] rows (heads are split evenly over `num_groups`
groups), dt = softplus(dt_raw + dt_bias) per head, A = -exp(A_log) and D per head. x, B and C are the SiLU of the
layer's convolution output (x | B | C, one row a token). Then the layer's gated norm: y * silu(z), RMS-normalized
over each group's channels (d_inner / num_groups of them), times norm_weight.

The states live where Qwen3.5's do (plugins/gated_delta.py): `recurrent_state` [slots, recurrent layers, heads, head
dim, state size] float32, slot state_slots[b], layer `state_layer`, read and overwritten in place; a sequence whose
past length is 0 starts from zero; `state_checkpoints` keeps a state part-way as there. Tokens are packed as for
PagedAttention.

Inputs: xbc [T, d_inner + 2 G N] (the convolution's output before its SiLU), z [T, d_inner], dt [T, H], A [H],
dt_bias [H], D [H], norm_weight [d_inner], recurrent_state, state_slots [B], past_lengths [B], query_start_loc
[B + 1] (int64), state_checkpoints [B, 2] (int64, optional). Attributes: state_layer, num_groups, epsilon.
Output: y [T, d_inner].
"""

from __future__ import annotations

import numpy as np

from trtbuild.plugins.gated_delta import keep_checkpoint, silu, softplus

DOMAIN = "trtbuild"
OP_TYPE = "Mamba2Scan"
INPUTS = ("xbc", "z", "dt", "A", "dt_bias", "D", "norm_weight", "recurrent_state", "state_slots", "past_lengths",
          "query_start_loc", "state_checkpoints")


def reference_mamba2(xbc: np.ndarray, z: np.ndarray, dt: np.ndarray, decay: np.ndarray, dt_bias: np.ndarray,
                     skip: np.ndarray, norm_weight: np.ndarray, recurrent_state: np.ndarray, state_slots: np.ndarray,
                     past_lengths: np.ndarray, query_start_loc: np.ndarray, state_checkpoints: np.ndarray | None = None,
                     *, state_layer: int, num_groups: int, epsilon: float) -> np.ndarray:
    """y [T, d_inner] in float64 loops, one token at a time; updates `recurrent_state` in place as the op does."""
    heads, head_dim, state_size = recurrent_state.shape[2:]
    inner = heads * head_dim
    u = silu(xbc.astype(np.float64))
    y = np.zeros((xbc.shape[0], inner))
    for seq in range(len(past_lengths)):
        slot = int(state_slots[seq])
        states = recurrent_state[slot, state_layer].astype(np.float64)
        if past_lengths[seq] == 0:
            states[:] = 0.0
        for t in range(int(query_start_loc[seq]), int(query_start_loc[seq + 1])):
            x = u[t, :inner].reshape(heads, head_dim)
            b = u[t, inner:inner + num_groups * state_size].reshape(num_groups, state_size)
            c = u[t, inner + num_groups * state_size:].reshape(num_groups, state_size)
            step = softplus(dt[t].astype(np.float64) + dt_bias)
            for h in range(heads):
                g = h // (heads // num_groups)
                states[h] = states[h] * np.exp(step[h] * decay[h]) + step[h] * np.outer(x[h], b[g])
                y[t, h * head_dim:(h + 1) * head_dim] = states[h] @ c[g] + skip[h] * x[h]
            keep_checkpoint(recurrent_state, state_checkpoints, seq, t - int(query_start_loc[seq]), state_layer, states)
        recurrent_state[slot, state_layer] = states
    gated = (y * silu(z.astype(np.float64))).reshape(len(y), num_groups, -1)
    normed = gated / np.sqrt((gated * gated).mean(-1, keepdims=True) + epsilon)
    return (normed.reshape(len(y), inner) * norm_weight).astype(np.float32)
