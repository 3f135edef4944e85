"""Batch-1 decode step time of several engines, alternated: `CpuEngine.step` of one token after a 128-token
prompt, 30 steps a round, 7 rounds; prints each engine's median ms per step (engine call + KV write, no sampling).

    python benchmarks/decode_steps.py <engine dir> <engine dir> ... [--threads 2]

For A/B comparisons of graph changes (build the same checkpoint before and after); `trtbuild bench` measures the
whole request path instead.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group


def ms_per_step(engine: CpuEngine, steps: int = 30) -> float:
    blocks, groups = list(range(16)), len(engine.kv.groups)  # the pool: 16 blocks per KV cache group (main)
    engine.step(in_every_group([SequenceChunk(0, list(range(1, 129)), 0, 1, blocks)], groups, 16))
    start = time.perf_counter()
    for i in range(steps):
        engine.step(in_every_group([SequenceChunk(0, [5], 128 + i, 1, blocks)], groups, 16))
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    engines = {d: CpuEngine(info, num_threads=args.threads, num_blocks=max(64, 16 * len(info.kv_cache_groups)))
               for d, info in ((d, read_engine_config(d)) for d in args.engines)}
    times: dict[str, list[float]] = {d: [] for d in engines}
    order = list(engines)
    for r in range(args.rounds):  # each round starts with the next engine
        for d in order[r % len(order):] + order[: r % len(order)]:
            time.sleep(0.2)  # NOTE: the engine run before must not still spin its thread pool on our cores
            times[d].append(ms_per_step(engines[d]))
    for d, ts in times.items():
        print(f"{d}: median {statistics.median(ts):.2f} ms/step ({' '.join(f'{t:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()
