"""The MLP's activation in standard ONNX ops: gated, act(gate) * up (SwiGLU, GeGLU (Gemma), or gpt-oss's clamped
SwiGLU), or of the up projection alone in an MLP without a gate (Arcee's relu(x)^2, Apertus's xIELU). The CPU
lowering replaces the plain SwiGLU pattern with trtbuild::SwiGLU (builder/native_swiglu.py); the experts' native path
writes that op itself (builder/moe_experts.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trtbuild.builder.graph import GraphBuilder
from trtbuild.configs import ModelConfig
from trtbuild.configs.model_config import XIELU_PARAMETERS


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


def _softplus(x: float) -> float:
    return float(np.logaddexp(np.float32(0), np.float32(x)))


def xielu(g: GraphBuilder, x: str, tensor: Callable[[str], np.ndarray], name: str) -> str:
    """Apertus's xIELU (configs/model_config.py: XIELU_PARAMETERS) from its layer's learned scalars (`tensor(name)`):
    a_p x^2 + beta x where x > 0, else (exp(min(x, eps)) - 1 - x) a_n + beta x. NOTE: ONNX has no expm1; exp(m) - 1
    differs from it by float32 rounding only (under 1e-7 of the result where m is near 0)."""
    scalars = {k: float(tensor(k).reshape(())) for k in XIELU_PARAMETERS}
    beta, eps = scalars["beta"], scalars["eps"]
    a_p, a_n = _softplus(scalars["alpha_p"]), beta + _softplus(scalars["alpha_n"])
    c = {k: g.const(np.array(v, np.float32), f"xielu_{k}") for k, v in
         (("a_p", a_p), ("a_n", a_n), ("beta", beta), ("eps", eps), ("one", 1.0), ("zero", 0.0))}
    linear = g.op("Mul", [x, c["beta"]], name=name + "xielu_linear")
    positive = g.op("Add", [g.op("Mul", [g.op("Mul", [x, x]), c["a_p"]]), linear], name=name + "xielu_positive")
    expm1 = g.op("Sub", [g.op("Exp", [g.op("Min", [x, c["eps"]])]), c["one"]], name=name + "xielu_expm1")
    negative = g.op("Add", [g.op("Mul", [g.op("Sub", [expm1, x]), c["a_n"]]), linear], name=name + "xielu_negative")
    return g.op("Where", [g.op("Greater", [x, c["zero"]]), positive, negative], name=name + "xielu")


def activation(g: GraphBuilder, config: ModelConfig, x: str, name: str,
               tensor: Callable[[str], np.ndarray] | None = None) -> str:
    """act(x) of an MLP without a gate: relu(x)^2, gelu_tanh(x), silu(x), or xIELU with its layer's scalars
    (`tensor(name)`: the layer's `mlp.act.{name}`)."""
    if config.hidden_act == "xielu" and tensor is not None:
        return xielu(g, x, tensor, name)
    if config.hidden_act == "relu2":
        relu = g.op("Relu", [x], name=name + "relu")
        return g.op("Mul", [relu, relu], name=name + "relu2")
    if config.hidden_act == "gelu_pytorch_tanh":
        return g.op("Gelu", [x], approximate="tanh", name=name + "gelu")
    if config.hidden_act == "silu":
        return g.op("Mul", [x, g.op("Sigmoid", [x])], name=name + "silu")
    raise ValueError(f"hidden_act {config.hidden_act!r} has no form without a gate")
