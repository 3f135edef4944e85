"""The engine an engine directory's target names (cpu: ONNX Runtime, a session or one per tensor-parallel rank; cuda:
the plan's Triton kernels; tensorrt), its KV pool sized from the serving options, and room for its recurrent states'
snapshots and draft checkpoints."""

from __future__ import annotations

from typing import Any

from trtbuild.builder.engine_dir import EngineInfo
from trtbuild.configs import batch_blocks_needed
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.memory import gpu_memory_for_kv, kv_cache_blocks
from trtbuild.runtime.recurrent_state import allocate_snapshots
from trtbuild.runtime.tensor_parallel import make_cpu_engine


def make_engine(info: EngineInfo, target: str, config: RuntimeConfig) -> tuple[Any, int, int]:
    """The engine (CpuEngine, TensorParallelEngine, CudaEngine or TensorRTEngine), its KV pool's block count and the
    recurrent states it keeps for prefix reuse (0: none, or a model without recurrent layers), for a config
    `resolve`d against the engine's build."""
    build = info.build
    device = gpu_memory_for_kv(info.weight_bytes) if target != "cpu" and config.kv_cache_blocks is None else None
    full_batch = batch_blocks_needed([g.window for g in info.kv_cache_groups], build.tokens_per_block,
                                     config.max_batch_size, build.max_seq_len, config.max_num_tokens)
    num_blocks = kv_cache_blocks(info.kv_cache_bytes_per_block, build, config.kv_cache_memory,
                                 config.kv_cache_blocks, available=device, batch_blocks=full_batch)
    if target == "cuda":
        from trtbuild.runtime.cuda_engine import CudaEngine

        engine = CudaEngine(info, num_threads=config.num_threads, num_blocks=num_blocks)
    elif target == "tensorrt":
        from trtbuild.builder.tensorrt.plan import max_pool_blocks
        from trtbuild.runtime.tensorrt_engine import TensorRTEngine

        num_blocks = min(num_blocks, max_pool_blocks(build))  # NOTE: a profile bounds the pool's block count
        engine = TensorRTEngine(info, num_threads=config.num_threads, num_blocks=num_blocks)
    else:
        engine = make_cpu_engine(info, config.num_threads, num_blocks, config.rank_cpus)
    snapshots = 0
    if info.model.recurrent_layers:
        gpu = gpu_memory_for_kv(0) if target == "cuda" else None  # NOTE: None without a GPU: host memory
        snapshots = allocate_snapshots(engine, info.model, build.max_batch_size, config.max_state_snapshots,
                                       gpu[0] if gpu else None, draft_checkpoints=config.speculative is not None)
    return engine, num_blocks, snapshots
