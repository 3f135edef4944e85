"""Tensor- and pipeline-parallel sharding of a full (rank-agnostic) checkpoint, and its exact inverse."""

from __future__ import annotations

import torch

from trtbuild.builder.convert.names import layer_of, linear_prefixes, tp_split_axis
from trtbuild.configs import Mapping, ModelConfig
from trtbuild.errors import CheckpointError, ConfigError
from trtbuild.quantization import QuantAlgo

_VOCAB_PARALLEL = ("transformer.vocab_embedding.", "lm_head.")  # prefixes: a quantized lm_head's scales too


def check_mapping(config: ModelConfig, mapping: Mapping) -> None:
    """Refuse a split the model cannot take, before any tensor is touched."""
    tp, pp = mapping.tp_size, mapping.pp_size
    if tp < 1 or pp < 1:
        raise ConfigError("tp_size" if tp < 1 else "pp_size", f"must be at least 1, got {min(tp, pp)}.")
    for what, n in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % tp:
            raise ConfigError("tp_size", f"{tp} does not divide {what}={n}; choose a TP size that divides it.")
    if pp > config.num_hidden_layers:
        raise ConfigError("pp_size", f"{pp} exceeds the {config.num_hidden_layers} layers of the model.")
    for what, n in (("moe_intermediate_size", config.moe_intermediate_size),
                    ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)):
        if n % tp:
            raise ConfigError("tp_size", f"{tp} does not divide {what}={n}; choose a TP size that divides it.")
    if tp > 1 and config.moe_bias:  # NOTE: each expert's down bias is weighted by its routing weight on every rank
        raise ConfigError("tp_size", f"{config.architecture}'s experts have biases, which a tensor-parallel split "
                                     "would add once per rank; use --tp-size 1.")
    if (tp > 1 or pp > 1) and config.recurrent_layers:
        raise ConfigError("tp_size" if tp > 1 else "pp_size", f"{config.architecture}'s recurrent layers are "
                          "not split over ranks yet; use --tp-size 1 --pp-size 1.")
    if tp > 1 and "conv" in config.layer_types:
        raise ConfigError("tp_size", f"{config.architecture}'s convolution layers are not split over tensor-parallel "
                                     "ranks yet; use --tp-size 1.")
    _check_int4_split(config, tp)


def _check_int4_split(config: ModelConfig, tp: int) -> None:
    """int4 weights are packed and grouped along `in`: row-parallel linears need whole groups on every rank."""
    q = config.quantization
    if q.quant_algo != QuantAlgo.INT4_AWQ or tp == 1:
        return
    group = q.group_size or 128
    for suffix, in_features in (("attention.dense", config.q_size), ("mlp.proj", config.intermediate_size)):
        quantized = [p for p in linear_prefixes(range(config.num_hidden_layers), False)
                     if p.endswith(suffix) and not q.is_excluded(p)]
        if quantized and (in_features // tp) % group:
            raise ConfigError(
                "tp_size", f"{tp} splits the {in_features} input features of {suffix} into {in_features // tp} per "
                f"rank, not a multiple of the int4 group size {group}; choose a smaller tp_size or group size, or "
                "exclude these linears.")


def check_nbits_split(config: ModelConfig, forms: dict[str, tuple[int, int]]) -> None:
    """weight_only linears (`forms`: prefix -> (bits, group size; None per output channel)) hold codes and scales per
    group along `in`: a row-parallel one needs whole groups on every rank (a per-channel scale goes to each)."""
    tp = config.mapping.tp_size
    features = {"attention.dense": config.q_size, "mlp.proj": config.intermediate_size,
                "mlp.experts.proj": config.moe_intermediate_size,
                "mlp.shared.proj": config.shared_expert_intermediate_size}
    for prefix, (bits, group) in forms.items():
        in_features = next((n for suffix, n in features.items() if prefix.endswith(suffix)), None)
        if tp > 1 and in_features is not None and group is not None and (in_features // tp) % group:
            raise ConfigError(
                "tp_size", f"{tp} splits the {in_features} input features of {prefix} into {in_features // tp} per "
                f"rank, not a multiple of its {bits}-bit weights' group of {group}; choose a smaller --tp-size, or "
                "--dequantize a GGUF file.")


def _held_by(name: str, config: ModelConfig, mapping: Mapping, rank: int) -> bool:
    layer = layer_of(name)
    if layer is not None:
        return layer in mapping.layers_of(rank, config.num_hidden_layers)
    pp_rank = mapping.pp_rank(rank)
    if name == "transformer.vocab_embedding.weight":
        return pp_rank == 0
    return pp_rank == mapping.pp_size - 1  # ln_f, lm_head


def shard_for_rank(tensors: dict[str, torch.Tensor], config: ModelConfig, mapping: Mapping, rank: int) -> dict:
    """The tensors of one rank: its pipeline stage's layers, each split along its TP axis.

    Vocab-parallel tensors are zero-padded to a multiple of tp_size rows (`merge_shards` strips the padding).
    """
    tp, tp_rank = mapping.tp_size, mapping.tp_rank(rank)
    out = {}
    for name, t in tensors.items():
        if not _held_by(name, config, mapping, rank):
            continue
        axis = tp_split_axis(name, t.ndim, config.qk_norm_full)
        if axis is None or tp == 1:
            out[name] = t.contiguous()
            continue
        if axis == 0 and name.startswith(_VOCAB_PARALLEL) and t.shape[0] % tp:
            pad = tp - t.shape[0] % tp
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        view = _expert_rows(name, t, config)
        if view is t and _per_channel_of_inputs(t, axis):  # each rank's share of the inputs keeps its rows' scales
            out[name] = t.contiguous()  # NOTE: its group is now its share of the inputs: merge_shards gives tp columns
            continue
        piece = view.chunk(tp, dim=axis)[tp_rank]
        out[name] = (piece.reshape(-1, t.shape[1]) if view is not t else piece).contiguous()
    return out


def _per_channel_of_inputs(t: torch.Tensor, axis: int) -> bool:
    """Whether `t` is the per-output-channel scales (or zero points) [out, 1] of a linear split along its inputs."""
    return t.ndim == 2 and axis % 2 == 1 and t.shape[1] == 1


def _expert_rows(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A weight-only stack of experts' gate or up rows ([experts x out, in], and its scales) viewed as [experts, out,
    in], so that axis 1 splits each expert's rows as it does a float stack's; any other tensor as it is."""
    if t.ndim == 2 and tp_split_axis(name, t.ndim) == 1 and ".mlp.experts." in name:
        return t.reshape(config.num_experts, -1, t.shape[1])
    return t


def merge_shards(shards: list[dict[str, torch.Tensor]], config: ModelConfig, mapping: Mapping) -> dict:
    """Reassemble the rank-agnostic checkpoint from all ranks' shards (the inverse of `shard_for_rank`, but for the
    per-channel scales of a weight-only row-parallel linear, which come back as tp_size equal columns: the same
    weight in groups of in / tp_size)."""
    if len(shards) != mapping.world_size:
        raise CheckpointError(f"expected {mapping.world_size} shards, got {len(shards)}.")
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(mapping.pp_size):
        ranks = [pp_rank * mapping.tp_size + r for r in range(mapping.tp_size)]
        for name in shards[ranks[0]]:
            pieces = [shards[r][name] for r in ranks]
            axis = tp_split_axis(name, pieces[0].ndim, config.qk_norm_full)
            views = [_expert_rows(name, p, config) for p in pieces]
            t = pieces[0] if axis is None or mapping.tp_size == 1 else torch.cat(views, dim=axis)
            t = t.reshape(-1, pieces[0].shape[1]) if views[0] is not pieces[0] else t
            if axis == 0 and name.startswith(_VOCAB_PARALLEL):
                t = t[: config.vocab_size]
            out[name] = t
    return out
