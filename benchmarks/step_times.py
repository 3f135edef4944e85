"""One engine's prefill and batch-1 decode step times through `CpuEngine.step`, for A/B runs: alternate two engines
(or two builds of the cpu_ops library, via PYTHONPATH) process by process, rounds apart, and compare medians.

    python benchmarks/step_times.py <engine dir> [--prompt 128] [--decode 10] [--repeats 6] [--threads 2]

Each repeat runs one `--prompt`-token prefill step, then `--decode` batch-1 decode steps after it; the first
repeat warms up and is left out. Prints the median ms of the prefill steps and of the decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", type=Path)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=10)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    info = read_engine_config(args.engine)
    blocks, groups = -(-(args.prompt + args.decode) // info.build.tokens_per_block), len(info.kv_cache_groups)
    engine = CpuEngine(info, num_threads=args.threads, num_blocks=groups * blocks)
    table = list(range(blocks))

    def step(tokens: list[int], start: int) -> None:
        engine.step(in_every_group([SequenceChunk(0, tokens, start, 1, table)], groups, blocks))

    prompt = [(7 * i + 3) % 1000 + 5 for i in range(args.prompt)]
    prefill, decode = [], []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        step(prompt, 0)
        if repeat:
            prefill.append(time.perf_counter() - start)
        for s in range(args.decode):
            start = time.perf_counter()
            step([11 + s], args.prompt + s)
            if repeat:
                decode.append(time.perf_counter() - start)
    print(f"{args.engine}: prefill {args.prompt} tokens {statistics.median(prefill) * 1e3:.1f} ms, "
          f"batch-1 decode {statistics.median(decode) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
