"""Sizing the KV block pool from a memory budget."""

from __future__ import annotations

from pathlib import Path

from trtbuild.configs import BuildConfig
from trtbuild.errors import TrtbuildError

DEFAULT_FRACTION = 0.1  # of available memory, when no budget is given


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the kernel can give without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass --kv-cache-memory in bytes")


def require_memory(needed: int, what: str, fix: str) -> None:
    """Refuse up front, with the numbers, what would not fit in memory (rather than be killed halfway)."""
    available = available_memory_bytes()
    if needed > available:
        raise TrtbuildError(f"{what} needs about {needed / 2**30:.2f} GiB of memory but {available / 2**30:.2f} GiB "
                            f"is available (MemAvailable); {fix}")


def kv_cache_blocks(bytes_per_block: int, build: BuildConfig, memory: float | None = None,
                    blocks: int | None = None) -> int:
    """Number of KV blocks: `blocks` if given, else `memory` bytes (> 1) or that fraction of available memory.

    With no budget at all, the pool is the smaller of DEFAULT_FRACTION of available memory and what a full batch of
    full-length sequences needs, plus as much again for prefix reuse.
    """
    if blocks is not None:
        if blocks < 1:
            raise ValueError(f"kv_cache_blocks must be at least 1, got {blocks}")
        return blocks
    if memory is not None:
        if memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive (bytes, or a fraction of free memory), got {memory}")
        if memory > 1:
            require_memory(int(memory), f"a KV cache of {int(memory)} bytes", "give a smaller --kv-cache-memory.")
        budget = memory if memory > 1 else memory * available_memory_bytes()
        n = int(budget // bytes_per_block)
        if n < 1:
            raise ValueError(f"kv_cache_memory {memory:g} holds no KV block ({bytes_per_block} bytes each); "
                             "give more memory")
        return n
    full_batch = 2 * build.max_batch_size * build.max_blocks_per_seq
    return max(1, min(int(DEFAULT_FRACTION * available_memory_bytes() // bytes_per_block), full_batch))
