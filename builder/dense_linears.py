"""The CPU lowering of unquantized linears onto trtbuild::DenseMatMul (cpu_ops/dense_matmul.cc): weights held in
the narrowest float type that holds them exactly, packed 16 rows interleaved (plugins/dense_matmul.py).

The network computes in float32, so a float16 or bfloat16 checkpoint (and a GGUF's F16 / BF16 tensors) reaches
this pass as float32 initializers whose values are all exact in 16 bits. Each MatMul (weights [K, N]) and Gemm
(transB, no bias: the lm_head, [N, K]) becomes a DenseMatMul over a packed copy in float16 where every value is
exact in it, else bfloat16, else float32; a Gather of such a table (the embedding) becomes a DenseGather, reading
the lm_head's copy when the two are tied. Converting back to float32 in the kernel is exact, so the engine computes
what MatMul did, from half the bytes where the weights came in 16 bits: batch-1 decode reads every weight once per
token, and so does llama.cpp from an F16 file. Float32 weights (an F32 checkpoint, a folded SmoothQuant scale) keep
their bytes: the kernel's 16-row streams still decode faster than MLAS's SGEMM and run long steps at its rate
(benchmarks/dense_linear.py), with AVX-512. With AVX2 only (`sixteen_bit_only`), the kernel wins where it reads half
the bytes, and MLAS's SGEMM runs float32 weights faster from 16 tokens on: such tables stay MatMuls there.
"""

from __future__ import annotations

import numpy as np
import onnx

from trtbuild.builder.graph import GraphView, node_attrs, use_opset
from trtbuild.builder.weight_file import make_initializer
from trtbuild.plugins import dense_matmul as dm


def _float_matrix(view: GraphView, name: str) -> bool:
    t = view.initializers.get(name)
    return t is not None and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2


def _weights(view: GraphView, node: onnx.NodeProto) -> tuple[str, bool] | None:
    """(table initializer, whether it is stored [K, N] and needs a transpose) of a linear this pass may rewrite."""
    if node.domain not in ("", "ai.onnx") or len(node.input) != 2 or not _float_matrix(view, node.input[1]):
        return None
    if node.op_type == "MatMul":
        return node.input[1], True
    a = node_attrs(node)
    if node.op_type == "Gemm" and a.get("transB") == 1 and not a.get("transA") and \
            a.get("alpha", 1.0) == 1.0 and a.get("beta", 1.0) == 1.0:
        return node.input[1], False
    return None


def _gathered_table(view: GraphView, node: onnx.NodeProto) -> tuple[str, bool] | None:
    """(table initializer, False: rows as stored) of a Gather this pass may rewrite."""
    if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and node_attrs(node).get("axis", 0) == 0 and \
            _float_matrix(view, node.input[0]):
        return node.input[0], False
    return None


class DenseLinears:
    """Rewrites the linears (and embedding gathers) over float32 initializers, in place; with `sixteen_bit_only`,
    only those whose weights are exact in 16 bits. Packs each table once however many graph copies it lowers (the
    autotuner lowers one per candidate)."""

    def __init__(self, sixteen_bit_only: bool = False) -> None:
        self.sixteen_bit_only = sixteen_bit_only
        # (initializer, transposed) -> (packed initializer, N, K)
        self._packed: dict[tuple[str, bool], tuple[onnx.TensorProto, int, int]] = {}
        self._weight_types: dict[str, str] = {}  # initializer -> dm.exact_type of its values

    def _weight_type(self, view: GraphView, name: str) -> str:
        if name not in self._weight_types:
            self._weight_types[name] = dm.exact_type(view.constant(name))
        return self._weight_types[name]

    def _takes(self, view: GraphView, found: tuple[str, bool] | None) -> bool:
        return found is not None and (not self.sixteen_bit_only or self._weight_type(view, found[0]) != "float32")

    def _pack(self, view: GraphView, name: str, transposed: bool) -> tuple[onnx.TensorProto, int, int]:
        """The packed table of initializer `name` (staged like it, not yet in any graph), N and K."""
        key = (name, transposed)
        if key not in self._packed:
            w = view.constant(name)
            w = np.ascontiguousarray(w.T) if transposed else w
            packed = make_initializer(view.staging, f"{name}.dense{'_t' if transposed else ''}",
                                      dm.pack(w, self._weight_type(view, name)))
            self._packed[key] = (packed, *w.shape)
        return self._packed[key]

    def count(self, model: onnx.ModelProto) -> int:
        """How many linears and gathers of `model` this pass would rewrite."""
        view = GraphView(model)
        return sum(self._takes(view, _weights(view, node) or _gathered_table(view, node)) for node in model.graph.node)

    def lower(self, model: onnx.ModelProto) -> int:
        """Replace the eligible linears and gathers of `model`; returns how many linears."""
        view = GraphView(model)
        linears = 0
        for node in model.graph.node:
            if self._takes(view, found := _weights(view, node)):
                _become(view, node, dm.OP_TYPE, node.input[0], *self._pack(view, *found))
                linears += 1
            elif self._takes(view, table := _gathered_table(view, node)):
                # NOTE: a table a Gemm also reads is [N, K] as the gather's: the same packed copy serves both
                _become(view, node, dm.GATHER_OP_TYPE, node.input[1], *self._pack(view, *table))
        if any(n.domain == dm.DOMAIN and n.op_type in (dm.OP_TYPE, dm.GATHER_OP_TYPE) for n in model.graph.node):
            view.drop_unused_initializers()
            use_opset(model, dm.DOMAIN)
        return linears


def _become(view: GraphView, node: onnx.NodeProto, op_type: str, first: str, table: onnx.TensorProto, n: int,
            k: int) -> None:
    """Turn `node` into the trtbuild op `op_type` over `first` and the packed `table` (added to the graph if it is
    not there yet)."""
    view.attach(table)
    del node.input[:]
    node.input.extend([first, table.name])
    del node.attribute[:]
    node.attribute.extend([onnx.helper.make_attribute("K", k), onnx.helper.make_attribute("N", n)])
    node.op_type, node.domain = op_type, dm.DOMAIN
