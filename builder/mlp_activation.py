"""The MLP's activation in standard ONNX ops: gated, act(gate) * up (SwiGLU, GeGLU (Gemma), or gpt-oss's clamped
SwiGLU), or of the up projection alone in an MLP without a gate (Arcee's relu(x)^2). The CPU lowering replaces the
plain SwiGLU pattern with trtbuild::SwiGLU (builder/native_swiglu.py); the experts' native path writes that op itself
(builder/moe_experts.py)."""

from __future__ import annotations

import numpy as np

from trtbuild.builder.graph import GraphBuilder
from trtbuild.configs import ModelConfig


def gated_activation(g: GraphBuilder, config: ModelConfig, gate: str, up: str, name: str) -> str:
    """silu(gate) * up, gelu_tanh(gate) * up, or (swiglu_oai) g * sigmoid(alpha g) * (u + 1) with g = min(gate,
    limit) and u = clamp(up, -limit, limit)."""
    if config.hidden_act == "gelu_pytorch_tanh":
        return g.op("Mul", [g.op("Gelu", [gate], approximate="tanh"), up], name=name + "geglu")
    if config.hidden_act == "swiglu_oai":
        limit = float(config.swiglu_limit)
        low, high = g.const(np.array(-limit, np.float32), "swiglu_low"), g.const(np.array(limit, np.float32),
                                                                                   "swiglu_high")
        gate = g.op("Min", [gate, high], name=name + "gate_clamped")
        up = g.op("Clip", [up, low, high], name=name + "up_clamped")
        slope = g.const(np.array(config.swiglu_alpha, np.float32), "swiglu_alpha")
        glu = g.op("Mul", [gate, g.op("Sigmoid", [g.op("Mul", [gate, slope])])], name=name + "glu")
        return g.op("Mul", [glu, g.op("Add", [up, g.const(np.array(1.0, np.float32), "one")])], name=name + "swiglu")
    return g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up], name=name + "swiglu")


def activation(g: GraphBuilder, config: ModelConfig, x: str, name: str) -> str:
    """act(x) of an MLP without a gate: relu(x)^2, gelu_tanh(x) or silu(x)."""
    if config.hidden_act == "relu2":
        relu = g.op("Relu", [x], name=name + "relu")
        return g.op("Mul", [relu, relu], name=name + "relu2")
    if config.hidden_act == "gelu_pytorch_tanh":
        return g.op("Gelu", [x], approximate="tanh", name=name + "gelu")
    if config.hidden_act == "silu":
        return g.op("Mul", [x, g.op("Sigmoid", [x])], name=name + "silu")
    raise ValueError(f"hidden_act {config.hidden_act!r} has no form without a gate")
