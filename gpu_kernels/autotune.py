"""Autotuning of the CUDA target's kernel tactics on the GPU an engine is built for (`build --target cuda
--autotune fast|full`): paged attention's key tile and split-K at the engine's decode shape, the weight-only GEMM's
and the fused experts' tiles at a decode batch. Timed with triton.testing.do_bench; a JSON timing cache keyed by GPU,
stack and shape lets a rebuild skip what it measured. GPU only: without one the builder records the launchers'
defaults and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ATTENTION_CANDIDATES = [dict(block_m=16, block_n=n, num_splits=s) for n in (32, 64, 128) for s in (1, 2, 4, 8)]
GEMM_CANDIDATES = [dict(block_m=16, block_n=n, block_k=k) for n in (32, 64, 128) for k in (32, 64, 128)]
MOE_CANDIDATES = [dict(block_m=m, block_n=n, block_k=k) for m in (16, 32) for n in (32, 64, 128) for k in (32, 64)]


def _load_cache(path: Path | None) -> dict[str, dict[str, float]]:
    if path is None or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())


def _time(cache: dict, key: str, candidates: list[dict], run) -> tuple[dict, dict[str, float], str]:
    """(fastest candidate, {candidate: ms}, source), measuring only what `cache[key]` lacks."""
    from triton.testing import do_bench

    timings = dict(cache.get(key, {}))
    measured = False
    for c in candidates:
        name = json.dumps(c, sort_keys=True)
        if name not in timings:
            try:
                timings[name] = float(do_bench(lambda c=c: run(c), warmup=5, rep=20))
            except Exception as e:  # NOTE: a tile a GPU cannot hold (shared memory) is a candidate that lost
                timings[name] = float("inf")
                timings[name + " error"] = str(e)[:200]  # type: ignore[assignment]
            measured = True
    cache[key] = timings
    best = min((n for n in timings if not n.endswith(" error")), key=timings.get)
    return json.loads(best), timings, "measured" if measured else "timing cache"


def tune_cuda(config, build, fingerprint: dict[str, Any], timing_cache: Path | None,
              kernels: dict) -> dict[str, Any]:
    """{"paged_attention": {...}, "weight_only_gemm": {...}, "fused_moe": {...}} (those the model has), each
    {"chosen", "source", "timings_ms"}."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[build.dtype]
    cache = _load_cache(timing_cache)
    stack = "|".join(str(fingerprint.get(f)) for f in ("device", "cuda_version", "torch_version", "triton_version"))
    dev = torch.device("cuda")
    batch = min(build.max_batch_size, 16 if build.autotune == "fast" else build.max_batch_size)
    context = min(build.max_seq_len - 1, 1024 if build.autotune == "fast" else build.max_seq_len - 1)
    heads, kv_heads, d, bs = (config.num_attention_heads, config.num_key_value_heads, config.head_size,
                              build.tokens_per_block)
    blocks_per_seq = -(-context // bs)
    pool = torch.randn(batch * blocks_per_seq, 1, 2, kv_heads, bs, d, dtype=dtype, device=dev)
    tables = torch.arange(batch * blocks_per_seq, device=dev).reshape(batch, blocks_per_seq)
    past = torch.full((batch,), context, device=dev)
    qsl = torch.arange(batch + 1, device=dev)
    q = torch.randn(batch, heads * d, dtype=dtype, device=dev)
    k = v = torch.randn(batch, kv_heads * d, dtype=dtype, device=dev)

    def attention(c: dict) -> None:
        kernels["paged_attention"].paged_attention(
            q, k, v, pool, tables, past, qsl, layer_idx=0, num_heads=heads, num_kv_heads=kv_heads, head_size=d,
            scale=d**-0.5, max_query_len=1, **c)

    key = f"{stack}|attention|{build.dtype}|b{batch}|ctx{context}|h{heads}/{kv_heads}x{d}|bs{bs}"
    best, timings, source = _time(cache, key, ATTENTION_CANDIDATES, attention)
    out = {"paged_attention": {"chosen": best, "source": source, "timings_ms": timings, "shape": key}}
    if config.quantization.quant_algo == "weight_only":
        x = torch.randn(batch, config.hidden_size, dtype=dtype, device=dev)
        codes = torch.randint(0, 256, (config.intermediate_size, config.hidden_size // 2), dtype=torch.uint8,
                              device=dev)
        scales = torch.rand(config.intermediate_size, config.hidden_size // 32, device=dev)
        key = f"{stack}|weight_only_gemm|{build.dtype}|t{batch}|{config.hidden_size}x{config.intermediate_size}"
        best, timings, source = _time(cache, key, GEMM_CANDIDATES,
                                      lambda c: kernels["weight_only_gemm"].weight_only_gemm(x, codes, scales, **c))
        out["weight_only_gemm"] = {"chosen": best, "source": source, "timings_ms": timings, "shape": key}
    if config.is_moe:  # a decode batch's tokens through one layer's experts
        experts, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        x = torch.randn(batch, hidden, dtype=dtype, device=dev)
        logits = torch.randn(batch, experts, device=dev)
        gate_up = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=dev) * hidden**-0.5
        down = torch.randn(experts, hidden, inter, dtype=dtype, device=dev) * inter**-0.5
        k = config.num_experts_per_tok
        key = f"{stack}|fused_moe|{build.dtype}|t{batch}|e{experts}k{k}|{hidden}x{inter}"
        best, timings, source = _time(cache, key, MOE_CANDIDATES, lambda c: kernels["fused_moe"].fused_moe(
            x, logits, gate_up, down, k, True, **c))
        out["fused_moe"] = {"chosen": best, "source": source, "timings_ms": timings, "shape": key}
    if timing_cache is not None:
        Path(timing_cache).write_text(json.dumps(cache, indent=1) + "\n")
    return out
