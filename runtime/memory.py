"""Sizing the KV block pool from a memory budget."""

from __future__ import annotations

from pathlib import Path

from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError, TrtbuildError

DEFAULT_FRACTION = 0.1  # of available memory, when no budget is given


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can give without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise TrtbuildError("cannot read MemAvailable from /proc/meminfo, so memory fractions and checks are unavailable "
                        "on this system; give the KV cache size in bytes")


def require_memory(needed: int, what: str, fix: str) -> None:
    """Refuse up front, with the numbers, what would not fit in memory (rather than be killed halfway)."""
    available = available_memory_bytes()
    if needed > available:
        raise TrtbuildError(f"{what} needs about {needed / 2**30:.2f} GiB of memory but {available / 2**30:.2f} GiB "
                            f"is available (MemAvailable); {fix}")


def gpu_memory_for_kv(weight_bytes: int) -> tuple[int, str] | None:
    """Free GPU memory less the weights an engine is about to load, as kv_cache_blocks' `available`; None without a
    GPU (the interpreted cuda plan keeps its pool in host memory)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return max(free - weight_bytes, 0), "GPU memory free beside the engine's weights"


def kv_cache_blocks(bytes_per_block: int, build: BuildConfig, memory: float | None = None,
                    blocks: int | None = None, available: tuple[int, str] | None = None,
                    batch_blocks: int | None = None) -> int:
    """Number of KV blocks: `blocks` if given, else `memory` bytes (> 1) or that fraction of available memory.
    `available`: (bytes, what they are) of the memory the pool lives in [None: host memory, MemAvailable].

    With no budget at all, the pool is the smaller of DEFAULT_FRACTION of available memory and what a full batch of
    full-length sequences needs (`batch_blocks` [None: max_blocks_per_seq each]), plus as much again for prefix
    reuse.
    """
    if blocks is not None:  # NOTE: RuntimeConfig checked blocks >= 1 and memory > 0
        return blocks
    free, where = available or (available_memory_bytes(), "memory available (MemAvailable)")
    if memory is not None:
        if memory > 1 and memory > free:
            raise ConfigError("kv_cache_memory", f"{int(memory)} bytes is more than the {free / 2**30:.2f} GiB "
                                                 f"of {where}; give less, or a fraction")
        n = int((memory if memory > 1 else memory * free) // bytes_per_block)
        if n < 1:
            raise ConfigError("kv_cache_memory", f"{memory:g} holds no KV block ({bytes_per_block} bytes each); "
                                                 "give more memory")
        return n
    full_batch = 2 * (batch_blocks or build.max_batch_size * build.max_blocks_per_seq)
    return max(1, min(int(DEFAULT_FRACTION * free // bytes_per_block), full_batch))
