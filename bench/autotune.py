"""The autotuner's timer (builder/autotune.py: Timer): one candidate graph, run as the runtime runs engines."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from trtbuild.builder.autotune import ShapeClass
from trtbuild.builder.engine_dir import EngineInfo, cpu_fingerprint
from trtbuild.configs import BuildConfig, ModelConfig

WARM_UP_CALLS = 2
TIMED_CALLS = {"fast": 7, "full": 11}


def time_graph(graph: Path, model: ModelConfig, build: BuildConfig, threads: int,
               shapes: tuple[ShapeClass, ...]) -> dict[str, float]:
    """Median milliseconds of one engine call of each shape class, through CpuEngine (the runtime's session options
    and input packing), on an all-zero KV pool. Each class gets its own blocks, so a call reads what it would read
    in a real step: `context` cached tokens per sequence."""
    import onnx

    from trtbuild.builder.build import io_spec
    from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group

    io = io_spec(onnx.load(str(graph), load_external_data=False))
    info = EngineInfo(path=graph.parent, model=model, build=build, target=cpu_fingerprint(), io=io, passes=(),
                      trtbuild_version="tuning", weight_files={})
    per_seq = max(-(-(s.context + s.new_tokens) // build.tokens_per_block) for s in shapes)
    batch = max(s.batch for s in shapes)
    groups = len(info.kv_cache_groups)
    engine = CpuEngine(info, num_threads=threads, num_blocks=groups * batch * per_seq, graph=graph)
    timings = {}
    for shape in shapes:
        chunks = [SequenceChunk(i, [1] * shape.new_tokens, shape.context, 1,
                                list(range(i * per_seq, (i + 1) * per_seq))) for i in range(shape.batch)]
        chunks = in_every_group(chunks, groups, batch * per_seq)
        samples = []
        for n in range(WARM_UP_CALLS + TIMED_CALLS[build.autotune]):
            start = time.perf_counter()
            engine.step(chunks)
            if n >= WARM_UP_CALLS:
                samples.append((time.perf_counter() - start) * 1e3)
        timings[shape.name] = round(statistics.median(samples), 3)
    return timings
