"""An FP8 Hugging Face checkpoint's weights, dequantized as they are read (the forms: configs/hf_quantization.py).

Each FP8 weight W (e4m3, [..., rows, columns]) has a scale tensor S beside it, and the weight it stands for is
W * S, computed in float32 (then cast to the checkpoint's dtype like any HF weight, as transformers does when it
loads such a checkpoint without a GPU). S's shape says how it covers W: one value (per tensor), [rows, 1] or [rows]
(per output channel), or [ceil(rows / br), ceil(columns / bc)] (per block, the last ones cut at the edges). The
activation and KV-cache scales beside them are dropped.
"""

from __future__ import annotations

import math

import torch

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs.hf_quantization import Fp8Weights
from trtbuild.errors import CheckpointError

# the run-time scales of FP8 checkpoints' activations and KV cache: nothing in a float engine uses them
_RUN_TIME_SCALES = ("input_scale", "input_scale_ub", "activation_scale", "k_scale", "v_scale", "q_scale",
                    "prob_scale", "output_scale", "kv_scale")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantized_sources(sources: dict[str, SourceTensor], form: Fp8Weights) -> dict[str, SourceTensor]:
    """The checkpoint's tensors with every FP8 weight (one with a `<name><form.scale_suffix>` beside it) loading
    as W * S in float32, its scale and the run-time scales left out; every other tensor as it is."""
    kept = {name: src for name, src in sources.items() if name.rsplit(".", 1)[-1] not in _RUN_TIME_SCALES}
    scales = {name[: -len(form.scale_suffix)]: name for name in kept if name.endswith(form.scale_suffix)}
    scale_names = set(scales.values())
    out: dict[str, SourceTensor] = {}
    for name, src in kept.items():
        if name in scale_names:
            continue
        if name in scales:
            scale = sources[scales[name]]
            out[name] = SourceTensor(src.shape, lambda w=src, s=scale, n=name: dequantize_fp8(
                torch.as_tensor(w.load()), torch.as_tensor(s.load()), form.block, n))
        else:
            out[name] = src
    orphans = [s for w, s in scales.items() if w not in sources]
    if orphans:
        raise CheckpointError(f"{orphans[0]} has no weight {orphans[0][: -len(form.scale_suffix)]} beside it; "
                              "the checkpoint is incomplete.")
    return out


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, name: str
                   ) -> torch.Tensor:
    """weight [..., rows, columns] (e4m3) * its scale (per tensor, per row, or per `block`), in float32."""
    if weight.dtype not in _FP8:
        raise CheckpointError(f"{name} is {weight.dtype}, not float8, though the checkpoint gives it a scale; the "
                              "checkpoint does not match its quantization_config.")
    if weight.dim() < 2:
        raise CheckpointError(f"{name} has shape {list(weight.shape)}; an FP8 weight has at least two dimensions.")
    w = weight.to(torch.float32)
    s = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
    return w * _expanded(s, tuple(w.shape), block, name)


def _expanded(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None, name: str
              ) -> torch.Tensor:
    """The scale broadcastable to the weight's shape."""
    *lead, rows, columns = shape
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.dim() == len(shape) - 1 and tuple(scale.shape) == (*lead, rows):
        return scale[..., None]  # per output channel, stored as [rows]
    grid = tuple(scale.shape[-2:]) if scale.dim() == len(shape) else None
    if grid is None or tuple(scale.shape[:-2]) != tuple(lead):
        raise CheckpointError(f"{name}'s scale has shape {list(scale.shape)}, which does not cover the weight "
                              f"{list(shape)} per tensor, row or block.")
    if grid == (rows, 1) and block is None:
        return scale  # per output channel, [rows, 1]
    br, bc = block or (math.ceil(rows / grid[0]), math.ceil(columns / grid[1]))
    if (math.ceil(rows / br), math.ceil(columns / bc)) != grid:
        raise CheckpointError(f"{name}'s scale grid {list(grid)} does not cover its weight {[rows, columns]} in "
                              f"blocks of {[br, bc]}; the checkpoint does not match its quantization_config.")
    return scale.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :columns]
