"""The measurements scripts/gpu_check.sh makes of a cuda engine: logits parity with the CPU engine, greedy text,
the paged-attention decode kernel's bandwidth against a device-to-device copy, and decode tokens per second.

`python -m trtbuild.bench.gpu_check parity|text|bandwidth|decode ...`; parity and text also run on CPU tensors in
Triton's interpreter (tests/test_cuda_target.py), bandwidth and decode need a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from trtbuild.runtime.engine import SequenceChunk

# a prefill of two sequences, a mixed prefill + decode step, then decode steps past the second block boundary of
# sequence 1 (with any block size)
PROMPTS = [list(range(100, 112)), list(range(200, 207))]


def parity_steps(tokens_per_block: int) -> tuple[list[list[SequenceChunk]], int]:
    """(the steps, the pool blocks they use)."""
    a, b = PROMPTS
    pos_a, pos_b = len(a), len(b) + 1
    decodes = 2 * tokens_per_block - pos_b % tokens_per_block + 1
    per_seq = -(-(pos_a + decodes) // tokens_per_block)
    blocks_a, blocks_b = list(range(per_seq)), list(range(per_seq, 2 * per_seq))
    steps = [[SequenceChunk(0, a[:8], 0, 1, blocks_a), SequenceChunk(1, b, 0, 1, blocks_b)],
             [SequenceChunk(0, a[8:], 8, 1, blocks_a), SequenceChunk(1, [5], len(b), 1, blocks_b)]]
    for i in range(decodes):
        steps.append([SequenceChunk(0, [7 + i], pos_a + i, 1, blocks_a),
                      SequenceChunk(1, [9 + i], pos_b + i, 1, blocks_b)])
    return steps, 2 * per_seq


def parity(cpu_engine: Path, cuda_engine: Path) -> float:
    """Largest |logits difference| between the two engines over parity_steps."""
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.runtime.cuda_engine import CudaEngine
    from trtbuild.runtime.engine import CpuEngine

    steps, blocks = parity_steps(read_engine_config(cpu_engine).build.tokens_per_block)
    cpu, cuda = CpuEngine(cpu_engine, num_blocks=blocks), CudaEngine(cuda_engine, num_blocks=blocks)
    worst = 0.0
    for chunks in steps:
        worst = max(worst, float(np.abs(cpu.step(chunks) - cuda.step(chunks)).max()))
    return worst


def greedy_text(engine: Path, prompt: str, max_tokens: int) -> str:
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    llm = LLM(engine, RuntimeConfig(kv_cache_blocks=64, warm_up=False))
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def attention_bandwidth(cuda_engine: Path, batch: int, context: int) -> dict[str, float]:
    """The decode attention kernel of one layer at `batch` x `context` tokens: bytes of K/V it must read over its
    time, as a fraction of a device-to-device copy's bandwidth (reading and writing the same bytes)."""
    from triton.testing import do_bench

    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.gpu_kernels.load import load_kernels

    info = read_engine_config(cuda_engine, expect_target="cuda")
    m, b = info.model, info.build
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[b.dtype]
    k = load_kernels(interpret=False)["paged_attention"]
    tactic = info.tactics.get("paged_attention", {}).get("chosen", {})
    per_seq = -(-context // b.tokens_per_block)
    dev = torch.device("cuda")
    pool = torch.randn(batch * per_seq, 1, 2, m.num_key_value_heads, b.tokens_per_block, m.head_size, dtype=dtype,
                       device=dev)
    tables = torch.randperm(batch * per_seq, device=dev).reshape(batch, per_seq)
    q = torch.randn(batch, m.num_attention_heads * m.head_size, dtype=dtype, device=dev)
    kv = torch.randn(batch, m.num_key_value_heads * m.head_size, dtype=dtype, device=dev)
    past, qsl = torch.full((batch,), context, device=dev), torch.arange(batch + 1, device=dev)
    ms = do_bench(lambda: k.paged_attention(
        q, kv, kv, pool, tables, past, qsl, layer_idx=0, num_heads=m.num_attention_heads,
        num_kv_heads=m.num_key_value_heads, head_size=m.head_size, scale=m.head_size**-0.5, max_query_len=1,
        **tactic))
    kv_bytes = batch * context * 2 * m.num_key_value_heads * m.head_size * pool.element_size()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    attention_gbs, copy_gbs = kv_bytes / ms / 1e6, 2 * kv_bytes / copy_ms / 1e6  # a copy reads and writes
    return {"attention_ms": ms, "attention_GBps": attention_gbs, "copy_GBps": copy_gbs,
            "fraction_of_copy": attention_gbs / copy_gbs}


def decode_tokens_per_second(cuda_engine: Path, batch: int, steps: int = 64, prompt_len: int = 32) -> float:
    """Steady decode of `batch` sequences (CUDA graphs): tokens per second over `steps` steps after a prefill."""
    from trtbuild.runtime.cuda_engine import CudaEngine

    engine = CudaEngine(cuda_engine, num_blocks=1)
    bs = engine.info.build.tokens_per_block
    per_seq = -(-(prompt_len + steps) // bs)
    engine.allocate_kv_cache(batch * per_seq)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    engine.step([SequenceChunk(i, [100 + i] * prompt_len, 0, 1, tables[i]) for i in range(batch)])
    engine.step([SequenceChunk(i, [7], prompt_len, 1, tables[i]) for i in range(batch)])  # captures the graph
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(1, steps):
        engine.step([SequenceChunk(i, [7], prompt_len + s, 1, tables[i]) for i in range(batch)])
    return batch * (steps - 1) / (time.perf_counter() - start)  # NOTE: each step copies its logits back (a sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("parity")
    p.add_argument("--cpu", type=Path, required=True)
    p.add_argument("--cuda", type=Path, required=True)
    p.add_argument("--atol", type=float, default=1e-3)
    t = sub.add_parser("text")
    t.add_argument("--engine", type=Path, action="append", required=True)
    t.add_argument("--prompt", default="The capital of France is")
    t.add_argument("--max-tokens", type=int, default=24)
    bw = sub.add_parser("bandwidth")
    bw.add_argument("--cuda", type=Path, required=True)
    bw.add_argument("--batch", type=int, default=16)
    bw.add_argument("--context", type=int, default=1024)
    d = sub.add_parser("decode")
    d.add_argument("--cuda", type=Path, required=True)
    d.add_argument("--batch", type=int, action="append", required=True)
    args = parser.parse_args()
    if args.what == "parity":
        worst = parity(args.cpu, args.cuda)
        print(json.dumps({"max_abs_logits_diff": worst, "atol": args.atol}))
        raise SystemExit(0 if worst <= args.atol else 1)
    if args.what == "text":
        texts = [greedy_text(e, args.prompt, args.max_tokens) for e in args.engine]
        for e, text in zip(args.engine, texts, strict=True):
            print(f"{e}: {text!r}")
        raise SystemExit(0 if len(set(texts)) == 1 else 1)
    if args.what == "bandwidth":
        print(json.dumps(attention_bandwidth(args.cuda, args.batch, args.context)))
    if args.what == "decode":
        print(json.dumps({f"batch {b}": round(decode_tokens_per_second(args.cuda, b), 1) for b in args.batch}))


if __name__ == "__main__":
    main()
