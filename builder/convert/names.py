"""Tensor names: Hugging Face -> unified checkpoint. One table serves every supported family.

Checkpoint names (linear weights are [out, in]; layer indices are global, so a pipeline rank's file says which
layers it holds):
  transformer.vocab_embedding.weight                         [vocab, hidden]          vocab-parallel
  transformer.layers.{i}.input_layernorm.weight              [hidden]                 replicated
  transformer.layers.{i}.attention.{q,k,v}.weight|bias       [heads*head_size, hidden] split by heads
  transformer.layers.{i}.attention.{q,k}_norm.weight         [head_size]              replicated (Qwen3)
  transformer.layers.{i}.attention.dense.weight              [hidden, heads*head_size] split by input columns
  transformer.layers.{i}.attention.dense.bias                [hidden]                 replicated (gpt-oss)
  transformer.layers.{i}.attention.sinks                     [heads]                  split by heads (gpt-oss)
  transformer.layers.{i}.post_layernorm.weight               [hidden]                 replicated
  transformer.layers.{i}.mlp.{gate,fc}.weight                [inter, hidden]          split by rows
  transformer.layers.{i}.mlp.proj.weight                     [hidden, inter]          split by input columns
  transformer.layers.{i}.{attention,mlp}.output_norm.weight   [hidden]                 replicated (Gemma 2 / 3)
  a mixture of experts' layers hold, instead of mlp.{gate,fc,proj}:
  transformer.layers.{i}.mlp.router.weight                   [experts, hidden]        replicated
  transformer.layers.{i}.mlp.experts.{gate,fc}.weight        [experts, expert inter, hidden]  each expert's rows
  transformer.layers.{i}.mlp.experts.proj.weight             [experts, hidden, expert inter]  by input columns
  transformer.layers.{i}.mlp.router.bias, mlp.experts.{gate,fc,proj}.bias   [experts], [experts, out] (gpt-oss:
                                                             one tensor-parallel rank only)
  transformer.layers.{i}.mlp.shared.{gate,fc,proj}.weight    as mlp.{gate,fc,proj}, of shared inter (Qwen2-MoE)
  transformer.layers.{i}.mlp.shared_gate.weight              [1, hidden] (Qwen2-MoE)   replicated
  an LFM2 convolution layer holds, instead of attention.*:
  transformer.layers.{i}.conv.in_proj.weight                 [3 * hidden, hidden]     (B, C, x)
  transformer.layers.{i}.conv.kernel.weight                  [hidden, L]              each channel's taps
  transformer.layers.{i}.conv.out_proj.weight                [hidden, hidden]
  a Qwen3.5 linear attention layer (gated DeltaNet) holds, instead of attention.* (Kd, Vd: key and value heads
  times their dims; Hv value heads):
  transformer.layers.{i}.linear_attn.in_proj_qkv.weight      [2 * Kd + Vd, hidden]    (q, k, v)
  transformer.layers.{i}.linear_attn.in_proj_{z,b,a}.weight  [Vd | Hv | Hv, hidden]   output gate, beta, decay
  transformer.layers.{i}.linear_attn.conv.weight             [2 * Kd + Vd, L]         each channel's taps
  transformer.layers.{i}.linear_attn.{A,dt_bias}             [Hv]                     A = -exp(A_log)
  transformer.layers.{i}.linear_attn.norm.weight             [value head dim]         the gated RMSNorm's
  transformer.layers.{i}.linear_attn.out_proj.weight         [hidden, Vd]
  a Granite 4.0-H Mamba2 layer holds, instead of attention.* (I: heads x head dim, C: I + 2 groups x state size):
  transformer.layers.{i}.mamba.in_proj.weight|bias           [I + C + heads, hidden]  (z, x | B | C, dt)
  transformer.layers.{i}.mamba.conv.weight|bias              [C, L] | [C]
  transformer.layers.{i}.mamba.{A,dt_bias,D}                 [heads]                  A = -exp(A_log)
  transformer.layers.{i}.mamba.norm.weight                   [I]                      the gated group norm's
  transformer.layers.{i}.mamba.out_proj.weight|bias          [hidden, I] | [hidden]
  transformer.ln_f.weight                                    [hidden]                 replicated
  lm_head.weight                                             [vocab, hidden]          vocab-parallel

Quantized checkpoints (docs/quantization.md) add, per quantized linear prefix P, `P.weights_scaling_factor`,
`P.activation_scaling_factor`, `P.prequant_scaling_factor`, and per layer `attention.kv_cache_scaling_factor`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from trtbuild.configs.model_config import LFM2_FAMILIES, QWEN35_FAMILIES, XIELU_PARAMETERS

if TYPE_CHECKING:
    from trtbuild.configs import ModelConfig

MAMBA_LINEARS = ("mamba.in_proj", "mamba.out_proj")
# a Mamba2 layer's tensors (besides its linears' weights and, where mamba_proj_bias, biases)
MAMBA_TENSORS = ("conv.weight", "A", "dt_bias", "D", "norm.weight")
_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    # Granite 4.0-H's Mamba2 layers (A_log made A = -exp(A_log) by convert.py's decay_rates)
    **{f"mamba.{n}": f"mamba.{n}" for n in ("in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias",
                                            "A_log", "A", "dt_bias", "D", "norm.weight")},
    "mamba.conv1d.weight": "mamba.conv.weight",
    "mamba.conv1d.bias": "mamba.conv.bias",
    "self_attn.q_proj.weight": "attention.q.weight",
    "self_attn.k_proj.weight": "attention.k.weight",
    "self_attn.v_proj.weight": "attention.v.weight",
    "self_attn.q_proj.bias": "attention.q.bias",
    "self_attn.k_proj.bias": "attention.k.bias",
    "self_attn.v_proj.bias": "attention.v.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.o_proj.weight": "attention.dense.weight",
    "self_attn.o_proj.bias": "attention.dense.bias",
    "self_attn.sinks": "attention.sinks",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.fc.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
    # the MLP's biases (Llama's mlp_bias)
    **{f"mlp.{hf}.bias": f"mlp.{ours}.bias" for hf, ours in (("gate_proj", "gate"), ("up_proj", "fc"),
                                                              ("down_proj", "proj"))},
}
# StarCoder 2: LayerNorms with biases, and its MLP's names
_STARCODER2_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if not k.startswith("mlp.")},
    "input_layernorm.bias": "input_layernorm.bias",
    "post_attention_layernorm.bias": "post_layernorm.bias",
    **{f"mlp.{hf}.{w}": f"mlp.{ours}.{w}" for hf, ours in (("c_fc", "fc"), ("c_proj", "proj")) for w in ("weight",
                                                                                                        "bias")},
}
# Hunyuan: its q / k norms' names
_HUNYUAN_LAYER_MAP = {**{k: v for k, v in _LAYER_MAP.items() if "_norm." not in k},
                      "self_attn.query_layernorm.weight": "attention.q_norm.weight",
                      "self_attn.key_layernorm.weight": "attention.k_norm.weight"}
# Gemma 2 / 3's and OLMo 2 / 3's output norms: their `post_attention_layernorm` normalizes the attention's output
# (Llama's is the norm before the MLP, which Gemma calls `pre_feedforward_layernorm`).
_OUTPUT_NORM_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_layernorm.weight": "attention.output_norm.weight",
    "pre_feedforward_layernorm.weight": "post_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp.output_norm.weight",
}
# GLM-4's four norms: its `post_attention_layernorm` is Llama's (before the MLP), the output norms have their own names
_GLM4_LAYER_MAP = {
    **_LAYER_MAP,
    "post_self_attn_layernorm.weight": "attention.output_norm.weight",
    "post_mlp_layernorm.weight": "mlp.output_norm.weight",
}
# A mixture of experts' MLP, its experts stacked by builder/convert/experts.py
_MOE_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if not k.startswith("mlp.")},
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.bias": "mlp.router.bias",
    **{f"mlp.experts.{hf}_proj.bias": f"mlp.experts.{p}.bias" for hf, p in (("gate", "gate"), ("up", "fc"),
                                                                              ("down", "proj"))},
    "mlp.experts.gate_proj.weight": "mlp.experts.gate.weight",
    "mlp.experts.up_proj.weight": "mlp.experts.fc.weight",
    "mlp.experts.down_proj.weight": "mlp.experts.proj.weight",
    "mlp.shared_expert.gate_proj.weight": "mlp.shared.gate.weight",
    "mlp.shared_expert.up_proj.weight": "mlp.shared.fc.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared.proj.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight",
}
# LFM2: its norms' and MLP's names, the attention's output projection `out_proj`, and the convolution layers
_LFM2_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if k.startswith("self_attn.") and "_norm." not in k},
    "self_attn.out_proj.weight": "attention.dense.weight",
    "self_attn.q_layernorm.weight": "attention.q_norm.weight",
    "self_attn.k_layernorm.weight": "attention.k_norm.weight",
    "operator_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_layernorm.weight",
    **{f"feed_forward.{hf}.weight": f"mlp.{ours}.weight"
       for hf, ours in (("w1", "gate"), ("w3", "fc"), ("w2", "proj"))},
    **{f"conv.{hf}.{w}": f"conv.{ours}.{w}" for hf, ours in (("in_proj", "in_proj"), ("out_proj", "out_proj"),
                                                              ("conv", "kernel")) for w in ("weight", "bias")},
    # LFM2-MoE's router, its selection bias and the experts stacked (builder/convert/experts.py)
    "feed_forward.gate.weight": "mlp.router.weight",
    "feed_forward.expert_bias": "mlp.router.selection_bias",
    **{f"mlp.experts.{hf}_proj.weight": f"mlp.experts.{p}.weight" for hf, p in (("gate", "gate"), ("up", "fc"),
                                                                                  ("down", "proj"))},
}
# Apertus: its norms' names, and the xIELU activation's learned scalars per layer
_APERTUS_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if "layernorm" not in k},
    "attention_layernorm.weight": "input_layernorm.weight",
    "feedforward_layernorm.weight": "post_layernorm.weight",
    **{f"mlp.act_fn.{p}": f"mlp.act.{p}" for p in XIELU_PARAMETERS},
}
# AFMoE: the attention's output gate, Gemma 2's four norms under other names, a dense MLP in the first layers, then
# experts (stacked by builder/convert/experts.py) routed by sigmoid scores plus a selection bias, and shared experts
_AFMOE_LAYER_MAP = {
    **{k: v for k, v in _LAYER_MAP.items() if "layernorm" not in k or k.startswith("input")},
    "self_attn.gate_proj.weight": "attention.gate.weight",
    "post_attention_layernorm.weight": "attention.output_norm.weight",
    "pre_mlp_layernorm.weight": "post_layernorm.weight",
    "post_mlp_layernorm.weight": "mlp.output_norm.weight",
    "mlp.router.gate.weight": "mlp.router.weight",
    "mlp.expert_bias": "mlp.router.selection_bias",
    **{k: v for k, v in _MOE_LAYER_MAP.items() if k.startswith("mlp.experts.") and k.endswith(".weight")},
    **{k.replace("shared_expert.", "shared_experts."): v for k, v in _MOE_LAYER_MAP.items()
       if k.startswith("mlp.shared_expert.")},
}
# Qwen3.5: q_proj's per-head gate rows as AFMoE's attention gate (builder/convert/fused.py), and the linear attention
LINEAR_ATTENTION_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                            "linear_attn.in_proj_a", "linear_attn.out_proj")
LINEAR_ATTENTION_TENSORS = (*(f"{p.removeprefix('linear_attn.')}.weight" for p in LINEAR_ATTENTION_LINEARS),
                            "conv.weight", "A", "dt_bias", "norm.weight")
_QWEN35_LAYER_MAP = {
    **_LAYER_MAP,
    "self_attn.gate_proj.weight": "attention.gate.weight",
    **{f"linear_attn.{n}": f"linear_attn.{n}" for n in LINEAR_ATTENTION_TENSORS if n != "conv.weight"},
    "linear_attn.conv1d.weight": "linear_attn.conv.weight",
    "linear_attn.A_log": "linear_attn.A_log",  # made linear_attn.A = -exp(A_log) by convert.py's decay_rates
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "transformer.vocab_embedding.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "model.norm.bias": "transformer.ln_f.bias",
    "model.embedding_norm.weight": "transformer.ln_f.weight",  # LFM2's final norm
    "lm_head.weight": "lm_head.weight",
}
_CKPT_TO_HF_GLOBAL = {v: k for k, v in _GLOBAL_MAP.items() if k != "model.embedding_norm.weight"}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A vision-language model's text decoder (Gemma 3 4B+): its tensors as the text model's
_TEXT_MODEL_PREFIX = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_TEXT_MODEL_HEAD = re.compile(r"^language_model\.lm_head\.")
_CKPT_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")

# Linears of one layer, as checkpoint prefixes relative to `transformer.layers.{i}.` (q, k, v, gate, fc are
# column-parallel: split by output rows; dense and proj are row-parallel: split by input columns).
LAYER_LINEARS = ("attention.q", "attention.k", "attention.v", "attention.dense", "mlp.gate", "mlp.fc", "mlp.proj")
# A mixture of experts' stacked experts [experts, out, in]: as weight-only linears, [experts * out, in] (each expert's
# rows one after the other)
CONV_LINEARS = ("conv.in_proj", "conv.out_proj")  # an LFM2 convolution layer's, in place of the attention's
GATE_LINEARS = ("attention.gate",)  # AFMoE's attention output gate (attention_output_gate)
EXPERT_LINEARS = ("mlp.experts.gate", "mlp.experts.fc", "mlp.experts.proj")
SHARED_EXPERT_LINEARS = ("mlp.shared.gate", "mlp.shared.fc", "mlp.shared.proj")  # Qwen2-MoE's shared expert
_SCALE_SUFFIXES = ("weights_scaling_factor", "weights_zero_point", "activation_scaling_factor",
                   "prequant_scaling_factor", "kv_cache_scaling_factor")

# How each checkpoint tensor is split over tensor-parallel ranks: axis to split, or None to replicate.
_SPLIT_AXIS = {
    "attention.q.weight": 0,
    "attention.k.weight": 0,
    "attention.v.weight": 0,
    "attention.q.bias": 0,
    "attention.k.bias": 0,
    "attention.v.bias": 0,
    "attention.sinks": 0,
    "attention.gate.weight": 0,  # AFMoE's output gate: its features are the heads' outputs
    "attention.dense.weight": 1,
    "mlp.gate.weight": 0,
    "mlp.fc.weight": 0,
    "mlp.gate.bias": 0,
    "mlp.fc.bias": 0,
    "mlp.proj.weight": 1,
    # a mixture of experts': each expert's rows (gate, up: axis 1 of [experts, out, in]; a weight-only stack
    # [experts x out, in] is split per expert, builder/convert/sharding.py) or its inputs (down: the last axis)
    "mlp.experts.gate.weight": 1,
    "mlp.experts.fc.weight": 1,
    "mlp.experts.proj.weight": -1,
    "mlp.shared.gate.weight": 0,
    "mlp.shared.fc.weight": 0,
    "mlp.shared.proj.weight": 1,
    "transformer.vocab_embedding.weight": 0,
    "lm_head.weight": 0,
}


def _layer_map(config: ModelConfig | None) -> dict[str, str]:
    """HF layer tensor name -> checkpoint name, for `config`'s family (None: Llama's names)."""
    if config is None:
        return _LAYER_MAP
    if config.family == "glm4":
        return _GLM4_LAYER_MAP
    if config.family == "starcoder2":
        return _STARCODER2_LAYER_MAP
    if config.family == "hunyuan_dense":
        return _HUNYUAN_LAYER_MAP
    if config.family == "apertus":
        return _APERTUS_LAYER_MAP
    if config.family == "afmoe":
        return _AFMOE_LAYER_MAP
    if config.family in QWEN35_FAMILIES:  # NOTE: the MoE's MLP is Qwen2-MoE's
        return {**_QWEN35_LAYER_MAP, **_MOE_LAYER_MAP} if config.is_moe else _QWEN35_LAYER_MAP
    if config.family in LFM2_FAMILIES:
        return _LFM2_LAYER_MAP
    if config.output_norms:  # Gemma 2 / 3, OLMo 2 / 3, EXAONE 4
        return _OUTPUT_NORM_LAYER_MAP
    return _MOE_LAYER_MAP if config.is_moe else _LAYER_MAP


def hf_to_checkpoint_name(hf_name: str, config: ModelConfig | None = None) -> str | None:
    """The checkpoint name of an HF tensor of `config`'s family (None: Llama's names; a mixture of experts' stacked
    as builder/convert/experts.py names them), or None for tensors the engine does not use (e.g. rotary inv_freq)."""
    hf_name = _TEXT_MODEL_HEAD.sub("lm_head.", _TEXT_MODEL_PREFIX.sub("model.", hf_name))
    if hf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[hf_name]
    m = _HF_LAYER.match(hf_name)
    layer_map = _layer_map(config)
    if m and m.group(2) in layer_map:
        return f"transformer.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def checkpoint_to_hf_name(name: str, config: ModelConfig | None = None) -> str | None:
    """The HF name of a checkpoint tensor (the inverse of `hf_to_checkpoint_name`), None for scale tensors."""
    if name in _CKPT_TO_HF_GLOBAL:
        return _CKPT_TO_HF_GLOBAL[name]
    m = _CKPT_LAYER.match(name)
    layer_map = {v: k for k, v in _layer_map(config).items()}
    if m and m.group(2) in layer_map:
        return f"model.layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def linear_prefixes(layers: Iterable[int], last_stage: bool, moe: bool = False, shared_expert: bool = False,
                    gated: bool = True) -> list[str]:
    """Checkpoint prefixes of the linears a quantizer may quantize (`P.weight` is [out, in]), in checkpoint order; a
    mixture of experts' (`moe`) MLPs are its stacked experts and its `shared_expert` (its routers and the shared
    expert's gate stay in float); an MLP that is not `gated` has no mlp.gate."""
    linears = [s for s in LAYER_LINEARS if not (moe and s.startswith("mlp.")) and (gated or s != "mlp.gate")]
    linears += list(EXPERT_LINEARS if moe else ())
    linears += list(SHARED_EXPERT_LINEARS if shared_expert else ())
    out = [f"transformer.layers.{i}.{s}" for i in layers for s in linears]
    return out + (["lm_head"] if last_stage else [])


def model_linear_prefixes(config: ModelConfig, layers: Iterable[int], last_stage: bool) -> list[str]:
    """`linear_prefixes` of `config`'s model, layer by layer: an LFM2 convolution layer's in / out projections in
    place of its attention's, a dense MLP in the layers before a mixture of experts' first (LFM2-MoE)."""
    out = []
    for i in layers:
        moe = config.has_experts(i)
        prefixes = linear_prefixes([i], False, moe, moe and config.shared_expert_intermediate_size > 0,
                                   config.gated_mlp)
        if not config.has_mlp(i):  # a Nemotron-H mixer without an MLP after it
            prefixes = [p for p in prefixes if ".mlp." not in p]
        if config.attention_output_gate:  # NOTE: after v, the last linear reading the attention's input
            at = prefixes.index(f"transformer.layers.{i}.attention.v") + 1
            prefixes[at:at] = [f"transformer.layers.{i}.{s}" for s in GATE_LINEARS]
        if config.has_conv_rows(i):  # NOTE: where the attention's linears would be
            at = next(j for j, p in enumerate(prefixes) if ".attention." in p)
            prefixes = [p for p in prefixes if ".attention." not in p]
            linears = CONV_LINEARS if config.is_conv(i) else MAMBA_LINEARS if config.is_mamba(i) else \
                LINEAR_ATTENTION_LINEARS
            prefixes[at:at] = [f"transformer.layers.{i}.{s}" for s in linears]
        out += prefixes
    return out + (["lm_head"] if last_stage and config.has_lm_head else [])


def is_linear(prefix: str) -> bool:
    """Whether checkpoint prefix `prefix` (a tensor name without `.weight`) is a linear layer."""
    m = _CKPT_LAYER.match(prefix)
    return prefix == "lm_head" or (m is not None and m.group(2) in (
        *LAYER_LINEARS, *CONV_LINEARS, *EXPERT_LINEARS, *SHARED_EXPERT_LINEARS, *GATE_LINEARS,
        *LINEAR_ATTENTION_LINEARS, *MAMBA_LINEARS))


def layer_of(name: str) -> int | None:
    m = _CKPT_LAYER.match(name)
    return int(m.group(1)) if m else None


def tp_split_axis(name: str, ndim: int | None = None, qk_norm_full: bool = False) -> int | None:
    """Axis along which tensor `name` is split over TP ranks, None if replicated. `qk_norm_full`: the model's q / k
    norms span the whole projection (OLMo 2), so their weights split by heads as q and k do.

    Quantization scales (`ndim`: the tensor's rank) follow their weight: `weights_scaling_factor` is split on the
    weight's axis when it has that axis (int4 [out, in/group] always, int8 [out] only for column-parallel linears,
    the fp8 scalar never), and so is a weight_only linear's `weights_zero_point`; `prequant_scaling_factor` [in]
    is split only for row-parallel linears (dense, proj);
    `activation_scaling_factor` and `kv_cache_scaling_factor` are replicated.
    """
    m = _CKPT_LAYER.match(name)
    key = m.group(2) if m else name
    prefix, _, suffix = key.rpartition(".")
    if qk_norm_full and key in ("attention.q_norm.weight", "attention.k_norm.weight"):
        return 0
    if suffix not in _SCALE_SUFFIXES:
        return _SPLIT_AXIS.get(key)
    weight_axis = _SPLIT_AXIS.get(f"{prefix}.weight")
    follows_weight = suffix in ("weights_scaling_factor", "weights_zero_point")
    if follows_weight and weight_axis is not None and (ndim is None or ndim > weight_axis):
        return weight_axis
    if suffix == "prequant_scaling_factor" and weight_axis == 1:
        return 0
    return None
