"""The paged KV pool's storage (runtime/kv_cache.py): layout, sizes, dtypes, slots, in-place writes, residency."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import F16C
from kv_helpers import BLOCK, HEAD, KV_HEADS, LAYERS, changed_slots, slot_kv

from trtbuild.configs import BuildConfig, ModelConfig, QuantConfig
from trtbuild.quantization import FP8_E4M3_MAX, INT8_MAX, fp8_e4m3_values, kv_pool_dtype, kv_pool_elem_type
from trtbuild.runtime.kv_cache import KVCacheStorage, dequantize_kv, quantize_kv


def make_storage(num_blocks: int) -> KVCacheStorage:
    return KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, num_blocks)


# --- storage ------------------------------------------------------------------------------------------------------


def test_storage_shape_and_sizes():
    storage = make_storage(8)
    assert storage.pool.shape == (8, LAYERS, 2, KV_HEADS, BLOCK, HEAD) and storage.pool.dtype == np.float32
    assert (storage.num_blocks, storage.tokens_per_block) == (8, BLOCK)
    assert storage.bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD * 4 == slot_kv(storage.pool, 0, 0).nbytes
    assert storage.bytes_per_block == BLOCK * storage.bytes_per_token
    assert storage.pool.nbytes == storage.num_blocks * storage.bytes_per_block
    assert not storage.pool.any()
    assert KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 3, dtype=np.float16).bytes_per_token == \
        LAYERS * 2 * KV_HEADS * HEAD * 2


@pytest.mark.parametrize(("kv_quant", "pool", "dtype", "elem_type"), [
    (None, "float32", np.float32, onnx.TensorProto.FLOAT), (None, "float16", np.float16, onnx.TensorProto.FLOAT16),
    ("int8", "float32", np.int8, onnx.TensorProto.INT8), ("fp8", "float32", np.uint8, onnx.TensorProto.UINT8),
])
def test_kv_pool_dtype_is_what_the_runtime_stores(kv_quant, pool, dtype, elem_type):
    """kv_pool_dtype (shared by the engine's kv_cache input and the runtime's pool): the build's dtype, or the 1-byte
    type quantize_kv writes (fp8 as uint8 bit patterns); a pool of another type is refused."""
    model = ModelConfig("LlamaForCausalLM", "llama", "float32", 64, 16, 32, LAYERS, 2, KV_HEADS, HEAD, 1e-5, 64,
                        quantization=QuantConfig(kv_cache_quant_algo=kv_quant))
    assert kv_pool_dtype(model, BuildConfig(kv_pool_dtype=pool)) == np.dtype(dtype)
    assert kv_pool_elem_type(model, BuildConfig(kv_pool_dtype=pool)) == elem_type
    if kv_quant:
        scales = np.ones((LAYERS, 2), dtype=np.float32)
        stored = quantize_kv(np.array([1000.0, -1.5, 0.25], dtype=np.float32), 1.0, kv_quant)
        assert stored.dtype == np.dtype(dtype)
        assert dequantize_kv(stored, 1.0, kv_quant)[0] == {"int8": 127, "fp8": 448}[kv_quant]  # saturated
        assert fp8_e4m3_values().max() == FP8_E4M3_MAX == 448 and INT8_MAX == 127
        KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 2, dtype=dtype, quant_algo=kv_quant, scales=scales)
        with pytest.raises(ValueError, match=f"a {kv_quant} KV cache is stored as"):
            KVCacheStorage(LAYERS, KV_HEADS, HEAD, BLOCK, 2, dtype=np.float32, quant_algo=kv_quant, scales=scales)


def test_slots_map_positions_through_the_block_table():
    storage = make_storage(8)
    table = [5, 2, 7]
    np.testing.assert_array_equal(storage.slots(table, 0, 10), [20, 21, 22, 23, 8, 9, 10, 11, 28, 29])
    np.testing.assert_array_equal(storage.slots(table, 3, 6), [23, 8, 9])
    np.testing.assert_array_equal(storage.slots(tuple(table), 11, 12), [31])
    assert storage.slots(table, 4, 4).size == 0


def test_write_touches_exactly_the_given_slots():
    storage = make_storage(8)
    rng = np.random.default_rng(1)
    storage.pool[...] = rng.standard_normal(storage.pool.shape)
    pool, data = storage.pool, storage.pool.__array_interface__["data"][0]
    before = pool.copy()
    slots = np.array([23, 8, 9, 28, 0])
    new_kv = rng.standard_normal((LAYERS, 2, len(slots), KV_HEADS, HEAD)).astype(np.float32)
    storage.write(new_kv, [slots])
    assert storage.pool is pool and storage.pool.__array_interface__["data"][0] == data  # in place
    expected = before.copy()
    for t, s in enumerate(slots):
        slot_kv(expected, s // BLOCK, s % BLOCK)[...] = new_kv[:, :, t]
    np.testing.assert_array_equal(storage.pool, expected)
    assert changed_slots(storage.pool, before) == sorted(slots.tolist())


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]  # "always [madvise] never" -> madvise
    except (OSError, IndexError):
        return "unavailable"


def test_pool_is_backed_by_huge_pages_where_the_kernel_offers_them():
    """A pool's first writes fault in 2 MiB pages, not 4 KiB ones, and only what is written becomes resident: the
    pool is block-major, so 16 consecutive blocks (32 KiB each here) lie in one or two huge pages. Small pools are
    left alone."""
    if (mode := _transparent_huge_pages()) not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode} on this machine")
    assert not make_storage(8).huge_pages  # far below one huge page
    storage = KVCacheStorage(LAYERS, KV_HEADS, 64, 16, 4096)  # 32 KiB blocks, 128 MiB in all
    assert storage.huge_pages
    tokens = 16 * 16  # blocks 2000..2015
    storage.write(np.ones((LAYERS, 2, tokens, KV_HEADS, 64), np.float32), [np.arange(tokens) + 16 * 2000])

    start, end = storage.pool.ctypes.data, storage.pool.ctypes.data + storage.pool.nbytes
    huge_kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                huge_kb += int(line.split()[1])
    rss_kb = storage.resident_bytes // 1024
    if huge_kb == 0:  # madvise was taken (asserted above), but the kernel may find no free 2 MiB page to give
        pytest.skip("the kernel backed the advised pool with 4 KiB pages (no free huge page, or defrag off)")
    assert huge_kb >= 2048  # the 512 KiB written sit in huge pages
    assert rss_kb <= 2 * 2048 + 4096  # and not the rest of the 128 MiB


def test_reserve_makes_the_whole_pool_resident_and_keeps_it_zero():
    """reserve() faults every page in (as a GPU engine allocates its whole pool at start): the pool's resident bytes
    go from what was written to all of it, and every value is still zero."""
    storage = KVCacheStorage(LAYERS, KV_HEADS, 64, 16, 2048)  # 64 MiB: above glibc's largest mmap threshold
    before = storage.resident_bytes
    storage.reserve()
    if storage.resident_bytes == 0:
        pytest.skip("this system does not say which pages are resident (mincore)")
    assert before < storage.pool.nbytes // 4
    assert storage.resident_bytes >= storage.pool.nbytes - 4096
    assert not storage.pool.any()


@pytest.mark.parametrize(("dtype", "quant", "head", "target", "want"), [
    ("float32", QuantConfig(), 64, "cpu", "float32"),  # float32 weights: an exact KV cache too
    ("bfloat16", QuantConfig(), 64, "cpu", "float16"),
    ("float16", QuantConfig(), 64, "cpu", "float16"),
    ("float32", QuantConfig(quant_algo="weight_only", group_size=32), 64, "cpu", "float16"),  # a quantized GGUF
    ("float32", QuantConfig(quant_algo="fp8", kv_cache_quant_algo="fp8"), 64, "cpu", "float32"),  # its own pool
    ("bfloat16", QuantConfig(), 8, "cpu", "float16"),  # head size 8: the generic path reads float16 (F16C)
    ("bfloat16", QuantConfig(), 64, "cuda", "float32"),  # the GPU targets' pool has the compute dtype
])
def test_the_default_pool_is_float16_where_weights_are_16_bit_or_quantized(dtype, quant, head, target, want):
    """As llama.cpp's default KV cache and vLLM's for a 16-bit model; recorded in the build config, so an engine
    says what it holds, and `--kv-pool-dtype` overrides it."""
    from trtbuild.builder.build import default_build_config

    heads = 4
    model = ModelConfig("LlamaForCausalLM", "llama", dtype, heads * head, 16, 32, LAYERS, heads, 2, head, 1e-5, 64,
                        quantization=quant)
    if target == "cpu" and want == "float16" and not F16C:  # the native op widens a float16 pool with F16C
        want = "float32"
    assert default_build_config(model, target=target).kv_pool_dtype == want
    assert default_build_config(model, target=target, kv_pool_dtype="float32").kv_pool_dtype == "float32"
