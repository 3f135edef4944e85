"""The contract of `trtbuild::SwiGLU` (documented in plugins/README.md) and its numpy reference.

    SwiGLU(x float [..., 2F]) -> y float [..., F] = silu(x[..., :F]) * x[..., F:],  silu(g) = g / (1 + e^-g)

x is the fused gate/up linear's output (builder/passes/fuse_gemms.py: gate columns first); the CPU lowering
(builder/native_swiglu.py) puts it in place of Split -> Sigmoid -> Mul -> Mul.
"""

from __future__ import annotations

import numpy as np

DOMAIN = "trtbuild"
OP_TYPE = "SwiGLU"


def reference_swiglu(x: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up
