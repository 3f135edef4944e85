"""Where one decode step of a CPU engine goes, by ONNX Runtime op type: `batch` sequences with a `context`-token
prompt each, then `steps` decode steps of all of them, profiled by ONNX Runtime (`CpuEngine(profile_prefix=...)`).

    python benchmarks/step_profile.py <engine dir> [--batch 16] [--context 128] [--steps 6] [--threads 2] [--by-node]
        [--prefill]

`--prefill` profiles the prompt steps instead: each profiled step is the `context`-token prompts of all `batch`
sequences, written over the same blocks again.

Prints the wall time per step, the time inside session.run, and each op type's kernel time per step and node count
(`--by-node`: each node name's, with layer numbers replaced by `*`, so a layer's linears are told apart).
NOTE: the profiler adds a few microseconds per node; compare op types within one profile, not across engines.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time
from pathlib import Path

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", type=Path)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--by-node", action="store_true", help="group by node name (layer numbers as *), not op type")
    p.add_argument("--prefill", action="store_true", help="profile the prompt steps, not the decode steps")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        info = read_engine_config(args.engine)
        blocks = -(-(args.context + args.steps) // info.build.tokens_per_block)
        groups, per_group = len(info.kv_cache_groups), args.batch * blocks
        engine = CpuEngine(info, num_threads=args.threads, num_blocks=groups * per_group,
                           profile_prefix=str(Path(tmp) / "step"))
        tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(args.batch)]
        prompt = [(7 * i + 3) % 1000 + 5 for i in range(args.context)]
        for b in range(args.batch):
            engine.step(in_every_group([SequenceChunk(b, prompt, 0, 1, tables[b])], groups, per_group))
        start = time.perf_counter()
        for i in range(args.steps):
            if args.prefill:
                chunks = [SequenceChunk(b, prompt, 0, 1, tables[b]) for b in range(args.batch)]
            else:
                chunks = [SequenceChunk(b, [7], args.context + i, 1, tables[b]) for b in range(args.batch)]
            engine.step(in_every_group(chunks, groups, per_group))
        wall = (time.perf_counter() - start) / args.steps
        events = json.loads(Path(engine.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-args.steps:]
    first = runs[0]["ts"]
    kernel_us: collections.Counter[str] = collections.Counter()
    nodes: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= first and e["name"].endswith("_kernel_time"):
            key = re.sub(r"\d+", "*", e["name"].removesuffix("_kernel_time")) if args.by_node else e["args"]["op_name"]
            kernel_us[key] += e["dur"]
            nodes[key] += 1
    kind = "prompt steps" if args.prefill else "decode steps"
    print(f"{args.engine}: {kind}, batch {args.batch}, context {args.context}, {args.threads} threads")
    print(f"step {wall * 1e3:.1f} ms, in session.run {sum(r['dur'] for r in runs) / args.steps / 1e3:.1f} ms")
    for op, us in kernel_us.most_common():
        print(f"  {op:60s} {us / args.steps / 1e3:8.2f} ms  {nodes[op] // args.steps:4d} nodes")


if __name__ == "__main__":
    main()
