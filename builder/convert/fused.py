"""Fused projections split into the separate ones every other family has.

Phi-3 stores each layer's q, k and v projections as one `qkv_proj` (rows q, then k, then v) and gate and up as one
`gate_up_proj` (rows gate, then up); its GGUF files do the same (`attn_qkv`, and `ffn_up` twice as tall). Granite
4.0 stores its MLP's (or shared expert's) gate and up as `shared_mlp.input_linear`, down as `output_linear`. Splitting
them here, by rows and without reading anything, lets the converter, the quantizer and the engine see one layout
(the engine fuses q/k/v and gate/up again itself: builder/passes/fuse_gemms.py). A row range of a GGUF tensor kept
quantized is a row range of its blocks, so it stays exact.

Qwen3.5's full attention layers project each head's query and output gate together: `q_proj` rows are [head 0's q,
head 0's gate, head 1's q, ...]; they become q_proj and the attention gate (AFMoE's `gate_proj`) the same way.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import torch

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs import ModelConfig
from trtbuild.configs.model_config import QWEN35_FAMILIES

_FUSED_LAYER = re.compile(r"^(model\.layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj|shared_mlp\.input_linear)"
                          r"\.weight$")
_GRANITE4_DOWN = re.compile(r"^(model\.layers\.\d+)\.shared_mlp\.output_linear\.weight$")
_GATED_QUERY = re.compile(r"^(model\.layers\.\d+)\.self_attn\.q_proj\.weight$")


def fused_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused module -> its parts (module name, rows), in row order."""
    return {
        "self_attn.qkv_proj": (("self_attn.q_proj", config.q_size), ("self_attn.k_proj", config.kv_size),
                               ("self_attn.v_proj", config.kv_size)),
        "mlp.gate_up_proj": (("mlp.gate_proj", config.intermediate_size),
                             ("mlp.up_proj", config.intermediate_size)),
        # Granite 4.0 (configs/granite4.py): its MLP, or the shared expert beside its experts
        "shared_mlp.input_linear": (("mlp.gate_proj", config.intermediate_size),
                                    ("mlp.up_proj", config.intermediate_size)) if not config.is_moe else (
            ("mlp.shared_expert.gate_proj", config.shared_expert_intermediate_size),
            ("mlp.shared_expert.up_proj", config.shared_expert_intermediate_size)),
    }


def take_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a weight: a torch tensor, a numpy array or a kept-quantized NBitsWeight."""
    from trtbuild.builder.convert.weight_only import NBitsWeight

    if isinstance(value, NBitsWeight):
        zp = value.zero_points
        return dataclasses.replace(value, codes=value.codes[start:stop].copy(),
                                   scales=value.scales[start:stop].copy(),
                                   zero_points=None if zp is None else zp[start:stop].copy())
    return value[start:stop].clone() if hasattr(value, "clone") else value[start:stop].copy()


def take_row_index(value: Any, rows: Any) -> Any:
    """Rows `rows` (an index array) of a weight, as take_rows."""
    from trtbuild.builder.convert.weight_only import NBitsWeight

    if isinstance(value, NBitsWeight):
        zp = value.zero_points
        return dataclasses.replace(value, codes=value.codes[rows], scales=value.scales[rows],
                                   zero_points=None if zp is None else zp[rows])
    return value[torch.as_tensor(rows)].clone() if hasattr(value, "clone") else value[rows]


def split_gated_query(name: str, src: SourceTensor, config: ModelConfig) -> dict[str, SourceTensor]:
    """Qwen3.5's q_proj [heads x (q, gate) x head_size, hidden] as q_proj and gate_proj, each [q_size, hidden]."""
    from trtbuild.errors import CheckpointError

    if len(src.shape) != 2 or src.shape[0] != 2 * config.q_size:
        raise CheckpointError(f"{name} has shape {list(src.shape)}; a Qwen3.5 attention's q_proj holds each head's "
                              f"query and output gate: [{2 * config.q_size}, ...]. The weights do not fit the config.")
    d = config.head_size
    queries = (np.arange(config.num_attention_heads)[:, None] * 2 * d + np.arange(d)[None]).reshape(-1)
    layer = name.removesuffix(".self_attn.q_proj.weight")

    def part(rows: np.ndarray) -> SourceTensor:
        return SourceTensor((config.q_size, src.shape[1]), lambda: take_row_index(src.load(), rows), src.nbits)

    return {f"{layer}.self_attn.q_proj.weight": part(queries), f"{layer}.self_attn.gate_proj.weight": part(queries + d)}


def split_fused(sources: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """`sources` with every fused projection replaced by its parts (each loads the fused tensor and keeps its
    rows); a fused tensor whose rows are not the parts' sum is a CheckpointError."""
    from trtbuild.errors import CheckpointError

    parts = fused_parts(config)
    out: dict[str, SourceTensor] = {}
    for name, src in sources.items():
        m = _FUSED_LAYER.match(name)
        if down := _GRANITE4_DOWN.match(name):  # named as the MLP's down, or the shared expert's
            out[f"{down.group(1)}.{'mlp.shared_expert' if config.is_moe else 'mlp'}.down_proj.weight"] = src
            continue
        if config.family in QWEN35_FAMILIES and _GATED_QUERY.match(name):
            out.update(split_gated_query(name, src, config))
            continue
        if m is None:
            out[name] = src
            continue
        layer, fused = m.groups()
        rows = sum(n for _, n in parts[fused])
        if len(src.shape) != 2 or src.shape[0] != rows:
            raise CheckpointError(f"{name} has shape {list(src.shape)}; the config makes it [{rows}, ...] "
                                  f"({' + '.join(f'{p}: {n}' for p, n in parts[fused])}). The weights do not fit "
                                  "the config.")
        start = 0
        for part, n in parts[fused]:
            out[f"{layer}.{part}.weight"] = SourceTensor(
                (n, src.shape[1]), lambda src=src, a=start, b=start + n: take_rows(src.load(), a, b), src.nbits)
            start += n
    return out


def split_fused_tensors(tensors: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """`split_fused` of tensors in memory (HF-named), the parts loaded."""
    sources = {n: SourceTensor(tuple(t.shape), lambda t=t: t) for n, t in tensors.items()}
    return {n: s.load() for n, s in split_fused(sources, config).items()}
