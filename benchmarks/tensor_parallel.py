"""Engine steps of a tensor-parallel engine against the single-rank engine of the same model, with the same threads
in all: one prompt step, then batch-1 decode steps, the engines alternated over rounds, medians.

    python benchmarks/tensor_parallel.py --parallel <tp engine> --single <tp 1 engine> [--threads 2] [--rounds 3]
        [--prompt 128] [--steps 40] [--cpus 0/1]

`--cpus 0/1` also times the parallel engine with its ranks pinned to those CPU sets (one per rank, "/"-separated,
each a Linux CPU list such as 0-3,8): what runtime/cpu_topology.py does by itself on a machine with a NUMA node per
rank. Ratios above 1 mean the parallel engine is faster. The engines' steps only: no scheduler, no sampling.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.cpu_topology import parse_cpu_list
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.tensor_parallel import TensorParallelEngine


def time_engine(engine, prompt_len: int, steps: int) -> tuple[float, float]:
    """(prompt step seconds, mean decode step seconds) of one sequence."""
    blocks = list(range(-(-(prompt_len + steps) // engine.info.build.tokens_per_block)))
    prompt = [(7 * i + 3) % 5000 + 1 for i in range(prompt_len)]
    start = time.perf_counter()
    engine.step([SequenceChunk(0, prompt, 0, 1, blocks)])
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
        engine.step([SequenceChunk(0, [5], prompt_len + i, 1, blocks)])
    return prefill, (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", type=Path, required=True)
    p.add_argument("--single", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cpus", help="the ranks' CPU sets, '/'-separated, for a pinned run too")
    args = p.parse_args()
    allowed = os.sched_getaffinity(0)
    pinned = [parse_cpu_list(c) for c in args.cpus.split("/")] if args.cpus else None
    blocks = -(-(args.prompt + args.steps) // read_engine_config(args.single).build.tokens_per_block)
    makers = {"single": lambda: CpuEngine(read_engine_config(args.single), num_threads=args.threads,
                                          num_blocks=blocks),
              "parallel": lambda: TensorParallelEngine(read_engine_config(args.parallel), num_threads=args.threads,
                                                       num_blocks=blocks)}
    if pinned:
        makers["parallel, pinned"] = lambda: TensorParallelEngine(
            read_engine_config(args.parallel), num_threads=args.threads, num_blocks=blocks, cpu_sets=pinned)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in makers}
    for _ in range(args.rounds):
        for name, make in makers.items():
            engine = make()
            try:
                times[name].append(time_engine(engine, args.prompt, args.steps))
            finally:
                if isinstance(engine, TensorParallelEngine):
                    engine.close()
                os.sched_setaffinity(0, allowed)  # NOTE: a pinned rank 0 pinned this thread
    base = [statistics.median(t[i] for t in times["single"]) for i in (0, 1)]
    print(f"{args.prompt}-token prompt step, then {args.steps} batch-1 decode steps; {args.threads} threads; "
          f"medians of {args.rounds} alternated rounds")
    for name, rounds in times.items():
        prefill, decode = (statistics.median(t[i] for t in rounds) for i in (0, 1))
        print(f"  {name:18s} prompt {prefill * 1e3:8.1f} ms ({base[0] / prefill:.2f}x)   decode "
              f"{decode * 1e3:7.2f} ms ({base[1] / decode:.2f}x)   rounds: "
              + ", ".join(f"{a * 1e3:.0f} / {b * 1e3:.2f}" for a, b in rounds))


if __name__ == "__main__":
    main()
