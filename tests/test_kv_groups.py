"""KV cache groups (configs/kv_groups.py): which layers share a block, the pool's storage of them, the hybrid block
manager's exact block ids, and engines whose I/O disagrees with their groups."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.configs import (
    BuildConfig,
    KVCacheGroup,
    ModelConfig,
    batch_blocks_needed,
    cache_layers,
    kv_cache_groups,
    layer_slot,
    max_blocks_held,
    num_cache_layers,
    slots_per_block,
)
from trtbuild.errors import EngineCompatibilityError
from trtbuild.runtime.kv_cache import KVCacheStorage
from trtbuild.runtime.kv_cache_manager import RELEASED, KVCacheManager
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams


def model(layers: int, window: int | None, full_every: int | None = None) -> ModelConfig:
    """A decoder of `layers` layers windowed at `window`: every layer, or all but every `full_every`-th."""
    types = () if full_every is None else tuple("full_attention" if (i + 1) % full_every == 0 else
                                                "sliding_attention" for i in range(layers))
    return ModelConfig("Gemma3ForCausalLM", "gemma3", "float32", 64, 16, 32, layers, 2, 1, 32, 1e-6, 4096,
                       sliding_window=window, layer_types=types)


def lfm2(hidden: int, heads: int, kv_heads: int, full: list[int], layers: int = 16) -> ModelConfig:
    types = tuple("full_attention" if i in full else "conv" for i in range(layers))
    return ModelConfig("Lfm2ForCausalLM", "lfm2", "float32", 65536, hidden, 8192, layers, heads, kv_heads,
                       hidden // heads, 1e-5, 128000, layer_types=types, conv_kernel=3)


def test_convolution_layers_take_whole_slots_in_groups_of_their_own():
    """LFM2-1.2B (16 layers, 6 attention ones; hidden 2048, 8 KV heads of 64): a convolution layer's row of 2048
    values takes 2 slots of 2 x 8 x 64, so its 10 layers are 20 cache layers, grouped 3 layers (6 slots) a group
    beside the 6 attention layers' group, and windowed at the kernel (3). LFM2-350M (hidden 1024): one slot each."""
    model_12b = lfm2(2048, 32, 8, [2, 5, 8, 10, 12, 14])
    assert cache_layers(model_12b)[:4] == (range(0, 2), range(2, 4), range(4, 5), range(5, 7))
    assert num_cache_layers(model_12b) == 26
    groups = kv_cache_groups(model_12b, BuildConfig(max_seq_len=4096))
    assert groups == (KVCacheGroup((4, 9, 14, 17, 20, 23), None), KVCacheGroup((0, 1, 2, 3, 5, 6), 3),
                      KVCacheGroup((7, 8, 10, 11, 12, 13), 3), KVCacheGroup((15, 16, 18, 19, 21, 22), 3),
                      KVCacheGroup((24, 25), 3))
    assert slots_per_block(groups) == 6 and layer_slot(groups, cache_layers(model_12b)[3][0]) == (1, 4)
    model_350m = lfm2(1024, 16, 8, [2, 5, 8, 10, 12, 14])
    assert num_cache_layers(model_350m) == 16
    assert [(len(g.layers), g.window) for g in kv_cache_groups(model_350m, BuildConfig())] == [
        (6, None), (6, 3), (4, 3)]


def test_groups_of_real_shapes():
    """Gemma 3 1B (26 layers, every 6th full, window 512): 4 full layers, so groups of 4: one full group and 6 sliding
    ones, the last of 2 layers. Gemma 2 2B (every 2nd of 26 full): a group of each kind. OLMo 3 7B (every 4th of 32):
    1 + 3 groups of 8."""
    gemma3 = kv_cache_groups(model(26, 512, 6), BuildConfig(max_seq_len=4096))
    assert gemma3 == (KVCacheGroup((5, 11, 17, 23), None), KVCacheGroup((0, 1, 2, 3), 512),
                      KVCacheGroup((4, 6, 7, 8), 512), KVCacheGroup((9, 10, 12, 13), 512),
                      KVCacheGroup((14, 15, 16, 18), 512), KVCacheGroup((19, 20, 21, 22), 512),
                      KVCacheGroup((24, 25), 512))
    assert slots_per_block(gemma3) == 4 and layer_slot(gemma3, 11) == (0, 1) and layer_slot(gemma3, 25) == (6, 1)
    gemma2 = kv_cache_groups(model(26, 4096, 2), BuildConfig(max_seq_len=8192))
    assert [(len(g.layers), g.window) for g in gemma2] == [(13, None), (13, 4096)]
    olmo3 = kv_cache_groups(model(32, 4096, 4), BuildConfig(max_seq_len=8192))
    assert [(len(g.layers), g.window) for g in olmo3] == [(8, None), (8, 4096), (8, 4096), (8, 4096)]


def test_one_group_where_layers_attend_alike_or_the_window_never_applies():
    every = tuple(range(8))
    assert kv_cache_groups(model(8, 6), BuildConfig(max_seq_len=64)) == (KVCacheGroup(every, 6),)  # Mistral
    assert kv_cache_groups(model(8, None), BuildConfig(max_seq_len=64)) == (KVCacheGroup(every, None),)  # Llama
    # Gemma 2 in an engine no longer than its window: full attention everywhere, one group as before
    assert kv_cache_groups(model(8, 64, 2), BuildConfig(max_seq_len=64)) == (KVCacheGroup(every, None),)


def test_blocks_a_sequence_and_a_batch_hold():
    """Blocks of 16, a 100-token window: a full group holds every block; a sliding one the window's 7 blocks (and
    one either side) plus a step's new tokens, at most."""
    assert max_blocks_held([None], 16, 1000, 256) == 63
    assert max_blocks_held([None, 100, 100], 16, 1000, 256) == 63 + 2 * (99 // 16 + 256 // 16 + 2)
    assert max_blocks_held([100], 16, 40, 256) == 3  # never more than the sequence's own blocks
    assert batch_blocks_needed([None, 100], 16, 4, 1000, 256) == 4 * 63 + 4 * (99 // 16 + 3) + 16
    assert batch_blocks_needed([None, 100], 16, 4, 20, 256) == 2 * 4 * 2


def test_storage_writes_each_groups_layers_into_its_own_blocks():
    """Layers 0 and 2 full, 1 sliding: blocks of 2 slots; group 1's blocks hold layer 1 in slot 0, slot 1 unused."""
    groups = (KVCacheGroup((0, 2), None), KVCacheGroup((1,), 6))
    storage = KVCacheStorage(3, 1, 2, 4, 4, groups=groups)
    assert storage.pool.shape == (4, 2, 2, 1, 4, 2) and storage.bytes_per_token == 2 * 2 * 2 * 2 * 4 * 4 // 4
    new_kv = np.arange(3 * 2 * 2 * 2, dtype=np.float32).reshape(3, 2, 2, 1, 2) + 1  # [layers, K|V, 2 tokens, 1, 2]
    storage.write(new_kv, [np.array([1, 2]), np.array([13, 14])])  # group 0: block 0; group 1: block 3
    np.testing.assert_array_equal(storage.pool[0, :, :, 0, 1:3], new_kv[[0, 2], :, :, 0])
    np.testing.assert_array_equal(storage.pool[3, 0, :, 0, 1:3], new_kv[1, :, :, 0])
    assert not storage.pool[3, 1].any() and not storage.pool[1:3].any()


def test_hybrid_manager_exact_block_ids():
    """A full group and a window-6 group, blocks of 4: allocation draws both groups' tables from one pool, block by
    block; after 13 tokens the sliding group gives back blocks 0 and 1 (positions 0..7), the full group keeps all."""
    kv = KVCacheManager(10, 4, windows=(None, 6))
    r = Request("a", list(range(100, 113)), SamplingParams())
    assert kv.blocks_needed(r, 13) == 8 and kv.allocate(r, 13)
    assert kv.blocks["a"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and kv.pool.num_free == 2
    r.num_computed_tokens = 13
    kv.cache_full_blocks(r)
    kv.release_outside_window(r)
    assert kv.blocks["a"] == [[0, 1, 2, 3], [RELEASED, RELEASED, 6, 7]]
    assert kv.block_tables(r) == ((0, 1, 2, 3), (0, 0, 6, 7)) and kv.pool.num_free == 4
    r.token_ids += [113, 114, 115, 116]  # 4 more tokens: a 5th block in each group, from the free queue's front
    assert kv.allocate(r, 17) and kv.blocks["a"] == [[0, 1, 2, 3, 8], [RELEASED, RELEASED, 6, 7, 9]]
    # the same 13 tokens again: the full group's 3 full blocks, and of the sliding group's only those the first query
    # after them (position 12: keys 7..12) reads: block 5 (positions 4..7, released but still cached) and block 6
    twin = Request("b", list(range(100, 113)), SamplingParams())
    prefix = kv.computed_prefix(twin)
    assert prefix.tables == ((0, 1, 2), (RELEASED, 5, 6)) and len(prefix) == 3
    kv.free(r)
    assert kv.pool.num_free == 10 and not kv.blocks
    # a 4th block per group, plus the 5 cached blocks the prefix revives from the free queue
    assert kv.blocks_needed(twin, 13, prefix) == 2 + 5 and kv.allocate(twin, 13, prefix)
    assert kv.blocks["b"][0][:3] == [0, 1, 2] and kv.blocks["b"][1][:3] == [RELEASED, 5, 6]
    assert kv.pool.ref_counts[5] == kv.pool.ref_counts[6] == 1 and kv.pool.ref_counts[4] == 0


@pytest.mark.parametrize("edit", ["slots", "tables"])
def test_an_engine_whose_io_disagrees_with_its_groups_is_refused(random_hf_model, engine_from_hf, tmp_path, edit):
    """An engine dir whose pool holds every layer per block, or lacks a group's block table input, while its model
    mixes full and sliding layers, is refused on loading with the rebuild command."""
    import shutil

    from conftest import RUNTIME_ENGINE_OPTIONS

    engine = tmp_path / "engine"
    shutil.copytree(engine_from_hf(random_hf_model("gemma2"), **RUNTIME_ENGINE_OPTIONS), engine)
    doc = json.loads((engine / "config.json").read_text())
    inputs = doc["io"]["inputs"]
    if edit == "slots":
        next(i for i in inputs if i["name"] == "kv_cache")["shape"][1] = 3
    else:
        doc["io"]["inputs"] = [i for i in inputs if i["name"] != "block_tables_2"]
    (engine / "config.json").write_text(json.dumps(doc))
    with pytest.raises(EngineCompatibilityError, match="KV cache group.*rebuild"):
        read_engine_config(engine)
