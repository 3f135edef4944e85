"""Which layers share a KV block: the engine's KV cache groups (one source of truth for builder and runtime).

A model whose layers all attend alike has one group of every layer: a block holds all layers' K/V of its positions.
A model that mixes full-attention and sliding-window layers (Gemma 2 / 3, OLMo 3) would then keep every layer's K/V
of every position, though its sliding layers read only their last `window` tokens. Its layers are split instead into
groups of one kind each and of equal size (as vLLM's hybrid allocator does), so that one pool of equal blocks serves
them all: a block belongs to one group and holds that group's layers (its `slots`) at its positions, and each group
has its own block table per sequence. A sliding group's blocks before a sequence's window go back to the pool; a full
group keeps all of its. Groups of a kind other than the last are full; the last may leave slots unused.

LFM2's short convolution layers keep their state, each token's input row, in the pool too (plugins/short_conv.py):
a row takes `entries_per_row` slots (cache layers), and the convolution layers form groups of their own whose window
is the kernel's length. So the pool's slots count cache layers, not model layers: `cache_layers` maps one to the
other (an attention layer's K/V is one cache layer; every model without convolutions has cache layer i = layer i).
Qwen3.5's linear attention layers convolve their q / k / v rows the same way; their recurrent state, a matrix per
sequence, is not in the pool (runtime/recurrent_state.py).

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
    layers: tuple[int, ...]  # the cache layers (cache_layers) whose K/V a block of this group holds, in slot order
    window: int | None  # every layer of the group attends within its last `window` tokens (None: to every token)


def entries_per_row(hidden: int, kv_heads: int, head_size: int) -> int:
    """Pool slots one token's row of `hidden` values takes (a convolution layer's state, plugins/short_conv.py): a
    slot holds 2 x kv_heads x head_size of them."""
    return -(-hidden // (2 * kv_heads * head_size))


def cache_layers(model: ModelConfig) -> tuple[range, ...]:
    """Per model layer, the cache layers (pool slots of its group's blocks) its state takes: an attention layer's K/V
    one, a convolving layer's input row (LFM2's conv, Qwen3.5's linear attention) entries_per_row of them."""
    sizes = [entries_per_row(model.conv_channels(i), model.num_key_value_heads, model.head_size)
             if model.has_conv_rows(i) else 1 for i in range(model.num_hidden_layers)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True))


def num_cache_layers(model: ModelConfig) -> int:
    return cache_layers(model)[-1].stop


def kv_cache_groups(model: ModelConfig, build: BuildConfig) -> tuple[KVCacheGroup, ...]:
    """The engine's KV cache groups: one of every layer unless layers of different kinds mix (full attention, sliding
    attention where the window is shorter than the engine, convolutions), then groups of one kind each of about
    min(cache layers of a kind) cache layers, a convolution layer's never split: full ones first."""
    window = model.sliding_window if model.window_applies(build.max_seq_len) else None
    entries = cache_layers(model)
    conv = [i for i in range(model.num_hidden_layers) if model.has_conv_rows(i)]
    sliding = [i for i in range(model.num_hidden_layers) if window and model.is_sliding(i)]
    full = [i for i in range(model.num_hidden_layers) if i not in sliding and i not in conv]
    kinds = [(layers, w) for layers, w in ((full, None), (sliding, window), (conv, model.conv_kernel)) if layers]
    size = min(sum(len(entries[i]) for i in layers) for layers, _ in kinds)
    groups = []
    for layers, w in kinds:
        per_group = len(layers) if len(kinds) == 1 else max(1, size // len(entries[layers[0]]))
        for i in range(0, len(layers), per_group):
            groups.append(KVCacheGroup(tuple(e for layer in layers[i:i + per_group] for e in entries[layer]), w))
    return tuple(groups)


def slots_per_block(groups: tuple[KVCacheGroup, ...]) -> int:
    return max(len(g.layers) for g in groups)


def layer_slot(groups: tuple[KVCacheGroup, ...], layer: int) -> tuple[int, int]:
    """(group, slot) of a cache layer."""
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
