"""A mixture of experts' MLP block in the network (builder/network.py): router, experts, shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trtbuild.builder.graph import GraphBuilder
from trtbuild.builder.moe_experts import Experts
from trtbuild.builder.tensor_parallel import TensorParallel
from trtbuild.configs import ModelConfig


class ExpertsWriter:
    """The experts part of _NetworkWriter (which sets these attributes and defines `linear`, `mlp` and `tensor`)."""

    c: ModelConfig
    g: GraphBuilder
    moe: Experts
    tp: TensorParallel

    if TYPE_CHECKING:
        def linear(self, x: str, prefix: str, bias: bool = False, outputs: list[str] | None = None) -> str: ...

        def mlp(self, h: str, layer: str, module: str = "mlp.", reduce: bool = True) -> str: ...

        def tensor(self, name: str) -> np.ndarray: ...

    def experts(self, h: str, layer: str) -> str:
        """A mixture of experts' MLP: the router's logits, then the experts (builder/moe_experts.py), plus the shared
        expert: Qwen2-MoE's scaled by the sigmoid of its gate's logit, Granite 4.0's and AFMoE's as it is."""
        prefix, g = layer + "mlp.", self.g
        logits = self.linear(h, prefix + "router", bias=self.c.moe_bias)
        name = prefix + "router.selection_bias"  # LFM2-MoE's, AFMoE's: sigmoid scores rank with it
        bias = g.weight(name, self.tensor(name)) if self.c.moe_selection_bias else None
        y = self.moe.emit(h, logits, prefix, bias)
        if self.c.shared_expert_intermediate_size:
            shared = self.mlp(h, layer, "mlp.shared.", reduce=False)
            if self.c.shared_expert_gated:
                scale = g.op("Sigmoid", [self.linear(h, prefix + "shared_gate")], name=prefix + "shared_scale")
                shared = g.op("Mul", [shared, scale], name=prefix + "shared_scaled")
            y = g.op("Add", [y, shared], name=prefix + "with_shared")
        return self.tp.all_reduce(g, y, prefix + "experts_allreduce")
