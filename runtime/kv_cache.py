"""The paged KV pool's storage: one array of fixed-size blocks, K and V, with O(new tokens) writes. A block holds
every layer's K/V of its positions, or one KV cache group's layers (configs/kv_groups.py).

Which blocks a sequence owns is decided elsewhere (kv_cache_manager.py); this class only holds the numbers.

A quantized pool (checkpoint `kv_cache_quant_algo` int8 or fp8) holds 1 byte per value: int8 values, or the bit
patterns of float8 e4m3fn stored as uint8 (ONNX Runtime's CPU Gather takes no float8 tensors). `write` quantizes
the step's new K/V with the per-layer (K scale, V scale); the engine dequantizes only the rows it gathers.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

from trtbuild.configs import KVCacheGroup, slots_per_block
from trtbuild.quantization import FP8_E4M3_MAX, INT8_MAX, KVCacheQuantAlgo, fp8_e4m3_values

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(array: np.ndarray) -> bool:
    """Ask Linux to back `array` with transparent huge pages (madvise MADV_HUGEPAGE); True when the kernel took it.

    NOTE: the pool stays lazily mapped, so each new block's first write faults its pages in: a SmolLM2 fp32 block of
    16 tokens is 720 KiB (180 faults of 4 KiB), and a 2048-token prefill writes 128 of them at once. With 2 MiB pages
    one fault covers almost 3 blocks. Resident memory still grows only with what is written (in 2 MiB steps).
    Elsewhere, or where transparent huge pages are off, this does nothing and the pool works the same."""
    if not sys.platform.startswith("linux") or array.nbytes < 2 * HUGE_PAGE:
        return False
    start = -(-array.ctypes.data // HUGE_PAGE) * HUGE_PAGE  # the huge-page-aligned part of the buffer
    end = (array.ctypes.data + array.nbytes) // HUGE_PAGE * HUGE_PAGE
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(start, end - start, _MADV_HUGEPAGE) == 0


def quantize_kv(x: np.ndarray, scale: np.ndarray | float, algo: str) -> np.ndarray:
    """Stored value of x: int8 round(x / scale) (half to even) clipped to [-127, 127], or the uint8 bit pattern of
    float8 e4m3fn(x / scale), saturated to +-448. `scale` broadcasts against x."""
    y = np.asarray(x, dtype=np.float32) / np.asarray(scale, dtype=np.float32)
    if algo == KVCacheQuantAlgo.INT8:
        return np.clip(np.rint(y), -INT8_MAX, INT8_MAX).astype(np.int8)
    if algo == KVCacheQuantAlgo.FP8:
        import ml_dtypes

        return np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    raise ValueError(f"unknown KV cache quantization {algo!r}; int8 and fp8 are supported")


def dequantize_kv(q: np.ndarray, scale: np.ndarray | float, algo: str) -> np.ndarray:
    """The float32 value a stored K/V element stands for (the engine's in-graph dequantization, in numpy)."""
    values = q.astype(np.float32) if algo == KVCacheQuantAlgo.INT8 else fp8_e4m3_values()[q]
    return values * np.asarray(scale, dtype=np.float32)


class KVCacheStorage:
    """pool[block, slot, 0 | 1 (K | V), kv_head, offset in block, :] (see builder/network.py: kv_cache_shape); the
    layer in a slot is that of the group the block belongs to."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, tokens_per_block: int, num_blocks: int,
                 dtype: np.dtype = np.float32, quant_algo: str | None = None,
                 scales: np.ndarray | None = None, groups: tuple[KVCacheGroup, ...] | None = None) -> None:
        """`dtype` is the pool's element type (`trtbuild.quantization.kv_pool_dtype`); `quant_algo` int8 | fp8 stores
        1-byte values (int8, or uint8 fp8 bit patterns) with `scales` [num_layers, 2] (K, V scale per layer).
        `groups`: the engine's KV cache groups [None: one group of every layer]."""
        self.groups = groups or (KVCacheGroup(tuple(range(num_layers)), None),)
        self.shape = (num_blocks, slots_per_block(self.groups), 2, num_kv_heads, tokens_per_block, head_size)
        self.quant_algo = quant_algo
        self.dtype = np.dtype(dtype)
        self.scales = None
        if quant_algo:
            stored = quantize_kv(np.zeros(1, dtype=np.float32), 1.0, quant_algo).dtype
            if self.dtype != stored:
                raise ValueError(f"a {quant_algo} KV cache is stored as {stored}, not {self.dtype}")
            if scales is None or np.shape(scales) != (num_layers, 2):
                raise ValueError(f"a {quant_algo} KV cache needs scales of shape ({num_layers}, 2), got "
                                 f"{None if scales is None else np.shape(scales)}")
            self.scales = np.asarray(scales, dtype=np.float32).reshape(num_layers, 2, 1, 1, 1)
        # NOTE: np.zeros maps untouched pages lazily, so resident memory follows the blocks actually written.
        self.pool = np.zeros(self.shape, dtype=self.dtype)
        self.huge_pages = advise_huge_pages(self.pool)

    def reserve(self) -> None:
        """Fault every page of the pool in now (one write per memory page; the values stay zero), so that no step
        waits later for memory on a block's first write. NOTE: as GPU engines allocate their whole KV pool at start.
        On a VM a never-touched page is backed by the host on first write: ~1.7 s per GiB here, which otherwise
        stalled a 128-token batch-16 run 8 times for ~28 ms each (16 new blocks at once)."""
        self.pool.reshape(-1).view(np.uint8)[::mmap.PAGESIZE] = 0

    @property
    def resident_bytes(self) -> int:
        """Bytes of the pool backed by memory now (Linux mincore of the pool's own pages; 0 where unavailable)."""
        page = mmap.PAGESIZE
        start = self.pool.ctypes.data // page * page
        length = self.pool.ctypes.data + self.pool.nbytes - start
        pages = np.zeros(-(-length // page), dtype=np.uint8)
        try:
            mincore = ctypes.CDLL(None, use_errno=True).mincore
        except (OSError, AttributeError):
            return 0
        mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        if mincore(start, length, pages.ctypes.data) != 0:
            return 0
        return int(np.count_nonzero(pages & 1)) * page

    @property
    def num_blocks(self) -> int:
        return self.shape[0]

    @property
    def tokens_per_block(self) -> int:
        return self.shape[4]

    @property
    def bytes_per_block(self) -> int:
        _, slots, _, heads, tokens, size = self.shape
        return slots * 2 * heads * tokens * size * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes a token holds while every group keeps it (within every window): one block slot per group."""
        return self.bytes_per_block * len(self.groups) // self.tokens_per_block

    def slots(self, block_ids: list[int] | tuple[int, ...], start: int, end: int) -> np.ndarray:
        """Flat slot ids (block * tokens_per_block + offset) of token positions start..end-1 of a sequence."""
        positions = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.tokens_per_block] * self.tokens_per_block + positions % self.tokens_per_block

    def write(self, new_kv: np.ndarray, slot_mappings: list[np.ndarray]) -> None:
        """Store a step's new K/V, new_kv [layers, 2, T, kv_heads, head], at their slots, one slot array per group
        (in the blocks of that group's table): O(T), no pool copy. A quantized pool stores quantize_kv(new_kv, layer
        scale)."""
        if self.quant_algo:
            new_kv = quantize_kv(new_kv, self.scales, self.quant_algo)
        block_size = self.tokens_per_block
        for group, slots in zip(self.groups, slot_mappings, strict=True):
            layers = new_kv if len(self.groups) == 1 else new_kv[list(group.layers)]
            # pool[block, :n, :, :, offset] is token t's [n group layers, 2, heads, head] (indexed in place)
            rows = layers.transpose(2, 0, 1, 3, 4)
            self.pool[slots // block_size, : len(group.layers), :, :, slots % block_size] = rows

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """pool[destination] = pool[source] for each pair (a beam's fork: KVCacheManager.fork)."""
        if pairs:
            source, destination = zip(*pairs, strict=True)
            self.pool[list(destination)] = self.pool[list(source)]

    def dequantized(self) -> np.ndarray:
        """The pool as float32 values (for tests and debugging; O(pool)). A quantized pool's scales are per layer, so
        only a one-group pool knows which scales a slot has."""
        if not self.quant_algo:
            return self.pool.astype(np.float32)
        if len(self.groups) > 1:
            raise ValueError("a quantized pool of several KV cache groups has no single scale per slot")
        return dequantize_kv(self.pool, self.scales[None], self.quant_algo)  # scales [1, layers, 2, 1, 1, 1]
