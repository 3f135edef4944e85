"""The contracts of `trtbuild::SwiGLU` and `trtbuild::GeGLU` (documented in plugins/README.md) and their numpy
references.

    SwiGLU(x float [..., 2F]) -> y float [..., F] = silu(x[..., :F]) * x[..., F:],       silu(g) = g / (1 + e^-g)
    GeGLU(x float [..., 2F])  -> y float [..., F] = gelu_tanh(x[..., :F]) * x[..., F:],
        gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))   (ONNX Gelu with approximate="tanh")

SwiGLU's optional attributes `alpha`, `beta` and `limit` give gpt-oss's clamped form (ONNX Runtime's com.microsoft
MoE calls them activation_alpha, activation_beta and swiglu_limit): with g' = min(g, limit) and u' = clamp(u, -limit,
limit), y = g' * sigmoid(alpha * g') * (u' + beta); the defaults (1, 0, no limit) are plain SwiGLU.

x is the fused gate/up linear's output (builder/passes/fuse_gemms.py: gate columns first); the CPU lowering
(builder/native_swiglu.py) puts SwiGLU in place of Split -> Sigmoid -> Mul -> Mul, and GeGLU in place of
Split -> Gelu(approximate="tanh") -> Mul (Gemma's MLP).
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "SwiGLU"
GEGLU_OP_TYPE = "GeGLU"
# SwiGLU's optional float attributes, and gpt-oss's values of them (its experts' activation)
ALPHA, BETA, LIMIT = "alpha", "beta", "limit"
GPT_OSS_SWIGLU = {ALPHA: 1.702, BETA: 1.0, LIMIT: 7.0}


def reference_swiglu(x: np.ndarray, alpha: float = 1.0, beta: float = 0.0, limit: float | None = None) -> np.ndarray:
    """silu(gate) * up in float64; with `alpha`, `beta` and `limit` the clamped form the module docstring gives."""
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    if limit is not None:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return gate / (1.0 + np.exp(-alpha * gate)) * (up + beta)


def gelu_tanh(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def reference_geglu(x: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gelu_tanh(gate) * up
