"""The CPU engine's second graph for small steps: the same network over the same weight file, with its 4- and 8-bit
linears (blocks of 32) run by trtbuild::BlockQuantMatMul (cpu_ops/block_matmul.cc) instead of MatMulNBits.

Why two graphs: at one to a few tokens a step reads every weight once, and our kernel streams the very bytes
MatMulNBits would at a higher rate (llama.cpp's way: activations quantized to int8 blocks once per matmul, one row
of codes at a time, VNNI dot products). From about 8 tokens on, ONNX Runtime's packed MLAS kernels are faster. So
the runtime runs steps of at most SMALL_STEP_MAX_TOKENS tokens (engine_dir.py) on this graph (batch-1 decode, a
few decodes, short speculative verifications) and every other step on rank0.onnx. NOTE: the two sessions share the
file, not memory: MLAS repacks its weights, while the small-step session reads the mapped file, so the linears'
bytes count twice in RSS.
"""

from __future__ import annotations

import copy

import onnx

from trtbuild.builder.graph import MS_DOMAIN
from trtbuild.plugins import block_quant_matmul as bq


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def eligible(node: onnx.NodeProto) -> bool:
    """A MatMulNBits the native kernel computes: 4 or 8 bits, blocks of 32, default zero points, K % 128 == 0."""
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len([i for i in node.input if i]) != 3:
        return False
    a = _attrs(node)
    return a.get("bits") in (4, 8) and a.get("block_size") == bq.BLOCK and a["K"] % bq.K_MULTIPLE == 0


def small_step_graph(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of a saved engine graph (initializers external or small) with its eligible linears replaced; returns
    it and how many were replaced."""
    decode = copy.deepcopy(model)
    replaced = 0
    for node in decode.graph.node:
        if eligible(node):
            a = _attrs(node)
            del node.attribute[:]
            node.attribute.extend(onnx.helper.make_attribute(k, a[k]) for k in ("K", "N", "bits", "block_size"))
            node.op_type, node.domain = bq.OP_TYPE, bq.DOMAIN
            replaced += 1
    if replaced and not any(o.domain == bq.DOMAIN for o in decode.opset_import):
        decode.opset_import.append(onnx.helper.make_opsetid(bq.DOMAIN, 1))
    return decode, replaced
