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
from trtbuild.runtime.engine import CpuEngine, SequenceChunk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", type=Path)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=10)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    per_block = read_engine_config(args.engine).build.tokens_per_block
    blocks = -(-(args.prompt + args.decode) // per_block)
    engine = CpuEngine(args.engine, num_threads=args.threads, num_blocks=blocks)
    table = list(range(blocks))
    prompt = [(7 * i + 3) % 1000 + 5 for i in range(args.prompt)]
    prefill, decode = [], []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        engine.step([SequenceChunk(0, prompt, 0, 1, table)])
        if repeat:
            prefill.append(time.perf_counter() - start)
        for s in range(args.decode):
            start = time.perf_counter()
            engine.step([SequenceChunk(0, [11 + s], args.prompt + s, 1, table)])
            if repeat:
                decode.append(time.perf_counter() - start)
    print(f"{args.engine}: prefill {args.prompt} tokens {statistics.median(prefill) * 1e3:.1f} ms, "
          f"batch-1 decode {statistics.median(decode) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
