"""Run in a fresh interpreter by tests/test_tensorrt_target.py: the TensorRT plugins' Triton kernels
(plugins/tensorrt/kernels.py), launched as the plugins' aot_impl describes them (TensorRT's argument order, the same
constexprs and grid), in Triton's interpreter on CPU tensors, against reference_paged_attention. Prints the largest
error per case. A separate process because triton.jit reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trtbuild.gpu_kernels.load import patch_interpreter_for_numpy  # noqa: E402
from trtbuild.plugins.paged_attention import reference_paged_attention  # noqa: E402
from trtbuild.plugins.tensorrt import kernels as K  # noqa: E402
from trtbuild.plugins.tensorrt.paged_attention import TACTICS  # noqa: E402


def case(rotary: bool, tactic: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    heads, kv_heads, d, bs, layers, w, nb = 4, 2, 16, 4, 2, 4, 9
    past = np.array([5, 0, 8], dtype=np.int64)
    new = np.array([3, 4, 1], dtype=np.int64)  # a continuing chunk, a fresh prefill, a decode token
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    t = int(qsl[-1])
    tables = np.stack([rng.permutation(nb)[:w] for _ in past]).astype(np.int64)  # shuffled, garbage elsewhere
    pool = rng.standard_normal((nb, layers, 2, kv_heads, bs, d)).astype(np.float32)
    q = rng.standard_normal((t, heads * d)).astype(np.float32)
    k = rng.standard_normal((t, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((t, kv_heads * d)).astype(np.float32)
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(past, new, strict=True)]).astype(np.int64)
    ang = np.arange(32)[:, None] * (10000.0 ** (-np.arange(d // 2) / (d // 2)))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    rope = dict(position_ids=pos, rope_cos=cos, rope_sin=sin) if rotary else {}
    want, want_k, _ = reference_paged_attention(q, k, v, pool, tables, past, qsl, layer_idx=1, num_heads=heads,
                                                num_kv_heads=kv_heads, head_size=d, scale=d ** -0.5, **rope)
    T = torch.from_numpy  # noqa: N806
    shape = K.AttentionShape(1, heads, kv_heads, d, bs, w, layers, d ** -0.5, rotary)
    block_m, block_n = TACTICS[tactic]
    c = K.attention_constexprs(shape, block_m, block_n)
    out = torch.empty((t, heads * d), dtype=torch.float32)
    k_new = T(k).reshape(t, kv_heads, d)
    err_k = 0.0
    if rotary:
        k_new = torch.empty((t, kv_heads, d), dtype=torch.float32)
        K.trt_rotary_k[(t,)](T(k), T(pos), T(cos), T(sin), t, k_new, **K.rotary_k_constexprs(kv_heads, d))
        err_k = float(np.abs(k_new.numpy() - want_k).max())
    grid = (len(past), -(-t // c["BLOCK_Q"]), kv_heads)  # as _aot's KernelLaunchParams
    if rotary:
        K.trt_paged_attention_rotary[grid](T(q), k_new, T(v), T(pool), T(tables), T(past), T(qsl), T(pos), T(cos),
                                           T(sin), t, out, **c)
    else:
        K.trt_paged_attention[grid](T(q), k_new, T(v), T(pool), T(tables), T(past), T(qsl), t, out, **c)
    return max(float(np.abs(out.numpy() - want).max()), err_k)


if __name__ == "__main__":
    patch_interpreter_for_numpy()
    for rotary in (True, False):
        for tactic in (1, 2):
            print(f"rotary={int(rotary)} tactic={tactic} max_err={case(rotary, tactic, seed=tactic):.3g}")
