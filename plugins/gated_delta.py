"""The contract of `trtbuild::GatedDeltaNet` (documented in plugins/README.md) and its numpy reference.

Qwen3.5's linear attention layers (gated DeltaNet) replace softmax attention by a recurrent state per sequence and
value head, S [key dim, value dim], which each token decays, corrects towards its value and reads:

    S <- S * exp(g);  S <- S + k (beta (v - k^T S))^T;  o = q^T S

with q, k L2-normalized per head (q also scaled by key_dim^-1/2), beta = sigmoid(b), g = A softplus(a + dt_bias)
(A: the layer's decay rates, -exp(A_log)). A value head h reads key head h // (value heads / key heads), or
h % key heads where the attribute `tiled` is 1 (llama.cpp's order of the value heads in its GGUF files). The op also
applies the layer's gated RMSNorm to o: y = rmsnorm(o) * norm_weight * silu(z), per value head.

The state is not a row a token writes (as K/V and LFM2's convolution rows are), so it does not live in the paged
pool: `recurrent_state` [state slots, state layers, value heads, key dim, value dim] float32 holds every sequence's
state in the slot the runtime gave it (runtime/recurrent_state.py), and the op reads and overwrites slot
state_slots[b], layer `state_layer`, in place. A sequence whose past length is 0 starts from a zero state, whatever
its slot held. Tokens are packed as for PagedAttention: sequence b owns tokens query_start_loc[b]:query_start_loc[b+1].

A step that verifies speculative drafts keeps the state from before them: `state_checkpoints` [B, 2] int64 (optional;
engines built before it have none) row b = (n, slot) also writes sequence b's state after its first n new tokens
into slot `slot`, a slot no sequence of the step runs in (n = 0: none). When a draft is rejected the runtime copies
it back (runtime/recurrent_state.py).

Inputs: mixed_qkv [T, 2 Kd + Vd] (the convolution's output, before its SiLU: q, then k, then v), z [T, Vd],
b [T, Hv], a [T, Hv], A [Hv], dt_bias [Hv], norm_weight [value dim], recurrent_state, state_slots [B] int64,
past_lengths [B] int64, query_start_loc [B + 1] int64, state_checkpoints [B, 2] int64 (optional). Attributes:
state_layer, epsilon (the gated norm's), tiled (0 unless given).
Output: y [T, Vd].
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "GatedDeltaNet"
INPUTS = ("mixed_qkv", "z", "b", "a", "A", "dt_bias", "norm_weight", "recurrent_state", "state_slots",
          "past_lengths", "query_start_loc", "state_checkpoints")
STATE_INPUT, STATE_SLOTS_INPUT, CHECKPOINTS_INPUT = "recurrent_state", "state_slots", "state_checkpoints"
L2_EPSILON = 1e-6  # the q / k L2 norms' (as transformers' and flash-linear-attention's)


def keep_checkpoint(recurrent_state: np.ndarray, state_checkpoints: np.ndarray | None, seq: int, token: int,
                    state_layer: int, states: np.ndarray) -> None:
    """The references' state_checkpoints: after the sequence's new token `token` (0-based), the layer's states also
    go to the checkpoint's slot if that is where the checkpoint falls."""
    if state_checkpoints is not None and state_checkpoints[seq, 0] == token + 1:
        recurrent_state[int(state_checkpoints[seq, 1]), state_layer] = states


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20: x itself above it)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_gated_delta(mixed_qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, decay: np.ndarray,
                          dt_bias: np.ndarray, norm_weight: np.ndarray, recurrent_state: np.ndarray,
                          state_slots: np.ndarray, past_lengths: np.ndarray, query_start_loc: np.ndarray,
                          state_checkpoints: np.ndarray | None = None, *, state_layer: int, epsilon: float,
                          tiled: bool = False) -> np.ndarray:
    """y [T, Vd] in float64 loops, one token at a time; updates `recurrent_state` in place as the op does."""
    value_heads, key_dim, value_dim = recurrent_state.shape[2:]
    key_heads = (mixed_qkv.shape[1] - value_heads * value_dim) // (2 * key_dim)
    kd = key_heads * key_dim
    x = silu(mixed_qkv.astype(np.float64))
    y = np.zeros((mixed_qkv.shape[0], value_heads * value_dim))
    for seq in range(len(past_lengths)):
        slot = int(state_slots[seq])
        states = recurrent_state[slot, state_layer].astype(np.float64)
        if past_lengths[seq] == 0:
            states[:] = 0.0
        for t in range(int(query_start_loc[seq]), int(query_start_loc[seq + 1])):
            q = x[t, :kd].reshape(key_heads, key_dim)
            k = x[t, kd:2 * kd].reshape(key_heads, key_dim)
            v = x[t, 2 * kd:].reshape(value_heads, value_dim)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + L2_EPSILON) / np.sqrt(key_dim)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + L2_EPSILON)
            beta = 1.0 / (1.0 + np.exp(-b[t].astype(np.float64)))
            g = decay.astype(np.float64) * softplus(a[t].astype(np.float64) + dt_bias)
            for h in range(value_heads):
                kh = h % key_heads if tiled else h // (value_heads // key_heads)
                s = states[h] * np.exp(g[h])
                delta = (v[h] - k[kh] @ s) * beta[h]
                s = s + np.outer(k[kh], delta)
                states[h] = s
                o = q[kh] @ s
                normed = o / np.sqrt((o * o).mean() + epsilon) * norm_weight
                y[t, h * value_dim:(h + 1) * value_dim] = normed * silu(z[t, h * value_dim:(h + 1) * value_dim])
            keep_checkpoint(recurrent_state, state_checkpoints, seq, t - int(query_start_loc[seq]), state_layer, states)
        recurrent_state[slot, state_layer] = states
    return y.astype(np.float32)
