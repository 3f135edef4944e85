"""The fused ONNX graph -> the CUDA target's execution plan: a list of steps (kernel, inputs, outputs, attributes)
and the weights they read, pre-packed for the GPU (layout and dtype), run by runtime/cuda_engine.py.

Each node maps to one kernel (gpu_kernels/ for the Triton ones, torch for the rest):
  Gather(table, ids)                      embedding            torch index_select
  Gather(activation, rows)                gather_rows          torch index_select
  RMSNormalization                        rmsnorm              gpu_kernels/rmsnorm.py (no residual)
  SkipSimplifiedLayerNormalization        add_rmsnorm          gpu_kernels/rmsnorm.py (residual add + RMSNorm)
  LayerNormalization (weight[, bias])     layernorm            torch (Cohere's and StarCoder 2's norms)
  MatMul / Gemm(transB) on a constant     linear               torch (cuBLAS): weight stored [out, in]
  MatMulNBits (weight-only int8/int4)     weight_only_linear   gpu_kernels/weight_only_gemm.py on the checkpoint codes
  MatMul(x, DequantizeLinear(W)), with    weight_only_linear,  trtbuild quantize's formats (int4_awq, int8_sq, fp8,
  Q/DQ on x for int8_sq and fp8           int8_linear,         an int8 lm_head): builder/cuda_plan_quant.py
                                          fp8_linear
  Mul / Div / Max / Min / Sub / Greater / mul, div, maximum,   torch (int4_awq's prequant, a per-token int8 scale,
  Where (a constant operand as a weight)  minimum, sub, ...    Apertus's xIELU)
  ReduceMax, ReduceSum (constant axes)    reduce_max, ...      torch (a per-token int8 scale, a sigmoid router's sum)
  Split -> silu(gate) * up (fused gate|up) swiglu              gpu_kernels/swiglu.py on the Split's input
  silu(gate) * up (separate GEMMs)        silu_mul             torch (weight-only gate and up stay two GEMMs)
  Split -> Gelu(gate, tanh) * up (fused)  geglu                gpu_kernels/swiglu.py (Gemma's MLP)
  Gelu(gate) * up (otherwise)             gelu_mul             torch, with the Gelu's approximate
  Gelu, Tanh, Relu, Sigmoid, Log, Exp,    gelu, tanh, relu,    torch (Relu, then Mul(x, x): Arcee's relu^2;
  Abs (alone)                             sigmoid, log, ...    Sigmoid: Qwen2-MoE's shared-expert gate)
  TopK, GatherElements, ScatterElements,  topk, ...,           torch: a sigmoid router's ops (LFM2-MoE, AFMoE)
  Expand(constant, Shape(x))              full_like
  Mul(x, constant scalar)                 scale                torch (embedding and residual multipliers, logits
                                                               scaling; with Tanh, the soft-cap c2 * tanh(c1 * x))
  Add, Split, Reshape                     add, split, reshape  torch
  trtbuild::PagedAttention                paged_attention      gpu_kernels/paged_attention.py, then kv_write: this
                                                               layer's K/V scattered into the pool (torch; an int8
                                                               pool: round(x / scale) clipped to +-127); the
                                                               sinks (a constant) are the last input, attr sinks
  trtbuild::PagedShortConv                short_conv           gpu_kernels/short_conv.py (LFM2), then conv_write:
                                                               the step's rows over the layer's slots (torch)
  trtbuild::GatedDeltaNet,                gated_delta,         gpu_kernels/recurrent.py: a scan per (sequence, head),
  trtbuild::Mamba2Scan                    mamba2_scan          its state in the engine's recurrent_state (Qwen3.5,
                                                               Granite 4.0-H, Nemotron-H), the gated norm in torch
  com.microsoft::MoE (SwiGLU experts)     moe                  gpu_kernels/fused_moe.py: routing and per-expert tiles
                                                               in torch, a grouped GEMM per projection
  trtbuild::SpeculativeAccept             speculative_accept   gpu_kernels/speculative_accept.py on the lm_head rows
                                                               (draft-tokens engines: plan inputs and outputs
                                                               gain the op's, as builder/network.py describes)
The network's `new_kv` output (Concat + Reshape of every layer's K/V) is dropped: the engine writes each layer's K/V
into its pool on the device instead of returning them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from trtbuild.builder.cuda_plan_quant import QuantizedSteps, find_quantized_linears
from trtbuild.builder.graph import MS_DOMAIN, GraphView, other_input
from trtbuild.builder.network import ACCEPT_INPUTS
from trtbuild.configs import LORA_IDS_INPUT
from trtbuild.errors import TrtbuildError
from trtbuild.plugins import gated_delta as gd
from trtbuild.plugins import mamba2
from trtbuild.plugins import paged_attention as pa
from trtbuild.plugins import short_conv as sc
from trtbuild.plugins import speculative_accept as sa

PLAN_FORMAT = 1
# ONNX elementwise ops of two operands -> their plan kernels (runtime/cuda_plan_ops.py)
ELEMENTWISE = {"Mul": "mul", "Div": "div", "Max": "maximum", "Min": "minimum", "Sub": "sub", "Greater": "greater",
               "Where": "where"}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# what the engine feeds the plan each step (the CPU engine's inputs, less the pool, plus where new K/V go); an engine
# of several KV cache groups adds each other group's block_tables_<g> and slot_mapping_<g>
PLAN_INPUTS = ("input_ids", "position_ids", "query_start_loc", "past_lengths", "block_tables", "logits_indices",
               "slot_mapping")


@dataclass(frozen=True)
class PlanStep:
    kernel: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    dtype: str  # compute dtype of weights, activations and the KV pool
    steps: tuple[PlanStep, ...]
    outputs: tuple[str, ...] = ("logits",)
    inputs: tuple[str, ...] = PLAN_INPUTS  # what the engine feeds each step

    def to_json(self) -> str:
        doc = {"plan_format": PLAN_FORMAT, "dtype": self.dtype, "inputs": list(self.inputs),
               "outputs": list(self.outputs), "steps": [asdict(s) for s in self.steps]}
        return json.dumps(doc, indent=1) + "\n"

    @classmethod
    def load(cls, path: Path) -> Plan:
        doc = json.loads(Path(path).read_text())
        if doc.get("plan_format") != PLAN_FORMAT:
            raise ValueError(f"plan format {doc.get('plan_format')!r}, expected {PLAN_FORMAT}")
        steps = tuple(PlanStep(s["kernel"], s["name"], tuple(s["inputs"]), tuple(s["outputs"]), s.get("attrs", {}))
                      for s in doc["steps"])
        return cls(doc["dtype"], steps, tuple(doc["outputs"]), tuple(doc.get("inputs", PLAN_INPUTS)))


def _snake(op_type: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in op_type).lstrip("_")


def _gate_rows_first(fused: np.ndarray) -> np.ndarray:
    """[E, 2I, ...] with gate j in row 2j and up j in row 2j + 1 -> [E, 2I, ...] with the I gate rows first."""
    e, two_i = fused.shape[:2]
    return fused.reshape(e, two_i // 2, 2, *fused.shape[2:]).swapaxes(1, 2).reshape(fused.shape)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else (list(v) if isinstance(v, list | tuple) else v)
    return out


class _PlanWriter(QuantizedSteps):
    def __init__(self, model: onnx.ModelProto, dtype: str) -> None:
        self.view, self.dtype = GraphView(model), TORCH_DTYPES[dtype]
        self.steps: list[PlanStep] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.skip: set[str] = set()  # node names folded into an earlier step
        # plan inputs beyond PLAN_INPUTS: block tables and slot mappings of KV cache groups after the first, the
        # recurrent layers' state slots
        self.group_inputs: set[str] = set()

    def weight(self, name: str, value: np.ndarray, dtype: torch.dtype | None = None, key: str | None = None) -> str:
        key = key or name
        if key not in self.weights:
            t = torch.from_numpy(np.array(value, copy=True, order="C"))
            self.weights[key] = t.to(dtype or self.dtype).contiguous() if t.is_floating_point() else t.contiguous()
        return key

    def const(self, name: str) -> np.ndarray:
        value = self.view.constant(name)
        if value is None:
            raise TrtbuildError(f"the cuda plan needs {name} to be a constant")
        return value

    def emit(self, kernel: str, node: onnx.NodeProto, inputs: list[str], outputs: list[str], **attrs) -> None:
        self.steps.append(PlanStep(kernel, node.name, tuple(inputs), tuple(outputs), attrs))

    def find_glus(self) -> dict[str, tuple[str, list[str], dict[str, Any]]]:
        """Final Mul of act(gate) * up -> (kernel, inputs, attributes). silu (Sigmoid and Mul): ("swiglu", [gate|up])
        when gate and up are the two halves of the fused gate|up GEMM's Split (the Split is skipped too), else
        ("silu_mul", [gate, up]). Gelu: ("geglu", [gate|up]) likewise when its approximate is "tanh" (the kernel's
        form), else ("gelu_mul", [gate, up], approximate)."""
        v, found = self.view, {}
        for act in [n for n in v.graph.node if n.op_type in ("Sigmoid", "Gelu") and n.domain in ("", "ai.onnx")]:
            gate = act.input[0]
            users = v.consumers.get(gate, [])
            if act.op_type == "Sigmoid":
                inner = next((n for n in users if n.op_type == "Mul" and set(n.input) == {gate, act.output[0]}),
                             None)
                if inner is None or len(users) != 2:
                    continue
                nodes, out = {act.name, inner.name}, inner.output[0]
            else:
                if len(users) != 1:
                    continue
                nodes, out = {act.name}, act.output[0]
            final = v.consumers.get(out, [])
            if len(final) != 1 or final[0].op_type != "Mul" or out in v.graph_outputs:
                continue
            up = next((i for i in final[0].input if i != out), None)
            split = v.producer.get(gate)
            fused = (split is not None and split.op_type == "Split" and list(split.output) == [gate, up]
                     and len(v.consumers.get(up, [])) == 1)
            approximate = _attrs(act).get("approximate", "none")
            if act.op_type == "Sigmoid":
                found[final[0].name] = ("swiglu", [split.input[0]], {}) if fused else ("silu_mul", [gate, up], {})
            elif fused and approximate == "tanh":
                found[final[0].name] = ("geglu", [split.input[0]], {})
            else:
                fused = False
                found[final[0].name] = ("gelu_mul", [gate, up], {"approximate": approximate})
            self.skip.update(nodes | ({split.name} if fused else set()))
        return found

    def scalar(self, name: str) -> float | None:
        """The value of a float initializer of one element (a scalar or [1]), else None."""
        value = self.view.constant(name) if name in self.view.initializers else None
        if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            return None
        return float(value.reshape(()))

    def node(self, n: onnx.NodeProto) -> None:
        v, op, a = self.view, n.op_type, _attrs(n)
        if op == "Gather" and a.get("axis", 0) == 0:
            table = v.constant(n.input[0]) if n.input[0] in v.initializers else None
            if table is not None:
                self.emit("embedding", n, [self.weight(n.input[0], table), n.input[1]], list(n.output))
            else:
                self.emit("gather_rows", n, list(n.input), list(n.output))
        elif op == "GatherBlockQuantized":
            self.emit("embedding", n, [self.weight(n.name + ".table", self.dequantized_table(n, a)), n.input[1]],
                      list(n.output))
        elif op == "RMSNormalization" and a.get("axis", -1) == -1:
            self.emit("rmsnorm", n, [n.input[0], self.weight(n.input[1], self.const(n.input[1]))], list(n.output),
                      eps=float(a.get("epsilon", 1e-5)))
        elif op == "LayerNormalization" and a.get("axis", -1) == -1 and all(i in v.initializers for i in n.input[1:]):
            self.emit("layernorm", n, [n.input[0], *(self.weight(i, self.const(i)) for i in n.input[1:])],
                      [n.output[0]], eps=float(a.get("epsilon", 1e-5)))
        elif op == "SkipSimplifiedLayerNormalization":
            self.emit("add_rmsnorm", n, [n.input[0], n.input[1], self.weight(n.input[2], self.const(n.input[2]))],
                      [n.output[0], n.output[3]], eps=float(a.get("epsilon", 1e-5)))
        elif op == "MatMul" and n.name in self.quantized:
            self.quantized_linear(n)
        elif op == "MatMul" and n.input[1] in v.initializers:  # [in, out] -> [out, in], as cuBLAS reads x @ W^T
            w = self.const(n.input[1])
            self.emit("linear", n, [n.input[0], self.weight(n.input[1], w.T)], list(n.output))
        elif op == "Gemm" and n.input[1] in v.initializers and a.get("transB") == 1 and len(n.input) == 2:
            self.emit("linear", n, [n.input[0], self.weight(n.input[1], self.const(n.input[1]))], list(n.output))
        elif op == "MatMulNBits":
            self.weight_only(n, a)
        elif op == "Add":
            inputs = [self.weight(i, self.const(i)) if i in v.initializers else i for i in n.input]
            self.emit("add", n, inputs, list(n.output))
        elif n.name in self.glus:
            kernel, inputs, attrs = self.glus[n.name]
            self.emit(kernel, n, inputs, list(n.output), **attrs)
        elif op == "Mul" and len(scalars := [i for i in n.input if self.scalar(i) is not None]) == 1:
            self.emit("scale", n, [other_input(n, scalars[0])], list(n.output), value=self.scalar(scalars[0]))
        elif op in ELEMENTWISE:  # a constant operand (int4_awq's prequant, xIELU's scalars) as a weight
            inputs = [self.weight(i, self.const(i), torch.float32) if i in v.initializers else i for i in n.input]
            self.emit(ELEMENTWISE[op], n, inputs, list(n.output))
        elif op in ("ReduceMax", "ReduceSum") and len(n.input) == 2 and not a.get("noop_with_empty_axes"):
            self.emit(_snake(op), n, [n.input[0]], list(n.output), axes=self.const(n.input[1]).tolist(),
                      keepdims=bool(a.get("keepdims", 1)))
        elif op == "Concat":
            self.emit("concat", n, list(n.input), list(n.output), axis=int(a["axis"]))
        elif op == "Gelu" and n.domain in ("", "ai.onnx"):
            self.emit("gelu", n, [n.input[0]], list(n.output), approximate=a.get("approximate", "none"))
        elif op in ("Tanh", "Relu", "Sigmoid", "Log", "Exp", "Abs"):
            self.emit(op.lower(), n, [n.input[0]], list(n.output))
        elif op in ("TopK", "GatherElements", "ScatterElements", "Expand"):
            self.routing(n, a)
        elif op == "Shape" and all(c.op_type == "Expand" for c in v.consumers.get(n.output[0], [])):
            pass  # read by its Expands' full_like steps
        elif op == "Split":
            sizes = self.const(n.input[1]).tolist() if len(n.input) > 1 else None
            self.emit("split", n, [n.input[0]], list(n.output), sizes=sizes, axis=int(a.get("axis", 0)))
        elif op == "Reshape" and n.input[1] in v.initializers:
            self.emit("reshape", n, [n.input[0]], list(n.output), shape=self.const(n.input[1]).tolist())
        elif op == pa.OP_TYPE and n.domain == pa.DOMAIN:
            self.attention(n, a)
        elif op == sc.OP_TYPE and n.domain == sc.DOMAIN:
            self.short_conv(n, a)
        elif (op, n.domain) in ((gd.OP_TYPE, gd.DOMAIN), (mamba2.OP_TYPE, mamba2.DOMAIN)):
            self.recurrent(n, a)
        elif op == "MoE" and n.domain == MS_DOMAIN:
            self.experts(n, a)
        elif op == sa.OP_TYPE and n.domain == sa.DOMAIN:
            self.emit("speculative_accept", n, list(n.input), list(n.output))
        else:
            raise TrtbuildError(f"the cuda target has no kernel for {n.domain or 'ai.onnx'}::{op} (node {n.name}); "
                                "build this model for --target cpu")

    def attention(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        if a.get("kv_cache_quant_algo") not in (None, "int8"):
            raise TrtbuildError(f"{n.name}: a {a['kv_cache_quant_algo']} KV cache is not supported by the cuda "
                                "target yet (int8 is); build for --target cpu")
        kv_quant = {k: a[k] for k in ("kv_cache_quant_algo", "kv_cache_scale") if k in a}
        inputs = [n.input[pa.Q], n.input[pa.K], n.input[pa.V], "kv_cache", n.input[pa.BLOCK_TABLES],
                  n.input[pa.PAST_LENGTHS], n.input[pa.QUERY_START_LOC]]
        if a.get("rotary"):
            inputs += [n.input[pa.POSITION_IDS]] + [self.weight(n.input[i], self.const(n.input[i]), torch.float32)
                                                     for i in (pa.ROPE_COS, pa.ROPE_SIN)]
        keep = ("layer_idx", "num_heads", "num_kv_heads", "head_size", "scale", "tokens_per_block", "window", "softcap")
        attrs = {k: a[k] for k in keep if k in a} | kv_quant
        if sinks := pa.sinks_input(n.input):  # gpt-oss: the step's last input, float32 whatever the plan's dtype
            inputs.append(self.weight(sinks, self.const(sinks), torch.float32))
            attrs["sinks"] = True
        self.emit("paged_attention", n, inputs, list(n.output), **attrs)
        # NOTE: a KV cache group's K/V go to the slots of its own table
        slots = self.group_tables(n.input[pa.BLOCK_TABLES])
        self.steps.append(PlanStep("kv_write", n.name + "/kv_write", ("kv_cache", n.output[1], n.output[2], slots),
                                   (), {"layer_idx": a["layer_idx"], **kv_quant}))

    def routing(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        """The ops of a sigmoid router (builder/moe_experts.py: sigmoid_routing, LFM2-MoE), in torch: TopK,
        GatherElements, ScatterElements, and Expand of a constant to Shape(x) as `full_like` x."""
        op, v = n.op_type, self.view
        if op == "TopK" and a.get("largest", 1) == 1:
            self.emit("topk", n, [n.input[0]], list(n.output), k=int(self.const(n.input[1]).reshape(-1)[0]),
                      axis=int(a.get("axis", -1)))
        elif op in ("GatherElements", "ScatterElements") and a.get("reduction", "none") == "none":
            self.emit(_snake(op), n, list(n.input), list(n.output), axis=int(a.get("axis", 0)))
        elif op == "Expand" and (fill := self.scalar(n.input[0])) is not None and \
                (shape := v.producer.get(n.input[1])) is not None and shape.op_type == "Shape":
            self.emit("full_like", n, [shape.input[0]], list(n.output), value=fill)
        else:
            raise TrtbuildError(f"the cuda target has no kernel for {op} with {a} (node {n.name}); build this "
                                "model for --target cpu")

    def group_tables(self, table: str) -> str:
        """The slot mapping of a block table input; a KV cache group's own pair becomes plan inputs
        (configs/kv_groups.py: group_input)."""
        slots = table.replace("block_tables", "slot_mapping", 1)
        if table != "block_tables":
            self.group_inputs |= {table, slots}
        return slots

    def short_conv(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        """LFM2's convolution (gpu_kernels/short_conv.py) reads the pool, then `conv_write` stores this step's rows
        (the node's input x) over the layer's slots; its new_entries output is not needed (see new_kv_nodes)."""
        x, table = n.input[sc.X], n.input[sc.BLOCK_TABLES]
        inputs = [x, "kv_cache", table, n.input[sc.PAST_LENGTHS], n.input[sc.QUERY_START_LOC],
                  self.weight(n.input[sc.WEIGHT], self.const(n.input[sc.WEIGHT]), torch.float32)]
        if len(n.input) > sc.BIAS and n.input[sc.BIAS]:
            inputs.append(self.weight(n.input[sc.BIAS], self.const(n.input[sc.BIAS]), torch.float32))
        self.emit("short_conv", n, inputs, [n.output[0]], layer_idx=a["layer_idx"])
        self.steps.append(PlanStep("conv_write", n.name + "/conv_write", ("kv_cache", x, self.group_tables(table)),
                                   (), {"layer_idx": a["layer_idx"]}))

    def recurrent(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        """A gated DeltaNet or Mamba2 scan (gpu_kernels/recurrent.py) over the engine's `recurrent_state`, with the
        step's state slots a plan input; its per-head constants float32."""
        names = gd.INPUTS if n.op_type == gd.OP_TYPE else mamba2.INPUTS
        # NOTE: a node of an engine built before state_checkpoints has one input fewer
        inputs = [self.weight(i, self.const(i), torch.float32) if i in self.view.initializers else
                  "recurrent_state" if name == gd.STATE_INPUT else i
                  for name, i in zip(names[:len(n.input)], n.input, strict=True)]
        self.group_inputs |= {gd.STATE_SLOTS_INPUT, *(n.input[len(names) - 1:] if len(n.input) == len(names) else ())}
        keep = ("state_layer", "epsilon", "tiled", "num_groups")
        self.emit("gated_delta" if n.op_type == gd.OP_TYPE else "mamba2_scan", n, inputs, [n.output[0]],
                  **{k: a[k] for k in keep if k in a})

    def experts(self, n: onnx.NodeProto, a: dict[str, Any]) -> None:
        """ONNX Runtime's MoE (builder/moe_experts.py: the float form) as a `moe` step (gpu_kernels/fused_moe.py):
        its interleaved gate / up rows (swiglu_fusion 1: row 2j gate j, 2j + 1 up j) stored gate rows first, as the
        SwiGLU kernel reads them."""
        if a.get("activation_type") != "swiglu" or a.get("swiglu_fusion") != 1:
            raise TrtbuildError(f"{n.name}: the cuda target runs SwiGLU experts with fused gate / up rows, not "
                                f"{a.get('activation_type')} (swiglu_fusion {a.get('swiglu_fusion')})")
        gate_up, down = self.const(n.input[2]), self.const(n.input[4])
        experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
        inputs = [n.input[0], n.input[1], self.weight(n.input[2], _gate_rows_first(gate_up)),
                  self.weight(n.input[4], down)]
        if len(n.input) > 5 and n.input[5]:  # gpt-oss: both projections biased
            bias = self.const(n.input[3]).reshape(experts, 2 * inter)
            inputs += [self.weight(n.input[3], _gate_rows_first(bias)), self.weight(n.input[5], self.const(n.input[5]))]
        limit = a.get("swiglu_limit", float("inf"))
        self.emit("moe", n, inputs, list(n.output), k=int(a["k"]), normalize=bool(a.get("normalize_routing_weights")),
                  alpha=float(a.get("activation_alpha", 1.0)), beta=float(a.get("activation_beta", 0.0)),
                  limit=None if limit == float("inf") else float(limit))

    def new_kv_nodes(self) -> set[str]:
        """The Concat + Reshape that stack every layer's K/V into the `new_kv` output, and the Reshapes of the
        convolution layers' new_entries into it (not part of the plan: the steps write the pool themselves)."""
        reshape = self.view.producer.get("new_kv")
        if reshape is None:
            return set()
        concat = self.view.producer.get(reshape.input[0])
        nodes = {reshape.name} | ({concat.name} if concat is not None and concat.op_type == "Concat" else set())
        for conv in (n for n in self.view.graph.node if n.op_type == sc.OP_TYPE and n.domain == sc.DOMAIN):
            nodes |= {r.name for r in self.view.consumers.get(conv.output[1], []) if r.op_type == "Reshape"}
        return nodes

    def write(self) -> Plan:
        self.skip |= self.new_kv_nodes()
        self.quantized, absorbed = find_quantized_linears(self.view)
        self.skip |= absorbed
        self.glus = self.find_glus()
        for n in self.view.graph.node:
            if n.name not in self.skip:
                self.node(n)
        dtype = next(k for k, t in TORCH_DTYPES.items() if t == self.dtype)
        inputs = PLAN_INPUTS + tuple(sorted(self.group_inputs))
        if LORA_IDS_INPUT in {i.name for i in self.view.graph.input}:
            inputs += (LORA_IDS_INPUT,)
        if any(s.kernel == "speculative_accept" for s in self.steps):
            return Plan(dtype, tuple(self.steps), ("logits", *sa.OUTPUTS), inputs + ACCEPT_INPUTS)
        return Plan(dtype, tuple(self.steps), inputs=inputs)


def emit_plan(model: onnx.ModelProto, dtype: str) -> tuple[Plan, dict[str, torch.Tensor]]:
    """The plan of a fused graph and its weights (contiguous torch tensors in their GPU layout, on the CPU)."""
    writer = _PlanWriter(model, dtype)
    plan = writer.write()
    return plan, writer.weights
