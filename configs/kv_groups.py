"""Which layers share a KV block: the engine's KV cache groups (one source of truth for builder and runtime).

A model whose layers all attend alike has one group of every layer: a block holds all layers' K/V of its positions.
A model that mixes full-attention and sliding-window layers (Gemma 2 / 3, OLMo 3) would then keep every layer's K/V
of every position, though its sliding layers read only their last `window` tokens. Its layers are split instead into
groups of one kind each and of equal size (as vLLM's hybrid allocator does), so that one pool of equal blocks serves
them all: a block belongs to one group and holds that group's layers (its `slots`) at its positions, and each group
has its own block table per sequence. A sliding group's blocks before a sequence's window go back to the pool; a full
group keeps all of its. Groups of a kind other than the last are full; the last may leave slots unused.

Engine I/O per group g: the block table input `group_input("block_tables", g)`; layer l's PagedAttention node reads
slot `layer_slot` of its group's blocks in the one `kv_cache` pool [blocks, slots, 2, kv_heads, block, head_size].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trtbuild.configs.build_config import BuildConfig
from trtbuild.configs.model_config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # the model layers whose K/V a block of this group holds, in slot order
    window: int | None  # every layer of the group attends within its last `window` tokens (None: to every token)


def kv_cache_groups(model: ModelConfig, build: BuildConfig) -> tuple[KVCacheGroup, ...]:
    """The engine's KV cache groups: one of every layer unless sliding and full layers mix (and the window is shorter
    than the engine), then groups of min(#full, #sliding) layers, full ones first."""
    layers = range(model.num_hidden_layers)
    window = model.sliding_window if model.window_applies(build.max_seq_len) else None
    sliding = [i for i in layers if window and model.is_sliding(i)]
    full = [i for i in layers if i not in sliding]
    if not sliding or not full:
        return (KVCacheGroup(tuple(layers), window if sliding else None),)
    size = min(len(full), len(sliding))
    return tuple(KVCacheGroup(tuple(kind[i : i + size]), w)
                 for kind, w in ((full, None), (sliding, window)) for i in range(0, len(kind), size))


def slots_per_block(groups: tuple[KVCacheGroup, ...]) -> int:
    return max(len(g.layers) for g in groups)


def layer_slot(groups: tuple[KVCacheGroup, ...], layer: int) -> tuple[int, int]:
    """(group, slot) of a model layer."""
    return next((g, group.layers.index(layer)) for g, group in enumerate(groups) if layer in group.layers)


def max_blocks_held(windows: Iterable[int | None], block_size: int, num_tokens: int, chunk_tokens: int) -> int:
    """The most blocks a sequence of num_tokens tokens holds at once in groups of these windows, computing at most
    chunk_tokens per step, when its sliding groups give back the blocks before their windows as it goes."""
    total = -(-num_tokens // block_size)
    return sum(min(total, (w - 1 + chunk_tokens) // block_size + 2) if w else total for w in windows)


def batch_blocks_needed(windows: Iterable[int | None], block_size: int, num_seqs: int, tokens_per_seq: int,
                        max_num_tokens: int) -> int:
    """Blocks that num_seqs concurrent sequences of tokens_per_seq tokens need at once in groups of these windows,
    scheduled max_num_tokens per step: every block of a full group; in a sliding group, each sequence's window (and
    a block either side of it) plus the blocks of one step's new tokens."""
    per_seq = -(-tokens_per_seq // block_size)
    return sum(min(num_seqs * per_seq, num_seqs * ((w - 1) // block_size + 3) + -(-max_num_tokens // block_size))
               if w else num_seqs * per_seq for w in windows)


def group_input(name: str, group: int) -> str:
    """The engine input of a per-group tensor (`block_tables`, and the CUDA plan's `slot_mapping`): the name itself
    for group 0, so that a one-group engine's I/O is what it always was."""
    return name if group == 0 else f"{name}_{group}"
