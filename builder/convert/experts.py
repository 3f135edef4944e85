"""A mixture of experts' tensors in the one form the checkpoint holds: each layer's router, and its experts' gate,
up and down projections stacked over the experts.

Hugging Face checkpoints store one tensor per expert and projection, named per family (Qwen3-MoE and OLMoE:
`mlp.experts.{e}.gate_proj`, the router `mlp.gate`; Mixtral: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up),
`w2` (down), the router `block_sparse_moe.gate`; Granite MoE: all experts' gate and up rows in one
`block_sparse_moe.input_linear`, down in `output_linear`, the router `block_sparse_moe.router.layer`; gpt-oss:
`mlp.experts.gate_up_proj` [experts, hidden, 2 x inter] with gate and up columns interleaved, `down_proj`
[experts, inter, hidden] (both [in, out]), their biases, and the router `mlp.router` with a bias; its released
checkpoints hold the expert weights as MXFP4 `_blocks` and `_scales`, kept as they are, as GGUF's MXFP4 tensors
are); LFM2-MoE: `feed_forward.experts.{e}.w1` / `w3` / `w2`, its router `feed_forward.gate` (named by
builder/convert/names.py). GGUF files store them stacked already (`ffn_gate_exps`, ...), which the GGUF reader names
as the stacked form here. Stacking is lazy, as every source tensor is: the experts of one projection are read when
the stacked tensor is loaded.
"""

from __future__ import annotations

import re

import torch

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs import ModelConfig
from trtbuild.errors import CheckpointError

ROUTER = "mlp.gate.weight"  # [experts, hidden]
STACKED = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\.(\w+)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(?:gate|router\.layer)\.weight$")
# Granite MoE: every expert's gate and up rows in one [experts, 2 x inter, hidden] tensor, down in another
_GRANITE_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(input|output)_linear\.weight$")
_GPT_OSS_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.router\.(weight|bias)$")
_GPT_OSS_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_PROJECTION = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}  # -> STACKED index


def stack_experts(sources: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """`sources` with each layer's per-expert tensors replaced by the STACKED ones and its router named ROUTER; a
    missing or misshapen expert is a CheckpointError."""
    if not config.is_moe:
        return sources
    out: dict[str, SourceTensor] = {}
    experts: dict[tuple[str, int], dict[int, SourceTensor]] = {}
    gpt_oss: dict[tuple[str, str], dict[str, SourceTensor]] = {}
    for name, src in sources.items():
        if m := _EXPERT.match(name):
            layer, expert, projection = m.group(1), int(m.group(2)), m.group(3)
            if projection not in _PROJECTION:
                raise CheckpointError(f"{name}: an expert projection named {projection!r} is not one of "
                                      f"{', '.join(_PROJECTION)}; this mixture of experts is not supported.")
            experts.setdefault((layer, _PROJECTION[projection]), {})[expert] = src
        elif m := _MIXTRAL_ROUTER.match(name):
            out[f"{m.group(1)}.{ROUTER}"] = src
        elif m := _GRANITE_EXPERTS.match(name):
            out.update(_granite_experts(m.group(1), m.group(2), src, config))
        elif m := _GPT_OSS_ROUTER.match(name):
            out[f"{m.group(1)}.mlp.gate.{m.group(2)}"] = src
        elif m := _GPT_OSS_EXPERTS.match(name):
            gpt_oss.setdefault((m.group(1), m.group(2)), {})[m.group(3) or ""] = src
        else:
            out[name] = src
    for (layer, projection), parts in gpt_oss.items():
        out.update(_gpt_oss_experts(layer, projection, parts, config))
    for (layer, index), parts in experts.items():
        if sorted(parts) != list(range(config.num_experts)):
            missing = sorted(set(range(config.num_experts)) - set(parts))
            raise CheckpointError(f"{layer} has {len(parts)} of its {config.num_experts} experts' "
                                  f"{STACKED[index].split('.')[2]} (missing: {missing[:5]}); the weights are "
                                  "incomplete.")
        shapes = {p.shape for p in parts.values()}
        if len(shapes) != 1:
            raise CheckpointError(f"{layer}'s experts differ in shape ({sorted(shapes)}); the weights are corrupt.")
        ordered = [parts[e] for e in range(config.num_experts)]
        out[f"{layer}.{STACKED[index]}"] = SourceTensor(
            (config.num_experts, *shapes.pop()),
            lambda ordered=ordered: torch.stack([torch.as_tensor(p.load()) for p in ordered]))
    return out


def _granite_experts(layer: str, which: str, src: SourceTensor, config: ModelConfig) -> dict[str, SourceTensor]:
    """Granite MoE's stacked experts as the STACKED ones: input_linear's first inter rows of each expert are its
    gate, the others its up (its forward's chunk(2)); output_linear is down."""
    if which == "output":
        return {f"{layer}.{STACKED[2]}": src}
    inter = config.moe_intermediate_size
    if len(src.shape) != 3 or src.shape[1] != 2 * inter:
        raise CheckpointError(f"{layer}.block_sparse_moe.input_linear.weight has shape {list(src.shape)}, not "
                              f"[experts, 2 x {inter}, hidden]; the weights do not fit the config.")
    shape = (src.shape[0], inter, src.shape[2])

    def half(i: int) -> torch.Tensor:
        return torch.as_tensor(src.load())[:, i * inter:(i + 1) * inter].contiguous()

    return {f"{layer}.{STACKED[i]}": SourceTensor(shape, lambda i=i: half(i)) for i in (0, 1)}


def _gpt_oss_experts(layer: str, projection: str, parts: dict[str, SourceTensor], config: ModelConfig
                     ) -> dict[str, SourceTensor]:
    """gpt-oss's gate_up_proj or down_proj (weight, or MXFP4 `_blocks` + `_scales`) and `_bias` as the STACKED
    tensors and their biases: weights [experts, out, in], gate the even columns of gate_up, up the odd ones."""
    inter, hidden, n = config.moe_intermediate_size, config.hidden_size, config.num_experts
    fused = projection == "gate_up_proj"
    outs = (STACKED[0], STACKED[1]) if fused else (STACKED[2],)
    rows, columns = (inter, hidden) if fused else (hidden, inter)
    where = f"{layer}.mlp.experts.{projection}"
    out: dict[str, SourceTensor] = {}
    if "_bias" in parts:
        bias = parts["_bias"]
        if tuple(bias.shape) != (n, rows * len(outs)):
            raise CheckpointError(f"{where}_bias has shape {list(bias.shape)}, not {[n, rows * len(outs)]}; the "
                                  "weights do not fit the config.")
        for i, name in enumerate(outs):
            out[f"{layer}.{name.replace('.weight', '.bias')}"] = SourceTensor(
                (n, rows), lambda i=i: torch.as_tensor(bias.load())[:, i::len(outs)].contiguous())
    if "" in parts:
        weight = parts[""]  # [experts, in, out]
        if tuple(weight.shape) != (n, columns, rows * len(outs)):
            raise CheckpointError(f"{where} has shape {list(weight.shape)}, not {[n, columns, rows * len(outs)]}; "
                                  "the weights do not fit the config.")
        for i, name in enumerate(outs):
            out[f"{layer}.{name}"] = SourceTensor(
                (n, rows, columns),
                lambda i=i: torch.as_tensor(weight.load())[..., i::len(outs)].transpose(1, 2).contiguous())
    elif "_blocks" in parts and "_scales" in parts:
        from trtbuild.builder.convert.mxfp4 import mxfp4_experts

        for i, name in enumerate(outs):
            out[f"{layer}.{name}"] = mxfp4_experts(parts["_blocks"], parts["_scales"], i, len(outs), (n, rows, columns),
                                                   where)
    else:
        raise CheckpointError(f"{where} has {sorted(k or 'weight' for k in parts)} but no weight (nor MXFP4 _blocks "
                              "and _scales); the weights are incomplete.")
    return out
