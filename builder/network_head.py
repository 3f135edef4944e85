"""The network's head (builder/network.py): the LM head over the selected rows' final hidden states, its
transforms (Granite's logits scaling, Gemma 2's soft-cap), and a draft-tokens engine's accept op. Over several
tensor-parallel ranks each computes its vocabulary rows' logits, and they are all-gathered."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from onnx import TensorProto

from trtbuild.builder.graph import GraphBuilder
from trtbuild.builder.quantized import QuantizedLinears
from trtbuild.builder.tensor_parallel import TensorParallel
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.plugins import speculative_accept as sa


class HeadWriter:
    """The head's part of _NetworkWriter (which sets these attributes and defines `linear` and `tensor`)."""

    c: ModelConfig
    build: BuildConfig
    g: GraphBuilder
    tp: TensorParallel
    tensors: Mapping[str, torch.Tensor]
    quant: QuantizedLinears
    vocab_rows: int

    if TYPE_CHECKING:
        def linear(self, x: str, prefix: str, bias: bool = False, outputs: list[str] | None = None) -> str: ...

        def tensor(self, name: str) -> np.ndarray: ...

    def head(self, h: str) -> None:
        """The logits of the selected rows' final hidden states `h`: the LM head, its transforms, and the accept op
        of a draft-tokens engine."""
        logits = "all_logits" if self.build.draft_tokens else "logits"
        transforms = self.logit_transforms()  # the last one writes the logits themselves
        y = "head_logits" if transforms else logits
        self.lm_head(h, y)
        for i, transform in enumerate(transforms):
            y = transform(y, [logits] if i == len(transforms) - 1 else None)
        if self.build.draft_tokens:
            self.accept("all_logits")

    def logit_transforms(self) -> list[Callable[[str, list[str] | None], str]]:
        """What the lm_head's output goes through, in order: Granite's division by logits_scaling (as a product),
        Gemma 2's soft-cap cap * tanh(x / cap). Each takes its input and, for the last, the graph output to write."""
        c, g = self.c, self.g

        def scale(x: str, value: float, name: str, outputs: list[str] | None) -> str:
            return g.op("Mul", [x, g.const(np.array(value, np.float32), name + "_factor")], name=name, outputs=outputs)

        out = []
        if c.logits_scaling != 1.0:
            out.append(lambda x, o: scale(x, 1.0 / c.logits_scaling, "logits_scaled", o))
        if cap := c.final_logit_softcapping:
            out.append(lambda x, o: scale(g.op("Tanh", [scale(x, 1.0 / cap, "logits_over_cap", None)]), cap,
                                          "logits_softcapped", o))
        return out

    def lm_head(self, h: str, out: str) -> None:
        """logits = h @ lm_head^T. A tied, unquantized head reads the embedding table itself (Gemm with transB), so
        the engine holds the [vocab, hidden] matrix once instead of twice. Over several ranks, each computes its
        rows' logits and they are all-gathered."""
        if self.tp.size > 1:
            local = "lm_head_local"
            self.local_lm_head(h, local)
            self.tp.gather_logits(self.g, local, self.c.vocab_size, self.vocab_rows, out)
        else:
            self.local_lm_head(h, out)

    def local_lm_head(self, h: str, out: str) -> None:
        embedding, head = self.tensors["transformer.vocab_embedding.weight"], self.tensors["lm_head.weight"]
        tied = (self.c.tie_word_embeddings and not self.quant.is_quantized("lm_head")
                and not self.c.quantization.embedding_weight_only and torch.equal(embedding, head))
        if tied:
            self.g.op("Gemm", [h, "transformer.vocab_embedding.weight"], transB=1, name="lm_head", outputs=[out])
        elif not self.quant.is_quantized("lm_head"):  # NOTE: as stored, [vocab, hidden]: no transposed copy
            w = self.g.weight("lm_head.weight", self.tensor("lm_head.weight"))
            self.g.op("Gemm", [h, w], transB=1, name="lm_head", outputs=[out])
        else:
            self.linear(h, "lm_head", outputs=[out])

    def accept(self, all_logits: str) -> None:
        """The accept step (draft-tokens mode): SpeculativeAccept over the N rows, and the rows still wanted out."""
        g, k = self.g, self.build.max_draft_len
        i64, f64 = TensorProto.INT64, TensorProto.DOUBLE
        out_rows = g.input("logits_out_rows", i64, ["num_logits_out"])
        inputs = [g.input("accept_rows", i64, ["num_accepting"]), g.input("draft_tokens", i64, ["num_accepting", k]),
                  g.input("draft_lens", i64, ["num_accepting"]), g.input("temperatures", f64, ["num_accepting"]),
                  g.input("uniforms", f64, ["num_accepting", k + 1])]
        g.op(sa.OP_TYPE, [all_logits] + inputs, domain=sa.DOMAIN, name="speculative_accept", outputs=list(sa.OUTPUTS),
             max_draft_len=k)
        g.op("Gather", [all_logits, out_rows], axis=0, name="logits_out", outputs=["logits"])
