"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured at warm-up, replayed with the step's inputs
copied into its static buffers. A batch smaller than its bucket is padded with one-token sequences whose K/V go to
the pool's scratch block (runtime/cuda_engine.TorchKVPool) and whose logits rows are dropped.

NOTE: a decode step launches ~10 kernels per layer for a few microseconds of work each; replaying them as one graph
removes the CPU launch cost that otherwise bounds small-batch decode (as vLLM and TensorRT-LLM do). GPU only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trtbuild.runtime.cuda_engine import CudaEngine


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... below max_batch_size, then max_batch_size itself."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch_size]


def bucket_for(batch: int, max_batch_size: int) -> int:
    return next(size for size in batch_buckets(max_batch_size) if size >= batch)


class DecodeGraph:
    """The engine's forward pass of `batch` one-token sequences, captured once."""

    def __init__(self, engine: CudaEngine, batch: int) -> None:
        self.engine, self.batch = engine, batch
        # static inputs: `batch` padding rows (scratch block), overwritten by every replay
        self.inputs = engine.inputs([], pad_to=batch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # NOTE: warm-up off the capture: Triton compiles, the allocator settles
            for _ in range(2):
                engine.forward(self.inputs, max_query_len=1)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = engine.forward(self.inputs, max_query_len=1)["logits"]

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        for name, static in self.inputs.items():
            static.copy_(inputs[name], non_blocking=True)
        self.graph.replay()
        return self.logits
