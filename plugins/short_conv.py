"""The contract of `trtbuild::PagedShortConv` (documented in plugins/README.md) and its numpy reference.

LFM2's short convolution layers mix each channel with its own last `L` values (a depthwise causal convolution of
kernel L, conv_L_cache, over the tokens of one sequence). Their state is the last L - 1 inputs of each sequence, and
trtbuild keeps it where it keeps K/V: each token's input row is stored in the paged KV pool, spread over `entries`
consecutive layer slots of the pool (a slot holds 2 x kv_heads x head_size values a token: the row is cut into that
many values per slot, in slot, K|V, head, value order, and zero-padded). So chunked prefill, prefix reuse,
preemption, beam forks and speculative rollback treat a convolution layer as a sliding-window layer of window L
(configs/kv_groups.py), and nothing else in the runtime changes.

One node per convolution layer. Tokens are packed as for PagedAttention: sequence b owns tokens
query_start_loc[b]:query_start_loc[b+1] at positions past_lengths[b]... The op never mutates the pool: it returns the
new tokens' rows as entries, and the runtime writes them with the layer's K/V.
"""

from __future__ import annotations

import numpy as np

from trtbuild.configs.kv_groups import entries_per_row

DOMAIN = "trtbuild"
OP_TYPE = "PagedShortConv"

# bias is optional (absent, or an empty name: none); LFM2's released models have none
INPUTS = ("x", "kv_cache", "block_tables", "past_lengths", "query_start_loc", "weight", "bias")
OUTPUTS = ("y", "new_entries")
X, KV_CACHE, BLOCK_TABLES, PAST_LENGTHS, QUERY_START_LOC, WEIGHT, BIAS = range(7)


def row_as_entries(x: np.ndarray, entries: int, kv_heads: int, head_size: int) -> np.ndarray:
    """x [T, H] -> [entries, 2, T, kv_heads, head_size]: each row zero-padded and cut into the slots' K|V halves."""
    tokens, hidden = x.shape
    padded = np.zeros((tokens, entries * 2 * kv_heads * head_size), dtype=np.float32)
    padded[:, :hidden] = x
    return padded.reshape(tokens, entries, 2, kv_heads, head_size).transpose(1, 2, 0, 3, 4)


def reference_short_conv(x: np.ndarray, kv_cache: np.ndarray, block_tables: np.ndarray, past_lengths: np.ndarray,
                         query_start_loc: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, *,
                         layer_idx: int) -> tuple[np.ndarray, np.ndarray]:
    """y [T, H] and new_entries [entries, 2, T, kv_heads, head_size], by a loop per sequence.

    y[t, c] = bias[c] + sum over i < L of weight[c, i] * u(p - L + 1 + i)[c], where p is token t's position in its
    sequence and u(q) that sequence's input row at position q: zero before position 0, a past token's row read from
    the pool (slots layer_idx .. layer_idx + entries - 1 of its block), else the new token's row, as a float16 pool
    will hold it when the pool is float16 (so that chunked and whole prefills give the same values)."""
    tokens, hidden = x.shape
    kernel = weight.shape[1]
    _, _, _, kv_heads, block_size, head_size = kv_cache.shape
    entries = entries_per_row(hidden, kv_heads, head_size)
    stored = x.astype(np.float16).astype(np.float64) if kv_cache.dtype == np.float16 else x.astype(np.float64)
    y = np.zeros((tokens, hidden), dtype=np.float64)
    for b in range(len(past_lengths)):
        start, end, past = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(past_lengths[b])

        def row(q: int, b: int = b, start: int = start, past: int = past) -> np.ndarray:
            if q < 0:
                return np.zeros(hidden)
            if q >= past:
                return stored[start + q - past]
            block = kv_cache[block_tables[b, q // block_size], layer_idx:layer_idx + entries, :, :, q % block_size]
            return block.astype(np.float64).reshape(-1)[:hidden]  # [entries, 2, kv_heads, head_size] in row order

        for t in range(start, end):
            p = past + t - start
            y[t] = sum(weight[:, i].astype(np.float64) * row(p - kernel + 1 + i) for i in range(kernel))
    if bias is not None:
        y += bias
    return y.astype(np.float32), row_as_entries(x.astype(np.float32), entries, kv_heads, head_size)
