"""A small helper for writing ONNX graphs by hand, and a producer/consumer view that fusion passes rewrite."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from trtbuild.builder.weight_file import StagingWeights, is_external, make_initializer

OPSET = 23  # RMSNormalization and RotaryEmbedding are standard ONNX ops from opset 23
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    """Appends nodes and initializers; every node gets a unique, readable name under the current scope. With
    `staging`, large initializers go to that file as they are added (builder/weight_file.py), not into memory."""

    def __init__(self, staging: StagingWeights | None = None) -> None:
        self.staging = staging
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self.scope = ""

    def name(self, hint: str) -> str:
        return f"{self.scope}{hint}_{next(self._ids)}"

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def const(self, value: np.ndarray | float | int | list, hint: str = "const") -> str:
        return self.weight(self.name(hint), np.asarray(value))

    def weight(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(make_initializer(self.staging, name, value))
        return name

    def op(self, op_type: str, inputs: list[str], num_outputs: int = 1, domain: str = "", name: str | None = None,
           outputs: list[str] | None = None, **attrs) -> str | list[str]:
        node_name = name or self.name(op_type)
        outs = outputs or [f"{node_name}_out{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=node_name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def model(self, graph_name: str, extra_opsets: dict[str, int] | None = None) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, initializer=self.initializers)
        opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="trtbuild")
        model.ir_version = 10
        if self.staging is not None:
            self.staging.attach(model)
        return model


def node_attrs(node: onnx.NodeProto) -> dict:
    """A node's attributes as Python values."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def other_input(node: onnx.NodeProto, one: str) -> str | None:
    """The input of binary `node` that is not `one` (None unless `one` is exactly one of its two inputs)."""
    ins = list(node.input)
    return ins[1 - ins.index(one)] if len(ins) == 2 and ins.count(one) == 1 else None


def use_opset(model: onnx.ModelProto, domain: str) -> None:
    """Import `domain` (version 1: every custom domain here) unless the model does already."""
    if not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))


class GraphView:
    """Producer/consumer maps over a model's main graph; rebuild after each structural rewrite."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.graph = model.graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in node.input:
                if i:
                    self.consumers[i].append(node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.graph_outputs = {o.name for o in self.graph.output}
        self.staging = StagingWeights.of(model)

    def constant(self, name: str) -> np.ndarray | None:
        """The values of initializer `name` (read from the staging file when it lives there), or None."""
        t = self.initializers.get(name)
        if t is None:
            return None
        return self.staging.read(t) if is_external(t) else numpy_helper.to_array(t)

    def only_consumer(self, tensor: str) -> onnx.NodeProto | None:
        """The one node that reads `tensor`, when exactly one does and it is no graph output."""
        users = self.consumers.get(tensor, [])
        return users[0] if len(users) == 1 and tensor not in self.graph_outputs else None

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The shape of initializer `name` without reading its values, or None when it is not a constant."""
        t = self.initializers.get(name)
        return None if t is None else tuple(t.dims)

    def replace_initializer(self, name: str, value: np.ndarray) -> None:
        self.graph.initializer.remove(self.initializers.pop(name))
        self.add_initializer(name, value)

    def add_initializer(self, name: str, value: np.ndarray) -> None:
        self.attach(make_initializer(self.staging, name, value))

    def attach(self, t: onnx.TensorProto) -> None:
        """Put the initializer `t` (made for another copy of this graph, say) in the graph, unless it is there."""
        if t.name not in self.initializers:
            self.graph.initializer.append(t)
            self.initializers[t.name] = t

    def rename_uses(self, old: str, new: str) -> None:
        """Point every consumer (and graph output) of tensor `old` at tensor `new`."""
        for node in self.consumers.get(old, []):
            for k, name in enumerate(node.input):
                if name == old:
                    node.input[k] = new
        assert old not in self.graph_outputs, f"cannot rename graph output {old}"

    def drop_unused_initializers(self) -> None:
        used = {i for n in self.graph.node for i in n.input}
        for t in [t for t in self.graph.initializer if t.name not in used]:
            self.graph.initializer.remove(t)


def drop_dead_nodes(model: onnx.ModelProto) -> None:
    """Remove nodes none of whose outputs is used (what a rewrite left behind), until none is left."""
    outputs = {o.name for o in model.graph.output}
    while True:
        used = {i for n in model.graph.node for i in n.input} | outputs
        dead = [n for n in model.graph.node if not any(o in used for o in n.output if o)]
        if not dead:
            return
        for n in dead:
            model.graph.node.remove(n)


def topological_sort(graph: onnx.GraphProto) -> None:
    """Reorder nodes so that each comes after the producers of its inputs (passes may append out of order)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for node in pending:
            if all(i in available for i in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ValueError(f"graph has a cycle or a dangling input at node {rest[0].name}")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)
