"""The contract of `trtbuild::PagedAttention` (documented in plugins/README.md) and its numpy reference.

One node per layer. Tokens of all sequences are packed along T, sequence by sequence; sequence b owns query tokens
query_start_loc[b]:query_start_loc[b+1], which sit at positions past_lengths[b]... of that sequence. Each query
attends causally to the sequence's first past_lengths[b] tokens, read from the paged cache through its block table,
and to its own new tokens. The op never mutates the cache: it returns the new tokens' K (after RoPE) and V, and the
runtime writes them to their slots. So one step's KV write is O(new tokens), and the same node serves prefill
chunks, decode tokens and (later) draft tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "PagedAttention"
OPSET_VERSION = 1

# Input positions. The rope inputs are present only after the RoPE fusion pass (attribute rotary=1). `sinks`
# (gpt-oss's per-head attention sinks) is optional: absent, or an empty name, means none; with rotary=0 and sinks,
# inputs 7-9 are empty names.
INPUTS = ("q", "k", "v", "kv_cache", "block_tables", "past_lengths", "query_start_loc",
          "position_ids", "rope_cos", "rope_sin", "sinks")
OUTPUTS = ("attn_out", "k_new", "v_new")
Q, K, V, KV_CACHE, BLOCK_TABLES, PAST_LENGTHS, QUERY_START_LOC, POSITION_IDS, ROPE_COS, ROPE_SIN, SINKS = range(11)


def sinks_input(inputs: Sequence[str]) -> str:
    """The name of a node's `sinks` input (a node's input list), or "" when it has none."""
    return inputs[SINKS] if len(inputs) > SINKS else ""


def apply_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (the Hugging Face Llama convention) on x [T, heads, D]; cos/sin are [max_pos, D/2]."""
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def reference_paged_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_cache: np.ndarray, block_tables: np.ndarray,
    past_lengths: np.ndarray, query_start_loc: np.ndarray, *, layer_idx: int, num_heads: int, num_kv_heads: int,
    head_size: int, scale: float, position_ids: np.ndarray | None = None, rope_cos: np.ndarray | None = None,
    rope_sin: np.ndarray | None = None, window: int = 0, softcap: float = 0.0, sinks: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Straightforward per-sequence loop; the lowered graphs and kernels are tested against it. `window` > 0: each
    query sees only its last `window` keys, itself included (a sliding window, as Mistral's and Phi-3's).
    `softcap` > 0: each score becomes softcap * tanh(score / softcap) before softmax (Gemma 2's logit soft-capping).
    `sinks` [num_heads]: gpt-oss's attention sinks, one logit per query head that joins the softmax's denominator
    without a value (not soft-capped, never windowed out), so a query's weights sum to less than 1."""
    num_tokens = q.shape[0]
    q = q.reshape(num_tokens, num_heads, head_size).astype(np.float64)
    k = k.reshape(num_tokens, num_kv_heads, head_size).astype(np.float64)
    v = v.reshape(num_tokens, num_kv_heads, head_size).astype(np.float64)
    if position_ids is not None:
        q, k = apply_rope(q, position_ids, rope_cos, rope_sin), apply_rope(k, position_ids, rope_cos, rope_sin)
    block_size = kv_cache.shape[4]  # kv_cache: [blocks, layers, 2, kv_heads, tokens_per_block, head_size]
    group = num_heads // num_kv_heads
    # a float16 pool: the new tokens' keys and values are attended as the pool will hold them
    stored = (lambda x: x.astype(np.float16).astype(np.float64)) if kv_cache.dtype == np.float16 else (lambda x: x)
    k_stored, v_stored = stored(k), stored(v)
    out = np.zeros_like(q)
    for b in range(len(past_lengths)):
        start, end, past = query_start_loc[b], query_start_loc[b + 1], past_lengths[b]
        slots = [block_tables[b, j // block_size] * block_size + j % block_size for j in range(past)]
        # kv_cache[:, layer] [block, K|V, head, offset, d] -> [K|V, slot = block * block_size + offset, head, d]
        flat = kv_cache[:, layer_idx].transpose(1, 0, 3, 2, 4).reshape(2, -1, num_kv_heads, head_size)
        keys = np.concatenate([flat[0][slots], k_stored[start:end]]) if past else k_stored[start:end]
        values = np.concatenate([flat[1][slots], v_stored[start:end]]) if past else v_stored[start:end]
        for t in range(end - start):
            visible = past + t + 1
            first = max(0, visible - window) if window else 0
            for h in range(num_heads):
                scores = keys[first:visible, h // group] @ q[start + t, h] * scale
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores.max() if sinks is None else max(scores.max(), float(sinks[h]))
                p = np.exp(scores - top)
                total = p.sum() if sinks is None else p.sum() + np.exp(float(sinks[h]) - top)
                out[start + t, h] = (p / total) @ values[first:visible, h // group]
    return out.reshape(num_tokens, -1).astype(np.float32), k.astype(np.float32), v.astype(np.float32)
