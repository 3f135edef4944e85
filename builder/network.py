"""Checkpoint tensors -> the unfused ONNX network of a Llama-family decoder, with one PagedAttention node per layer.

The graph is written plainly (one MatMul per projection, RoPE as its own node, residual Add then RMSNorm) so that
each fusion pass in builder/passes/ has something real to fuse and can be tested on its own.

Engine I/O (T = packed tokens of this step, B = sequences, N = tokens whose logits are wanted):
  input_ids [T] int64, position_ids [T] int64, query_start_loc [B+1] int64, past_lengths [B] int64,
  block_tables [B, max_blocks_per_seq] int64, logits_indices [N] int64,
  kv_cache [num_blocks, slots, 2, num_kv_heads, tokens_per_block, head_size]
  -> logits [N, vocab] float32, new_kv [num_layers, 2, T, num_kv_heads, head_size] (K after RoPE, V)

Built with LoRA adapters (builder/lora.py): + lora_ids [T] int64, each token's adapter (0: none).

Built with speculative_decoding_mode draft-tokens (K = max_draft_len, A = sequences whose drafts the engine verifies),
the N rows feed one trtbuild::SpeculativeAccept node (plugins/speculative_accept.py) and only the rows the runtime
still samples itself leave the engine:
  + logits_out_rows [M] int64, accept_rows [A] int64, draft_tokens [A, K] int64, draft_lens [A] int64,
    temperatures [A] float64, uniforms [A, K+1] float64
  -> logits [M, vocab] (rows logits_out_rows of the N), new_kv, num_accepted [A] int64, next_tokens [A] int64

Quantized checkpoints: linears take the standard Q/DQ form of their format (builder/quantized.py). A quantized KV
cache makes `kv_cache` int8 (or uint8 holding float8 e4m3fn bits); each PagedAttention node then carries the
attributes `kv_cache_quant_algo` and `kv_cache_scale` [K scale, V scale], and the model's metadata_props carry
the per-layer scales (`trtbuild.kv_cache_scales`, JSON [[k, v], ...]) for the runtime, which quantizes new_kv when
it writes the pool. new_kv itself is float32 here. An unquantized pool built with `kv_pool_dtype: float16` makes
`kv_cache` float16 (attention reads it back as float32); the CPU lowering then casts new_kv to float16
(builder/new_kv_dtype.py), the values the runtime would have rounded it to when it writes.

A block holds `slots` layers: all of them, or, where sliding and full layers mix, one KV cache group's
(configs/kv_groups.py); each group after the first adds its own block table input, `block_tables_<group>`.

A model with recurrent layers (Qwen3.5's linear attention, Granite 4.0-H's Mamba2: builder/network_delta.py) adds
their states, which its GatedDeltaNet / Mamba2Scan nodes update in place (plugins/gated_delta.py, mamba2.py):
  + recurrent_state [state_slots, recurrent layers, value heads, key dim, value dim] float32, state_slots [B] int64,
    state_checkpoints [B, 2] int64 (where a step that verifies drafts also keeps a sequence's state)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np
import onnx
import torch
from onnx import TensorProto

from trtbuild.builder.graph import MS_DOMAIN, GraphBuilder
from trtbuild.builder.lora import LoraTables, SlotTables, WithLora, read_adapters
from trtbuild.builder.lora_slots import stacked_tables, write_slot_tables
from trtbuild.builder.mlp_activation import activation, gated_activation
from trtbuild.builder.moe_experts import Experts
from trtbuild.builder.network_conv import ConvWriter
from trtbuild.builder.network_delta import LinearAttentionWriter
from trtbuild.builder.network_head import HeadWriter
from trtbuild.builder.network_moe import ExpertsWriter
from trtbuild.builder.passes.lora import LORA_ADD
from trtbuild.builder.quantized import QuantizedLinears, kv_cache_scales
from trtbuild.builder.rope import EngineRotaryRows, attn_temperature_table, reorders_rotary_rows, rope_tables
from trtbuild.builder.tensor_parallel import TP_GROUP_INPUT, TensorParallel, rank_config
from trtbuild.builder.weight_file import StagingWeights
from trtbuild.builder.weight_only_linear import emit_nbits_gather
from trtbuild.configs import (
    LORA_IDS_INPUT,
    BuildConfig,
    ModelConfig,
    cache_layers,
    group_input,
    kv_cache_groups,
    layer_slot,
    num_cache_layers,
    slots_per_block,
)
from trtbuild.plugins import gated_delta as gd
from trtbuild.plugins import paged_attention as pa
from trtbuild.plugins import speculative_accept as sa
from trtbuild.quantization import kv_pool_elem_type

ENGINE_INPUTS = ("input_ids", "position_ids", "query_start_loc", "past_lengths", "block_tables", "logits_indices",
                 "kv_cache")
ENGINE_OUTPUTS = ("logits", "new_kv")
HIDDEN_STATES_OUTPUT = "hidden_states"  # an embed engine's rows (BuildConfig.task), in place of the logits
ACCEPT_INPUTS = ("logits_out_rows",) + sa.INPUTS[1:]  # the accept op's inputs but its logits rows, which it reads
KV_SCALES_METADATA = "trtbuild.kv_cache_scales"


def engine_inputs(config: ModelConfig, build: BuildConfig) -> tuple[str, ...]:
    groups = [group_input("block_tables", g) for g in range(1, len(kv_cache_groups(config, build)))]
    lora = (LORA_IDS_INPUT,) if build.num_lora_ids else ()
    tp = (TP_GROUP_INPUT,) if config.mapping.tp_size > 1 else ()
    state = (gd.STATE_INPUT, gd.STATE_SLOTS_INPUT, gd.CHECKPOINTS_INPUT) if config.recurrent_layers else ()
    return ENGINE_INPUTS + tuple(groups) + state + lora + tp + (ACCEPT_INPUTS if build.draft_tokens else ())


def engine_outputs(build: BuildConfig) -> tuple[str, ...]:
    rows = (HIDDEN_STATES_OUTPUT,) if build.task == "embed" else ENGINE_OUTPUTS[:1]
    return rows + ENGINE_OUTPUTS[1:] + (sa.OUTPUTS if build.draft_tokens else ())


def kv_cache_shape(config: ModelConfig, build: BuildConfig, num_blocks: int | str) -> list:
    """[blocks, slots, K|V, kv_heads, tokens_per_block, head_size] (slots: the layers a block holds, all of them
    unless KV cache groups split them): block-major, so a block is one contiguous run
    of memory that the runtime's lazily mapped pool faults in at once. NOTE: head-major ([layers, K|V, heads,
    blocks, ...]) spread each block over layers x 2 x heads places, and every new block faulted a page in each
    (0.25 s of a batch-16 SmolLM2 run). A gather of one head's past tokens still reads rows of head_size values."""
    return [num_blocks, slots_per_block(kv_cache_groups(config, build)), 2, config.num_key_value_heads,
            build.tokens_per_block, config.head_size]


class _NetworkWriter(HeadWriter, ConvWriter, LinearAttentionWriter, ExpertsWriter):
    def __init__(self, config: ModelConfig, tensors: Mapping[str, torch.Tensor], build: BuildConfig,
                 staging: StagingWeights | None, lora: LoraTables | None, tp: TensorParallel) -> None:
        self.c, self.build, self.g, self.tp = config, build, GraphBuilder(staging), tp
        self.vocab_rows = -(-config.vocab_size // tp.size)  # this rank's rows of the embedding and the LM head
        self.tensors, self.lora = tensors, lora
        self.lora_mask = ""  # [tokens, R]: which LoRA columns each token keeps (set in write)
        self.np_dtype = np.float32  # the CPU target computes in fp32 (ORT's CPU kernels are fastest there)
        self.quant = QuantizedLinears(self.g, config, tensors, build.int4_accuracy_level)
        self.moe = Experts(self.g, config, tensors, self.quant, native=build.quant_linears == "native")
        self.kv_scales = kv_cache_scales(config, tensors)

    def tensor(self, name: str) -> np.ndarray:
        return self.tensors[name].to(torch.float32).numpy().astype(self.np_dtype, copy=False)

    def linear(self, x: str, prefix: str, bias: bool = False, outputs: list[str] | None = None) -> str:
        adapted = self.lora is not None and prefix + ".lora_a" in self.tensors
        last = not (bias or adapted)  # whether the GEMM's output is the linear's
        if self.quant.is_quantized(prefix):
            y = self.quant.matmul(x, prefix, outputs=outputs if last else None)
        else:
            w = self.g.weight(prefix + ".weight", self.tensor(prefix + ".weight").T)  # [in, out] for MatMul
            y = self.g.op("MatMul", [x, w], name=prefix, outputs=outputs if last else None)
        if adapted:  # NOTE: before the bias, so that the fused siblings' deltas join before their Split
            y = self.lora_delta(x, y, prefix, None if bias else outputs)
        if bias:
            y = self.g.op("Add", [y, self.g.weight(prefix + ".bias", self.tensor(prefix + ".bias"))],
                          name=prefix + "_bias", outputs=outputs)
        return y

    def row_linear(self, x: str, prefix: str, bias: bool = False) -> str:
        """A row-parallel linear (the attention's output projection, the MLP's down projection): over several ranks,
        this rank's partial sum all-reduced, then the bias, once."""
        if self.tp.size == 1:
            return self.linear(x, prefix, bias)
        y = self.tp.all_reduce(self.g, self.linear(x, prefix), prefix + "_allreduce")
        if bias:
            y = self.g.op("Add", [y, self.g.weight(prefix + ".bias", self.tensor(prefix + ".bias"))],
                          name=prefix + "_bias")
        return y

    def lora_delta(self, x: str, y: str, prefix: str, outputs: list[str] | None) -> str:
        """y + ((x @ A^T) * mask) @ B^T over every adapter's columns (builder/lora.py). The node names end in
        LORA_NODE_SUFFIXES, which the GEMM fusion passes read (builder/passes/lora.py)."""
        if self.lora.runtime:  # LoRA slots: tables the runtime writes (builder/lora_slots.py)
            out, fan_in = self.lora.shape(prefix)
            a = self.g.input(prefix + ".lora_a", TensorProto.FLOAT, [fan_in, self.lora.columns])
            b = self.g.input(prefix + ".lora_b", TensorProto.FLOAT, [self.lora.columns, out])
        else:
            a = self.g.weight(prefix + ".lora_a", self.tensor(prefix + ".lora_a").T)  # [in, R] for MatMul
            b = self.g.weight(prefix + ".lora_b", self.tensor(prefix + ".lora_b").T)  # [R, out]
        h = self.g.op("MatMul", [x, a], name=prefix + ".lora_a")
        h = self.g.op("Mul", [h, self.lora_mask], name=prefix + ".lora_mask")
        delta = self.g.op("MatMul", [h, b], name=prefix + ".lora_b")
        return self.g.op("Add", [y, delta], name=prefix + LORA_ADD, outputs=outputs)

    def rms_norm(self, x: str, weight_name: str) -> str:
        w = self.g.weight(weight_name, self.tensor(weight_name))
        return self.g.op("RMSNormalization", [x, w], axis=-1, epsilon=self.c.norm_epsilon,
                         name=weight_name.removesuffix(".weight"))

    def norm(self, x: str, weight_name: str) -> str:
        """A layer's or the final norm, of the model's norm_type (a LayerNorm with a bias where norm_bias: Cohere's
        has none)."""
        if self.c.norm_type == "rms":
            return self.rms_norm(x, weight_name)
        prefix = weight_name.removesuffix(".weight")
        inputs = [x, self.g.weight(weight_name, self.tensor(weight_name))]
        if self.c.norm_bias:
            inputs.append(self.g.weight(prefix + ".bias", self.tensor(prefix + ".bias")))
        return self.g.op("LayerNormalization", inputs, axis=-1, epsilon=self.c.norm_epsilon, name=prefix)

    def mlp(self, h: str, layer: str, module: str = "mlp.", reduce: bool = True) -> str:
        """The MLP of one layer (`layer`: its `transformer.layers.{i}.`): gate and up, the activation, down (without a
        gate: up, its activation, down). `reduce`: over several ranks, all-reduce its down projection (False: the
        caller sums this rank's part with others first)."""
        name = layer + module.removeprefix("mlp.")
        bias = self.c.mlp_bias and module == "mlp."  # NOTE: Qwen2-MoE's shared expert has none
        if self.c.gated_mlp:  # NOTE: gate first: the gate / up fusion and the SwiGLU lowering read them in this order
            gate, up = (self.linear(h, layer + module + p, bias=bias) for p in ("gate", "fc"))
            act = gated_activation(self.g, self.c, gate, up, name)
        else:
            act = activation(self.g, self.c, self.linear(h, layer + module + "fc", bias=bias), name,
                             lambda p: self.tensor(f"{layer}{module}act.{p}"))
        down = layer + module + "proj"
        return self.row_linear(act, down, bias=bias) if reduce else self.linear(act, down, bias=bias)

    def branch_output(self, y: str, prefix: str) -> str:
        """What an attention or MLP block adds to the residual stream: its output, RMS-normalized (Gemma 2 / 3's
        sandwich norms, OLMo 2 / 3's only norms) or multiplied (Granite's residual multiplier)."""
        if self.c.output_norms:
            y = self.rms_norm(y, prefix + "output_norm.weight")
        if self.c.residual_multiplier != 1.0:
            y = self.g.op("Mul", [y, self.g.const(np.array(self.c.residual_multiplier, np.float32),
                                                  "residual_multiplier")], name=prefix + "residual_scaled")
        return y

    def rope_inputs(self) -> dict[bool, tuple[str, str]]:
        """(cos, sin) tables by whether a layer is a sliding one: Gemma 3's sliding layers rotate with their own,
        unscaled base; every other model's layers share one pair."""
        c = self.c

        def tables(config: ModelConfig, prefix: str) -> tuple[str, str]:
            cos, sin = rope_tables(config, self.build.max_seq_len)
            return self.g.weight(prefix + "cos", cos), self.g.weight(prefix + "sin", sin)

        full = tables(c, "rope_")
        if c.local_rotary_base is None:
            return {False: full, True: full}
        local = dataclasses.replace(c, rotary_base=c.local_rotary_base, rotary_scaling=None)
        return {False: full, True: tables(local, "rope_local_")}

    def qk_norms(self, q: str, k: str, layer: str) -> tuple[str, str]:
        c = self.c
        return (self.head_norm(q, layer + "attention.q_norm.weight", c.num_attention_heads),
                self.head_norm(k, layer + "attention.k_norm.weight", c.num_key_value_heads))

    def head_norm(self, x: str, weight_name: str, heads: int) -> str:
        """Qwen3's per-head RMSNorm of q or k, before RoPE (Hunyuan's, after it); OLMo 2's spans the whole
        projection."""
        if self.c.qk_norm_full and self.tp.size > 1:  # NOTE: its mean square spans every rank's heads
            w = self.g.weight(weight_name, self.tensor(weight_name))
            return self.tp.rms_norm(self.g, x, w, heads * self.c.head_size * self.tp.size, self.c.norm_epsilon,
                                    weight_name.removesuffix(".weight"))
        if self.c.qk_norm_full:
            return self.rms_norm(x, weight_name)
        per_head = self.g.op("Reshape", [x, self.g.const(np.array([0, heads, self.c.head_size]), "heads_shape")])
        normed = self.rms_norm(per_head, weight_name)
        return self.g.op("Reshape", [normed, self.g.const(np.array([0, heads * self.c.head_size]), "flat_shape")])

    def query_temperature(self, positions: str) -> str | None:
        """[tokens, 1]: what each token's q is multiplied by (Ministral 3's attention temperature), or None where the
        engine's positions all lie below its length (the factor is 1 there)."""
        table = attn_temperature_table(self.c, self.build.max_seq_len)
        if table is None:
            return None
        return self.g.op("Gather", [self.g.weight("attn_temperature", table), positions], axis=0,
                         name="attn_temperature_rows")

    def rope(self, x: str, heads: int, positions_2d: str, cos: str, sin: str) -> str:
        x3 = self.g.op("Unsqueeze", [x, self.g.const(np.array([0]), "axis0")])
        y3 = self.g.op("RotaryEmbedding", [x3, cos, sin, positions_2d], num_heads=heads)
        return self.g.op("Squeeze", [y3, self.g.const(np.array([0]), "axis0")])

    def attention(self, h: str, p: str, i: int, cache: list[str], slot: int, window: int | None, positions_2d: str,
                  rope: dict[bool, tuple[str, str]], temperature: str | None) -> tuple[str, str, str]:
        """Layer i's attention block on its normed input h: (its output projection's output, new K, new V)."""
        c, g = self.c, self.g
        q, k, v = (self.linear(h, p + f"attention.{n}", bias=c.qkv_bias) for n in "qkv")
        if c.qk_norm and not c.qk_norm_after_rope:
            q, k = self.qk_norms(q, k, p)
        if temperature is not None:  # NOTE: a per-token factor commutes with RoPE, so the RoPE fusion still applies
            q = g.op("Mul", [q, temperature], name=p + "attention.q_temperature")
        if i not in c.no_rope_layers:  # SmolLM3's NoPE layers attend without positions
            q = self.rope(q, c.num_attention_heads, positions_2d, *rope[c.is_sliding(i)])
            k = self.rope(k, c.num_key_value_heads, positions_2d, *rope[c.is_sliding(i)])
        if c.qk_norm_after_rope:  # NOTE: the RoPE stays outside the attention op (no fusion past the norms)
            q, k = self.qk_norms(q, k, p)
        kv_quant = {} if self.kv_scales is None else dict(kv_cache_quant_algo=c.quantization.kv_cache_quant_algo,
                                                          kv_cache_scale=[float(s) for s in self.kv_scales[i]])
        sinks = ["", "", "", g.weight(p + "attention.sinks", self.tensor(p + "attention.sinks"))] \
            if c.attention_sinks else []  # NOTE: after the rope inputs the RoPE fusion pass fills in
        softcap = {"softcap": c.attn_logit_softcapping} if c.attn_logit_softcapping else {}
        attn, k_new, v_new = g.op(
            pa.OP_TYPE, [q, k, v, *cache, *sinks], num_outputs=3, domain=pa.DOMAIN, name=p + "attention.paged",
            layer_idx=slot, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
            head_size=c.head_size, tokens_per_block=self.build.tokens_per_block, scale=float(c.score_scale), rotary=0,
            **kv_quant, **({"window": window} if window else {}), **softcap,
        )
        if c.attention_output_gate:  # AFMoE: each output feature times the sigmoid of its gate
            gate = g.op("Sigmoid", [self.linear(h, p + "attention.gate")])
            attn = g.op("Mul", [attn, gate], name=p + "attention.gated")
        return self.row_linear(attn, p + "attention.dense", bias=c.dense_bias), k_new, v_new

    def write(self) -> onnx.ModelProto:
        c, g = self.c, self.g
        i64, f32 = TensorProto.INT64, TensorProto.FLOAT
        input_ids = g.input("input_ids", i64, ["num_tokens"])
        positions = g.input("position_ids", i64, ["num_tokens"])
        query_start = g.input("query_start_loc", i64, ["batch_plus_1"])
        past_lengths = g.input("past_lengths", i64, ["batch"])
        block_tables = [g.input("block_tables", i64, ["batch", self.build.max_blocks_per_seq])]
        logits_indices = g.input("logits_indices", i64, ["num_logits"])
        kv_cache = g.input("kv_cache", kv_pool_elem_type(c, self.build), kv_cache_shape(c, self.build, "num_blocks"))
        groups = kv_cache_groups(c, self.build)
        block_tables += [g.input(group_input("block_tables", i), i64, ["batch", self.build.max_blocks_per_seq])
                         for i in range(1, len(groups))]
        state = [g.input(gd.STATE_INPUT, f32, ["state_slots", len(c.recurrent_layers), *c.recurrent_state_shape]),
                 g.input(gd.STATE_SLOTS_INPUT, i64, ["batch"]),
                 g.input(gd.CHECKPOINTS_INPUT, i64, ["batch", 2])] if c.recurrent_layers else []
        if self.lora is not None:
            table = g.weight("lora_table", self.lora.mask_table())
            self.lora_mask = g.op("Gather", [table, g.input(LORA_IDS_INPUT, i64, ["num_tokens"])], axis=0,
                                  name="lora_mask")
        self.tp.group_input(g)

        rope = self.rope_inputs()
        positions_2d = g.op("Unsqueeze", [positions, g.const(np.array([0]), "axis0")], name="positions_2d")
        temperature = self.query_temperature(positions)

        rows, held = self.tp.vocab_rows(g, input_ids, self.vocab_rows)
        if c.quantization.embedding_weight_only:
            x = emit_nbits_gather(g, rows, "transformer.vocab_embedding", self.tensors, c.hidden_size)
        else:
            x = g.op("Gather", [g.weight("transformer.vocab_embedding.weight",
                                         self.tensor("transformer.vocab_embedding.weight")), rows],
                     name="embedding")
        if held is not None:  # NOTE: another rank's id gathered this rank's row 0: zeroed before the sum
            x = self.tp.all_reduce(g, g.op("Mul", [x, held], name="embedding_held"), "embedding_allreduce")
        if c.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden_size)
            x = g.op("Mul", [x, g.const(np.array(c.embedding_multiplier, np.float32), "embedding_multiplier")],
                     name="embedding_scaled")
        new_kv = []
        entries = cache_layers(c)
        for i in range(c.num_hidden_layers):
            p = f"transformer.layers.{i}."
            g.scope = p
            h = self.norm(x, p + "input_layernorm.weight") if c.input_norms else x
            group, slot = layer_slot(groups, entries[i][0])
            cache = [kv_cache, block_tables[group], past_lengths, query_start]
            if c.is_conv(i):
                attn, conv_rows = self.short_conv(h, p, cache, slot)
                new_kv.append(conv_rows)
            elif c.is_linear_attention(i) or c.is_mamba(i):
                block = self.linear_attention if c.is_linear_attention(i) else self.mamba
                attn, conv_rows = block(h, p, cache, slot, state, c.recurrent_layers.index(i))
                new_kv.append(conv_rows)
            else:
                attn, k_new, v_new = self.attention(h, p, i, cache, slot, groups[group].window, positions_2d, rope,
                                                    temperature)
                new_kv += [k_new, v_new]
            attn = self.branch_output(attn, p + "attention.")
            if not c.parallel_residual:  # NOTE: Cohere's MLP reads the attention's input h
                x = g.op("Add", [x, attn], name=p + "attn_residual")
                if not c.has_mlp(i):  # a Nemotron-H mixer without an MLP after it
                    continue
                h = self.norm(x, p + "post_layernorm.weight") if c.input_norms else x
            mlp = self.branch_output((self.experts if c.has_experts(i) else self.mlp)(h, p), p + "mlp.")
            if c.parallel_residual:
                mlp = g.op("Add", [attn, mlp], name=p + "attn_mlp")
            x = g.op("Add", [x, mlp], name=p + "mlp_residual")
        g.scope = ""
        selected = g.op("Gather", [x, logits_indices], axis=0, name="select_logit_tokens")
        h = self.norm(selected, "transformer.ln_f.weight")
        if self.build.task == "embed":  # NOTE: the rows are the pooled hidden states themselves: no LM head
            g.op("Identity", [h], name="hidden_states", outputs=[HIDDEN_STATES_OUTPUT])
        else:
            self.head(h)
        # [K0; V0; K1; ...] stacked on the token axis is [L * 2 * T, KVH, D]: one copy, then a free reshape
        stacked = g.op("Concat", new_kv, axis=0, name="new_kv_stacked")
        g.op("Reshape", [stacked, g.const(np.array([num_cache_layers(c), 2, -1, c.num_key_value_heads, c.head_size]),
                                          "new_kv_shape")], name="new_kv", outputs=["new_kv"])
        if self.build.task == "embed":
            g.output(HIDDEN_STATES_OUTPUT, f32, ["num_logits", c.hidden_size])
        else:
            g.output("logits", f32, ["num_logits_out" if self.build.draft_tokens else "num_logits", c.vocab_size])
        g.output("new_kv", f32, [num_cache_layers(c), 2, "num_tokens", c.num_key_value_heads, c.head_size])
        if self.build.draft_tokens:
            for name in sa.OUTPUTS:
                g.output(name, i64, ["num_accepting"])
        opsets = {pa.DOMAIN: pa.OPSET_VERSION}
        if any(n.domain == MS_DOMAIN for n in g.nodes):  # weight_only linears (MatMulNBits), experts (MoE)
            opsets[MS_DOMAIN] = 1
        model = g.model("trtbuild_decoder", opsets)
        if self.kv_scales is not None:
            entry = model.metadata_props.add()
            entry.key, entry.value = KV_SCALES_METADATA, json.dumps(self.kv_scales.tolist())
        if self.lora is not None and self.lora.runtime:
            write_slot_tables(model, stacked_tables(self.lora))
        return model


def build_network(config: ModelConfig, tensors: Mapping[str, torch.Tensor], build: BuildConfig,
                  staging: StagingWeights | None = None, lora: LoraTables | None = None,
                  rank: int = 0) -> onnx.ModelProto:
    """The unfused network of one rank of a checkpoint (`tensors`: that rank's; over several tensor-parallel ranks,
    builder/tensor_parallel.py). `tensors` may read each tensor lazily; with `staging`,
    the weights go to that file one at a time as the network is written (otherwise they stay in the model). A
    partial or interleaved rotary model's q / k rows are reordered for the whole-head RoPE (builder/rope.py).
    `lora`: the build's adapters, if already read (otherwise they are read from build.lora_adapters)."""
    if lora is None:
        lora = SlotTables(config, build) if build.max_loras else read_adapters(build.lora_adapters, config)
    if lora is not None:
        tensors = WithLora(tensors, lora)
    local = rank_config(config)
    if reorders_rotary_rows(local):
        tensors = EngineRotaryRows(tensors, local)
    tp = TensorParallel(config.mapping.tp_rank(rank), config.mapping.tp_size)
    return _NetworkWriter(local, tensors, build, staging, lora, tp).write()
