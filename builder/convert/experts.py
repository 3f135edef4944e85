"""A mixture of experts' tensors in the one form the checkpoint holds: each layer's router, and its experts' gate,
up and down projections stacked over the experts.

Hugging Face checkpoints store one tensor per expert and projection, named per family (Qwen3-MoE and OLMoE:
`mlp.experts.{e}.gate_proj`, the router `mlp.gate`; Mixtral: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up),
`w2` (down), the router `block_sparse_moe.gate`; Granite MoE: all experts' gate and up rows in one
`block_sparse_moe.input_linear`, down in `output_linear`, the router `block_sparse_moe.router.layer`); GGUF files
store them stacked already (`ffn_gate_exps`, ...), which the GGUF reader names as the stacked form here. Stacking is
lazy, as every source tensor is: the experts of one projection are read when the stacked tensor is loaded.
"""

from __future__ import annotations

import re

import torch

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs import ModelConfig
from trtbuild.errors import CheckpointError

ROUTER = "mlp.gate.weight"  # [experts, hidden]
STACKED = ("mlp.experts.gate_proj.weight", "mlp.experts.up_proj.weight", "mlp.experts.down_proj.weight")

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(?:gate|router\.layer)\.weight$")
# Granite MoE: every expert's gate and up rows in one [experts, 2 x inter, hidden] tensor, down in another
_GRANITE_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(input|output)_linear\.weight$")
_PROJECTION = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}  # -> STACKED index


def stack_experts(sources: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """`sources` with each layer's per-expert tensors replaced by the STACKED ones and its router named ROUTER; a
    missing or misshapen expert is a CheckpointError."""
    if not config.is_moe:
        return sources
    out: dict[str, SourceTensor] = {}
    experts: dict[tuple[str, int], dict[int, SourceTensor]] = {}
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
        else:
            out[name] = src
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
