"""Graph passes over the ONNX network. Each pass rewrites the model in place and returns how many sites it changed.

Order matters: pre-quant scales are folded into the norms / up projections first (while those are plain RMSNorm
and MatMul nodes), then sibling GEMMs are merged (QKV, gate/up), RoPE moves into the attention op, and residual
Add + RMSNorm are fused (a CPU-target pass: the fused op is ONNX Runtime's).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from trtbuild.builder.passes.fold_prescale import fold_prescale
from trtbuild.builder.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from trtbuild.builder.passes.fuse_gemms import fuse_gate_up, fuse_qkv
from trtbuild.builder.passes.fuse_rope import fuse_rope_into_attention
from trtbuild.builder.passes.lora import hoist_lora_adds

Pass = Callable[[onnx.ModelProto], int]

PASSES: dict[str, tuple[Pass, ...]] = {
    "cpu": (fold_prescale, fuse_qkv, fuse_gate_up, hoist_lora_adds, fuse_rope_into_attention, fuse_add_rmsnorm),
    # NOTE: the cuda plan maps the fused SkipSimplifiedLayerNormalization to its add + RMSNorm kernel (cuda_plan.py)
    "cuda": (fold_prescale, fuse_qkv, fuse_gate_up, hoist_lora_adds, fuse_rope_into_attention, fuse_add_rmsnorm),
    "tensorrt": (fold_prescale, fuse_qkv, fuse_gate_up, hoist_lora_adds, fuse_rope_into_attention),
}


def run_passes(model: onnx.ModelProto, target: str) -> dict[str, int]:
    """Apply the target's passes in order; returns {pass name: sites rewritten}."""
    return {p.__name__: p(model) for p in PASSES[target]}
