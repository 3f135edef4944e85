"""Tensor-parallel networks, as Megatron-LM splits a decoder and TensorRT-LLM builds it: one graph per rank, each over
its shard of the checkpoint (builder/convert/sharding.py), joined by collectives (cpu_ops/collectives.cc).

A rank holds 1/tp of the attention heads (its KV heads too) and of the MLP's (every expert's) features, and 1/tp of
the vocabulary's rows of the embedding table and the LM head. Column-parallel linears (q, k, v, gate, up) need
nothing; each row-parallel one (the attention's output projection, the MLP's down projection) gives a partial sum
that an AllReduce completes, its bias added once after it; a mixture of experts' routed and shared experts sum their
partial outputs first, and one AllReduce completes them (every rank routes every token alike). The embedding
gathers the rows this rank holds (zeros for the others' ids) and all-reduces them; the LM head's logit columns are
all-gathered and the vocabulary's padding cut. Every rank computes the whole residual stream, bit for bit the same
(the AllReduce adds in rank order).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto

from trtbuild.builder.graph import GraphBuilder
from trtbuild.configs import ModelConfig

TP_GROUP_INPUT = "tp_group"  # int64 [1]: the id of the shared-memory channel the ranks meet in (runtime)
DOMAIN = "trtbuild"
ALL_REDUCE, ALL_GATHER = "AllReduce", "AllGather"


def rank_config(config: ModelConfig) -> ModelConfig:
    """The model as one rank of its tensor-parallel split sees it: its share of the heads and of the MLP's and
    experts' features, checked divisible when the checkpoint was converted (the vocabulary's share, ceil(vocab / tp)
    rows, is the network's `vocab_rows`)."""
    tp = config.mapping.tp_size
    if tp == 1:
        return config
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                               num_key_value_heads=config.num_key_value_heads // tp,
                               intermediate_size=config.intermediate_size // tp,
                               moe_intermediate_size=config.moe_intermediate_size // tp,
                               shared_expert_intermediate_size=config.shared_expert_intermediate_size // tp)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The collectives of rank `rank` of `size` (size 1: none, every method returns its input)."""

    rank: int = 0
    size: int = 1

    def group_input(self, g: GraphBuilder) -> None:
        if self.size > 1:
            g.input(TP_GROUP_INPUT, TensorProto.INT64, [1])

    def _collective(self, g: GraphBuilder, op: str, x: str, name: str, outputs: list[str] | None) -> str:
        return g.op(op, [x, TP_GROUP_INPUT], domain=DOMAIN, name=name, outputs=outputs, rank=self.rank,
                    world_size=self.size)

    def all_reduce(self, g: GraphBuilder, x: str, name: str) -> str:
        return x if self.size == 1 else self._collective(g, ALL_REDUCE, x, name, None)

    def rms_norm(self, g: GraphBuilder, x: str, weight: str, width: int, epsilon: float, name: str) -> str:
        """RMSNorm of a vector split over the ranks (x [T, width / size], this rank's part): its squares summed on
        each rank, all-reduced, then x / sqrt(mean + epsilon) * weight (this rank's part of the weight)."""
        squares = g.op("ReduceSumSquare", [x, g.const(np.array([-1]), "last_axis")], keepdims=1, name=name + "_squares")
        total = self.all_reduce(g, squares, name + "_allreduce")
        mean = g.op("Div", [total, g.const(np.array(width, np.float32), "norm_width")], name=name + "_mean")
        inverse = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [mean, g.const(np.array(epsilon, np.float32),
                                                                                "norm_epsilon")])])],
                       name=name + "_inverse_rms")
        return g.op("Mul", [g.op("Mul", [x, inverse], name=name + "_normalized"), weight], name=name)

    def vocab_rows(self, g: GraphBuilder, ids: str, rows: int) -> tuple[str, str | None]:
        """(this rank's row of each id, clamped into its `rows` rows; [T, 1] float: 1 where the id is one of them,
        None on a single rank)."""
        if self.size == 1:
            return ids, None
        local = g.op("Sub", [ids, g.const(np.array(self.rank * rows, np.int64), "vocab_start")], name="vocab_local")
        held = g.op("And", [g.op("GreaterOrEqual", [local, g.const(np.array(0, np.int64), "zero_id")]),
                            g.op("Less", [local, g.const(np.array(rows, np.int64), "vocab_rows")])], name="vocab_held")
        clamped = g.op("Where", [held, local, g.const(np.array(0, np.int64), "zero_id")], name="vocab_rows_clamped")
        mask = g.op("Cast", [g.op("Unsqueeze", [held, g.const(np.array([1]), "axis1")])], to=TensorProto.FLOAT,
                    name="vocab_held_mask")
        return clamped, mask

    def gather_logits(self, g: GraphBuilder, local: str, vocab_size: int, rows: int, out: str) -> str:
        """[N, vocab_size] from each rank's [N, rows] logit columns (the last rank's padding cut)."""
        if self.size * rows == vocab_size:
            return self._collective(g, ALL_GATHER, local, "lm_head_gather", [out])
        full = self._collective(g, ALL_GATHER, local, "lm_head_gather", None)
        return g.op("Slice", [full, g.const(np.array([0]), "vocab_begin"), g.const(np.array([vocab_size]), "vocab_end"),
                              g.const(np.array([1]), "axis1")], name="lm_head_unpadded", outputs=[out])
