"""What the TensorRT target does to the fused graph before the ONNX parser sees it, and the optimization profiles:
pure ONNX/numpy work, no tensorrt import.

A TensorRT AOT plugin launches one compiled kernel, and PagedAttention with rotary=1 is two (K is rotated once, then
attended), so each `trtbuild::PagedAttention` node becomes:
  rotary=1: RotaryK(k, position_ids, rope_cos, rope_sin) -> k_new [T, KVH, D]
            RotaryPagedAttentionKernel(q, k_new, v, kv_cache, block_tables, past_lengths, query_start_loc,
                                       position_ids, rope_cos, rope_sin) -> attn_out   (q rotated inside)
  rotary=0: k_new = Reshape(k); PagedAttentionKernel(q, k_new, v, kv_cache, ... 7 inputs) -> attn_out
  always:   v_new = Reshape(v)
The ONNX parser's plugin fallback finds each node's plugin by op type, `plugin_version` and `plugin_namespace`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from trtbuild.builder.graph import node_attrs, use_opset
from trtbuild.configs import LORA_IDS_INPUT, BuildConfig, ModelConfig
from trtbuild.errors import ConfigError
from trtbuild.plugins import paged_attention as pa
from trtbuild.plugins import speculative_accept as sa

NAMESPACE = pa.DOMAIN
ATTENTION_PLUGIN = "PagedAttentionKernel"  # rotary=0: 7 inputs
ROTARY_ATTENTION_PLUGIN = "RotaryPagedAttentionKernel"  # rotary=1: 10 inputs, q rotated inside
ROTARY_K_PLUGIN = "RotaryK"
PLUGIN_VERSION = "1"
# the plugin attributes each rewritten node keeps (what the plugins' register functions declare)
ATTENTION_ATTRS = ("layer_idx", "num_heads", "num_kv_heads", "head_size", "tokens_per_block", "scale")


@dataclass(frozen=True)
class PluginNode:
    """One plugin node the parser will meet: which plugin, from which source node, with which attributes."""

    plugin: str
    source: str
    attrs: dict


def check_tensorrt_graph(model: onnx.ModelProto) -> None:
    """Refuse what the TensorRT target has no plugin for, naming it."""
    for node in model.graph.node:
        if node.domain == sa.DOMAIN and node.op_type == sa.OP_TYPE:
            raise ConfigError("speculative_decoding_mode", "draft-tokens engines need a SpeculativeAccept TensorRT "
                                                           "plugin, which is not written yet; build without "
                                                           "--speculative-decoding-mode (drafts are then verified "
                                                           "from logits rows) or for --target cpu.")
        if node.domain == pa.DOMAIN and node.op_type == pa.OP_TYPE and "kv_cache_quant_algo" in node_attrs(node):
            raise ConfigError("target", "tensorrt does not run a quantized KV cache yet; build it for cpu.")
        if node.domain == pa.DOMAIN and node.op_type == pa.OP_TYPE and node_attrs(node).get("softcap", 0.0) > 0:
            raise ConfigError("target", "this model soft-caps its attention scores (Gemma 2), which the tensorrt "
                                        "plugins do not apply yet; build it for cpu or cuda.")
        if node.domain == pa.DOMAIN and node.op_type == pa.OP_TYPE and pa.sinks_input(node.input):
            raise ConfigError("target", f"this model's attention has sinks (gpt-oss; node {node.name!r}), which the "
                                        "tensorrt plugins do not apply yet; build it for cpu or cuda.")
        if node.domain not in ("", "ai.onnx", pa.DOMAIN):
            raise ConfigError("target", f"tensorrt has no plugin for {node.domain}::{node.op_type} (node "
                                        f"{node.name!r}); build for --target cpu.")


def check_tensorrt_buildable(config: ModelConfig, build: BuildConfig) -> None:
    """What the tensorrt target refuses before any work (the rest of check_buildable applies too)."""
    quant = config.quantization
    algo = next((a for a in (quant.quant_algo, quant.lm_head_quant_algo) if a), None)
    if algo:
        raise ConfigError("target", f"tensorrt does not run {algo} checkpoints yet (float ones only); build them "
                                    "for cpu or cuda.")
    if quant.kv_cache_quant_algo:
        raise ConfigError("target", "tensorrt does not run a quantized KV cache yet; build it for cpu.")
    if config.qk_norm_after_rope:
        raise ConfigError("target", "tensorrt does not run q / k norms after RoPE (Hunyuan) yet: its attention "
                                    "plugin rotates q and k itself; build it for cpu.")
    if build.kv_pool_dtype != "float32":
        raise ConfigError("kv_pool_dtype", "the tensorrt target's KV pool is float32; leave --kv-pool-dtype at "
                                           "float32.")
    if config.window_applies(build.max_seq_len):
        raise ConfigError("max_seq_len", f"{build.max_seq_len} exceeds the model's sliding window "
                                         f"({config.sliding_window}), which the tensorrt plugins do not apply yet; "
                                         f"pass {config.sliding_window} or less, or build for cpu or cuda.")
    if build.draft_tokens:
        raise ConfigError("speculative_decoding_mode", "draft-tokens engines need a SpeculativeAccept TensorRT "
                                                       "plugin, which is not written yet; build without "
                                                       "--speculative-decoding-mode or for --target cpu.")


def _plugin_node(op: str, inputs: list[str], outputs: list[str], name: str, attrs: dict) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=name, domain=NAMESPACE, plugin_namespace=NAMESPACE,
                            plugin_version=PLUGIN_VERSION, **attrs)


def rewrite_for_tensorrt(model: onnx.ModelProto) -> list[PluginNode]:
    """Replace every PagedAttention node by its plugin nodes (module docstring), in place; returns the plugin nodes
    in graph order. Refuses what check_tensorrt_graph refuses."""
    check_tensorrt_graph(model)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    plan: list[PluginNode] = []
    for node in graph.node:
        if not (node.domain == pa.DOMAIN and node.op_type == pa.OP_TYPE):
            nodes.append(node)
            continue
        attrs = node_attrs(node)
        keep = {k: attrs[k] for k in ATTENTION_ATTRS}
        rotary = bool(attrs.get("rotary", 0))
        kv_shape = f"{node.name}/kv_shape"
        graph.initializer.append(numpy_helper.from_array(
            np.array([-1, attrs["num_kv_heads"], attrs["head_size"]], dtype=np.int64), kv_shape))
        attn_out, k_new, v_new = node.output
        # NOTE: only the plugin's own inputs: an empty sinks slot (or empty rope slots before it) is no input
        ins = list(node.input)[:pa.SINKS if rotary else pa.POSITION_IDS]
        if rotary:
            rot_attrs = {"num_kv_heads": attrs["num_kv_heads"], "head_size": attrs["head_size"]}
            rope = [ins[pa.POSITION_IDS], ins[pa.ROPE_COS], ins[pa.ROPE_SIN]]
            nodes.append(_plugin_node(ROTARY_K_PLUGIN, [ins[pa.K], *rope], [k_new], f"{node.name}/rotary_k",
                                      rot_attrs))
            plan.append(PluginNode(ROTARY_K_PLUGIN, node.name, rot_attrs))
        else:
            nodes.append(helper.make_node("Reshape", [ins[pa.K], kv_shape], [k_new], name=f"{node.name}/k_new"))
        nodes.append(helper.make_node("Reshape", [ins[pa.V], kv_shape], [v_new], name=f"{node.name}/v_new"))
        attn_ins = [ins[pa.Q], k_new, *ins[pa.V:]]
        op = ROTARY_ATTENTION_PLUGIN if rotary else ATTENTION_PLUGIN
        nodes.append(_plugin_node(op, attn_ins, [attn_out], f"{node.name}/attention", keep))
        plan.append(PluginNode(op, node.name, keep))
    del graph.node[:]
    graph.node.extend(nodes)
    use_opset(model, NAMESPACE)
    return plan


@dataclass(frozen=True)
class Profile:
    """One TensorRT optimization profile: (min, opt, max) per dynamic engine input."""

    name: str
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]

    @property
    def max_tokens(self) -> int:
        return self.shapes["input_ids"][2][0]


def max_pool_blocks(build: BuildConfig) -> int:
    """The most KV blocks a profile admits: every sequence of a full batch at max_seq_len (the runtime caps its
    pool there, since a TensorRT profile needs an upper bound)."""
    return build.max_batch_size * build.max_blocks_per_seq


def _shapes(build: BuildConfig, config: ModelConfig, tokens: tuple[int, int, int], batch: tuple[int, int, int]
            ) -> dict[str, tuple[tuple[int, ...], ...]]:
    w = build.max_blocks_per_seq
    pool = (config.num_hidden_layers, 2, config.num_key_value_heads, build.tokens_per_block, config.head_size)
    blocks = (1, max_pool_blocks(build), max_pool_blocks(build))
    # NOTE: logits rows come one or more per sequence, at most one per token
    rows = (1, batch[1], tokens[2])
    dims = {"input_ids": [tokens], "position_ids": [tokens], "logits_indices": [rows],
            "query_start_loc": [tuple(b + 1 for b in batch)], "past_lengths": [batch],
            "block_tables": [batch, (w, w, w)], "kv_cache": [blocks] + [(d, d, d) for d in pool]}
    if build.lora_adapters:  # each token's adapter (builder/lora.py)
        dims[LORA_IDS_INPUT] = [tokens]
    return {name: tuple(tuple(axis[i] for axis in axes) for i in range(3)) for name, axes in dims.items()}


def optimization_profiles(build: BuildConfig, config: ModelConfig) -> list[Profile]:
    """Two profiles over the token count and the batch: decode (one token per sequence, up to max_batch_size) and
    mixed (prefill chunks and decode tokens, up to max_num_tokens, tuned at opt_num_tokens). The runtime runs a
    step under the first profile whose maximum holds its tokens and sequences."""
    b, t = build.max_batch_size, build.max_num_tokens
    opt = max(1, t // 2)
    decode = Profile("decode", _shapes(build, config, (1, b, b), (1, b, b)))
    mixed = Profile("mixed", _shapes(build, config, (1, opt, t), (1, max(1, min(b, opt)), b)))
    return [decode, mixed] if t > b else [mixed]


def profile_for(profiles: list[Profile], num_tokens: int, num_seqs: int) -> int:
    """Index of the first profile admitting a step of `num_tokens` tokens over `num_seqs` sequences."""
    for i, p in enumerate(profiles):
        if num_tokens <= p.max_tokens and num_seqs <= p.shapes["past_lengths"][2][0]:
            return i
    raise ValueError(f"a step of {num_tokens} tokens over {num_seqs} sequences exceeds every profile")
