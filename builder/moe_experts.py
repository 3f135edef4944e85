"""A mixture of experts' experts in the network (builder/network.py: `experts`), in one of two forms:

- native (weight-only experts: a GGUF's as the file holds them, or `convert --weight-only`): trtbuild::MoERoute sorts
  the step's (token, chosen expert) pairs by expert; the tokens, gathered in that order, go through the stacked
  experts as tables of experts (trtbuild::BlockQuantMatMul with `experts`: each expert's run of rows multiplies its
  own rows of the table, packed as llama.cpp's blocks); trtbuild::SwiGLU between; each row is weighted by its
  routing weight and every token sums its k rows back in its own order.
- float: ONNX Runtime's MoE over float32 experts (softmax, top k, SwiGLU experts, weighted sum), weight-only ones
  dequantized: where the native ops cannot run (`--quant-linears ort`, no AVX-512 VNNI, no library).

Gate and up are one table of 2 x moe_intermediate rows per expert where their codes have one form, as their fused
SwiGLU reads them (gate | up); else two tables.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np
import torch

from trtbuild.builder.convert.weight_only import NBitsWeight
from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder
from trtbuild.builder.mlp_activation import gated_activation
from trtbuild.builder.native_linears import native_problem, pack_nbits
from trtbuild.builder.quantized import QuantizedLinears
from trtbuild.builder.weight_only_linear import nbits_inputs
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.plugins import block_quant_matmul as bq
from trtbuild.plugins import moe_route as mr
from trtbuild.plugins import swiglu as sw
from trtbuild.quantization import QuantAlgo

log = logging.getLogger(__name__)
PROJECTIONS = ("gate", "fc", "proj")  # the stacked experts' gate, up, down


def quantized_experts(config: ModelConfig) -> bool:
    """Whether the checkpoint holds weight-only experts (a GGUF's kept, or `convert --weight-only`)."""
    first = f"transformer.layers.{config.moe_dense_layers}.mlp.experts.gate"  # the first layer with experts
    return config.is_moe and config.quantization.algo_of(first) == QuantAlgo.WEIGHT_ONLY


def expert_parameters(config: ModelConfig) -> int:
    """Weights of every layer's experts (gate, up and down of each)."""
    layers = config.num_hidden_layers - config.moe_dense_layers
    return 3 * layers * config.num_experts * config.hidden_size * config.moe_intermediate_size


def resolve_expert_tactic(config: ModelConfig, build: BuildConfig) -> BuildConfig:
    """`build` with quant_linears decided before the network for weight-only experts, which the network writes in
    their final form: native where the native ops run here (auto), else ort (float experts, with a warning of their
    size); native asked for where they cannot run is a ConfigError, before any work."""
    from trtbuild.errors import ConfigError

    if not quantized_experts(config):
        return build
    problem = native_problem(build.int4_accuracy_level)
    if build.quant_linears == "native" and problem:
        raise ConfigError("quant_linears", f"native cannot be used: {problem}. Use --quant-linears ort.")
    chosen = build.quant_linears if build.quant_linears != "auto" else "ort" if problem else "native"
    if chosen == "ort":
        log.warning("experts: dequantized to float32 for ONNX Runtime's MoE, %.1f GB of them (%s)",
                    4 * expert_parameters(config) / 1e9, problem or "--quant-linears ort")
    return dataclasses.replace(build, quant_linears=chosen)


def sigmoid_routing(g: GraphBuilder, config: ModelConfig, logits: str, selection_bias: str | None,
                    prefix: str) -> tuple[str, str | None]:
    """(router logits, factor or None) that make the softmax routing of both expert forms route as a sigmoid router
    (LFM2-MoE): each token's experts are the top k of sigmoid(logit) (+ `selection_bias` [experts]), weighted by
    their sigmoids s, renormalized where moe_normalize_topk, times moe_routed_scale. The logits given are log(s) for
    the chosen experts and -1e30 for the others, so that the softmax over them is s / (the chosen s's sum) on the
    chosen and 0 elsewhere, and its top k are the chosen; the experts' output is then multiplied by the factor
    [tokens, 1] (or scalar): the scale, and the chosen s's sum where the weights are not renormalized.
    NOTE: transformers divides by (sum + 1e-6); this divides by the sum, 1e-6 / sum apart."""
    c, k = config, config.num_experts_per_tok
    scores = g.op("Sigmoid", [logits], name=prefix + "router_scores")
    ranked = g.op("Add", [scores, selection_bias], name=prefix + "router_ranked") if selection_bias else scores
    _, chosen = g.op("TopK", [ranked, g.const(np.array([k]), "topk")], num_outputs=2, axis=-1,
                     name=prefix + "router_topk")
    weights = g.op("GatherElements", [scores, chosen], axis=-1, name=prefix + "router_chosen")
    floor = g.op("Expand", [g.const(np.array(-1e30, np.float32), "unchosen_logit"), g.op("Shape", [logits])],
                 name=prefix + "router_floor")
    routed = g.op("ScatterElements", [floor, chosen, g.op("Log", [weights], name=prefix + "router_log")], axis=-1,
                  name=prefix + "router_logits")
    scale = g.const(np.array(c.moe_routed_scale, np.float32), "routed_scale")
    if c.moe_normalize_topk:
        return routed, scale if c.moe_routed_scale != 1.0 else None
    total = g.op("ReduceSum", [weights, g.const(np.array([-1]), "last_axis")], keepdims=1, name=prefix + "router_sum")
    return routed, g.op("Mul", [total, scale], name=prefix + "router_factor")


@dataclasses.dataclass(frozen=True)
class _Table:
    """One projection's weight-only tensors, [experts * rows, in] in MatMulNBits' form (builder/weight_only_linear.py:
    nbits_inputs), with a scale per block of `block` (a power of two from 16)."""

    codes: np.ndarray
    scales: np.ndarray  # [experts * rows, in / block]
    zero_points: np.ndarray | None
    bits: int
    block: int

    def form(self) -> tuple:
        return self.bits, self.block, self.zero_points is not None


class Experts:
    def __init__(self, g: GraphBuilder, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 quant: QuantizedLinears, native: bool) -> None:
        self.g, self.c, self.tensors, self.quant, self.native = g, config, tensors, quant, native
        if native:  # NOTE: the tables are packed here, not in the CPU lowering: in the layout this CPU reads fastest
            from trtbuild import cpu_ops

            self.high_bits = cpu_ops.high_bits_layout()

    def emit(self, h: str, logits: str, prefix: str, selection_bias: str | None = None) -> str:
        """The experts' output for the normalized hidden states `h` and the router's `logits` (`prefix`: the
        layer's `...mlp.`; `selection_bias`: the sigmoid router's, where it has one). A sigmoid router (moe_scoring)
        is MoERoute's sigmoid mode natively, and `sigmoid_routing` before ONNX Runtime's softmax MoE otherwise."""
        names = [f"{prefix}experts.{p}" for p in PROJECTIONS]
        if self.native and all(self.quant.is_quantized(n) for n in names):
            return self._native(h, logits, prefix, [self._table(n) for n in names], selection_bias)
        factor = None
        if self.c.moe_scoring == "sigmoid":
            logits, factor = sigmoid_routing(self.g, self.c, logits, selection_bias, prefix)
        y = self._float(h, logits, prefix, names)
        return y if factor is None else self.g.op("Mul", [y, factor], name=prefix + "experts_scaled")

    # ---- float ---------------------------------------------------------------------------------------------------
    def _float_weight(self, name: str) -> np.ndarray:
        """[experts, out, in] float32, a weight-only one dequantized."""
        c = self.c
        if self.quant.is_quantized(name):
            t = self._table(name)
            w = NBitsWeight(t.bits, t.block, t.codes, t.scales, t.zero_points).dequantize()
            return w.reshape(c.num_experts, -1, w.shape[-1])
        return self.tensors[name + ".weight"].to(torch.float32).numpy()

    def _bias(self, name: str) -> np.ndarray | None:
        """A projection's biases [experts, out] float32 (gpt-oss), or None."""
        return self.tensors[name + ".bias"].to(torch.float32).numpy() if self.c.moe_bias else None

    def _float(self, h: str, logits: str, prefix: str, names: list[str]) -> str:
        c, g = self.c, self.g
        gate, up, down = (self._float_weight(n) for n in names)
        # NOTE: ONNX Runtime's fused SwiGLU reads gate and up interleaved (swiglu_fusion 1): row 2j gate j, 2j + 1 up j
        gate_up = np.stack([gate, up], axis=2).reshape(c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size)
        inputs = [h, logits, g.weight(prefix + "experts.gate_up.weight", gate_up), "",
                  g.weight(prefix + "experts.proj.weight", down)]
        if c.moe_bias:
            gate_up_bias = np.stack([self._bias(names[0]), self._bias(names[1])], axis=2).reshape(c.num_experts, -1)
            inputs[3] = g.weight(prefix + "experts.gate_up.bias", gate_up_bias)
            inputs.append(g.weight(prefix + "experts.proj.bias", self._bias(names[2])))
        oai = c.hidden_act == "swiglu_oai"  # ONNX Runtime's MoE runs gpt-oss's clamped SwiGLU with these
        return g.op("MoE", inputs, domain=MS_DOMAIN, name=prefix + "experts",
                    k=c.num_experts_per_tok, normalize_routing_weights=int(c.moe_normalize_topk),
                    activation_type="swiglu", swiglu_fusion=1, activation_alpha=c.swiglu_alpha if oai else 1.0,
                    activation_beta=1.0 if oai else 0.0, swiglu_limit=c.swiglu_limit if oai else float("inf"))

    # ---- native --------------------------------------------------------------------------------------------------
    def _table(self, name: str) -> _Table:
        k = self.c.hidden_size if not name.endswith("proj") else self.c.moe_intermediate_size
        codes, scales, zero_points, layout = nbits_inputs(name, self.tensors, k)
        return _Table(codes.numpy(), scales, zero_points, layout.bits, layout.block_size)

    def _native(self, h: str, logits: str, prefix: str, tables: list[_Table], selection_bias: str | None) -> str:
        c, g = self.c, self.g
        sigmoid = {"sigmoid": 1, "scale": float(c.moe_routed_scale)} if c.moe_scoring == "sigmoid" else {}
        rows, weights, offsets, inverse = g.op(
            mr.OP_TYPE, [logits, *([selection_bias] if selection_bias else [])], num_outputs=4, domain=mr.DOMAIN,
            name=prefix + "route", k=c.num_experts_per_tok, normalize=int(c.moe_normalize_topk), **sigmoid)
        xs = g.op("Gather", [h, rows], axis=0, name=prefix + "expert_inputs")
        gate, up, down = tables
        if gate.form() == up.form():  # one table: each expert's gate rows, then its up rows
            both = _Table(*(None if a is None else np.concatenate([
                a.reshape(c.num_experts, c.moe_intermediate_size, -1), b.reshape(c.num_experts,
                                                                                  c.moe_intermediate_size, -1)],
                axis=1).reshape(2 * c.num_experts * c.moe_intermediate_size, -1)
                for a, b in ((gate.codes, up.codes), (gate.scales, up.scales), (gate.zero_points, up.zero_points))),
                gate.bits, gate.block)
            bias = None if not c.moe_bias else np.concatenate(
                [self._bias(prefix + "experts.gate"), self._bias(prefix + "experts.fc")], axis=1)
            gate_up = self._matmul(xs, both, offsets, prefix + "experts.gate_up", c.hidden_size, bias)
            act = g.op(sw.OP_TYPE, [gate_up], domain=sw.DOMAIN, name=prefix + "experts.swiglu", **self._swiglu_attrs())
        else:
            gate_out, up_out = (self._matmul(xs, t, offsets, prefix + f"experts.{p}", c.hidden_size,
                                             self._bias(prefix + f"experts.{p}"))
                                for t, p in ((gate, "gate"), (up, "fc")))
            act = gated_activation(g, c, gate_out, up_out, prefix + "experts.")
        out = self._matmul(act, down, offsets, prefix + "experts.proj", c.moe_intermediate_size,
                           self._bias(prefix + "experts.proj"))
        weighted = g.op("Mul", [out, weights], name=prefix + "experts.weighted")
        per_token = g.op("Reshape", [g.op("Gather", [weighted, inverse], axis=0, name=prefix + "experts.by_token"),
                                     g.const(np.array([-1, c.num_experts_per_tok, c.hidden_size]), "per_token")])
        return g.op("ReduceSum", [per_token, g.const(np.array([1]), "axis1")], keepdims=0, name=prefix + "experts")

    def _swiglu_attrs(self) -> dict[str, float]:
        c = self.c
        if c.hidden_act != "swiglu_oai":
            return {}
        return {sw.ALPHA: float(c.swiglu_alpha), sw.BETA: 1.0, sw.LIMIT: float(c.swiglu_limit)}

    def _matmul(self, x: str, t: _Table, offsets: str, name: str, k: int, bias: np.ndarray | None = None) -> str:
        """x's rows times their experts' rows of table `t` (a BlockQuantMatMul with `experts`), plus each expert's
        `bias` [experts, rows] where given."""
        n = t.codes.shape[0]
        block = min(t.block, bq.BLOCK)
        repeat = t.block // block  # NOTE: a block of 64 or 128 is 2 or 4 blocks of 32 with one scale: exact
        scales, zero_points = (None if a is None else np.repeat(a, repeat, axis=1) for a in (t.scales, t.zero_points))
        table, bits, codebook = pack_nbits(t.codes, scales, zero_points, n, k, t.bits, self.high_bits)
        inputs = [self.g.weight(f"{name}.bq_{field}", value) if value is not None else ""
                  for field, value in zip(bq.TABLE_FIELDS, table.tensors(), strict=True)]
        codes, scales_name, *optional = inputs
        attrs = {"K": k, "N": n, "bits": bits, "block_size": block, "experts": self.c.num_experts,
                 **({"codebook": list(codebook)} if codebook else {}), **table.attributes()}
        bias_name = self.g.weight(f"{name}.bias", bias.reshape(-1)) if bias is not None else ""
        return self.g.op(bq.OP_TYPE, [x, codes, scales_name, bias_name, *optional, offsets], domain=bq.DOMAIN,
                         name=name, **attrs)
