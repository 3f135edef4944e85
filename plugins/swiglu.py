"""The contracts of `trtbuild::SwiGLU` and `trtbuild::GeGLU` (documented in plugins/README.md) and their numpy
references.

    SwiGLU(x float [..., 2F]) -> y float [..., F] = silu(x[..., :F]) * x[..., F:],       silu(g) = g / (1 + e^-g)
    GeGLU(x float [..., 2F])  -> y float [..., F] = gelu_tanh(x[..., :F]) * x[..., F:],
        gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))   (ONNX Gelu with approximate="tanh")

x is the fused gate/up linear's output (builder/passes/fuse_gemms.py: gate columns first); the CPU lowering
(builder/native_swiglu.py) puts SwiGLU in place of Split -> Sigmoid -> Mul -> Mul, and GeGLU in place of
Split -> Gelu(approximate="tanh") -> Mul (Gemma's MLP).
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "SwiGLU"
GEGLU_OP_TYPE = "GeGLU"


def reference_swiglu(x: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def gelu_tanh(g: np.ndarray) -> np.ndarray:
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def reference_geglu(x: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gelu_tanh(gate) * up
