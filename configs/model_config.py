"""The unified checkpoint's `config.json` schema (see docs/checkpoint.md); configs/from_hf.py maps Hugging Face configs
to it.

One `ModelConfig` describes every supported decoder family; the family only switches features
(`qkv_bias` for Qwen2, `qk_norm` for Qwen3). Nothing reads global state: every consumer gets this object.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild import CHECKPOINT_FORMAT_VERSION
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.configs.recurrent_checks import check_recurrent_fields
from trtbuild.errors import CheckpointError

GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")
COHERE_FAMILIES = ("cohere", "cohere2")
LFM2_FAMILIES = ("lfm2", "lfm2_moe")  # convolution layers among attention layers, LFM2's tensor names
QWEN35_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # gated DeltaNet layers among gated attention layers; (1 + w) norms
# the MLP's activation: of the gate (SwiGLU, GeGLU with tanh-approximated GELU, or gpt-oss's clamped SwiGLU:
# g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha * g) * (u + 1): swiglu_alpha, swiglu_limit),
# or, in an MLP without a gate (gated_mlp false), of the up projection: relu2 is relu(x)^2 (Arcee)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "swiglu_oai", "relu2", "xielu")
# xielu (Apertus, an MLP without a gate): x > 0: a_p x^2 + beta x, else (expm1(min(x, eps)) - x) a_n + beta x, with
# a_p = softplus(alpha_p) and a_n = beta + softplus(alpha_n): each layer's learned scalars, `mlp.act.{name}` [1]
XIELU_PARAMETERS = ("alpha_p", "alpha_n", "beta", "eps")
# conv: LFM2's short convolution, no attention; linear_attention: Qwen3.5's gated DeltaNet, mamba: Granite 4.0-H's
# Mamba2 (both a recurrent state per sequence)
LAYER_TYPES = ("full_attention", "sliding_attention", "conv", "linear_attention", "mamba")
# the layers' and the final norm: RMSNorm, or LayerNorm: mean-centred, scaled by its weight (plus, with norm_bias, a
# bias: StarCoder 2; Cohere's has none)
NORM_TYPES = ("rms", "layer")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Mapping:
    """How the model is split over ranks: rank = pp_rank * tp_size + tp_rank."""

    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def layers_of(self, rank: int, num_layers: int) -> range:
        """Global layer indices held by `rank` (pipeline stages get contiguous, near-equal runs)."""
        pp_rank = self.pp_rank(rank)
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def to_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "tp_size": self.tp_size, "pp_size": self.pp_size}


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_size", "max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    dtype: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    norm_epsilon: float
    max_position_embeddings: int
    rotary_base: float = 10000.0
    rotary_scaling: dict[str, Any] | None = None
    rotary_dim: int | None = None  # dimensions of each head RoPE rotates (partial rotary, Phi-4-mini); None: all
    # RoPE rotates adjacent pairs (2i, 2i + 1) of each head (GPT-J style: GLM-4, ERNIE 4.5), not the halves
    # (i, i + rotary_dim / 2); the checkpoint keeps the model's q / k rows, the builder reorders them (builder/rope.py)
    rotary_interleaved: bool = False
    no_rope_layers: tuple[int, ...] = ()
    # Ministral 3 (Llama 4's attention temperature): q is multiplied by 1 + attn_temperature_scale *
    # log(1 + floor(position / attn_temperature_length)), which is 1 below that length; None: not at all
    attn_temperature_scale: float | None = None
    attn_temperature_length: int | None = None  # layers whose attention applies no RoPE (SmolLM3: every fourth)
    tie_word_embeddings: bool = False
    # False: a base model saved without its LM head and not tied (an embedding model): its engines embed only
    has_lm_head: bool = True
    qkv_bias: bool = False
    dense_bias: bool = False  # the attention's output projection has a bias (gpt-oss, Llama with attention_bias)
    qk_norm: bool = False
    attention_sinks: bool = False  # each attention head has a learned sink logit in its softmax (gpt-oss)
    hidden_act: str = "silu"  # HIDDEN_ACTS
    swiglu_alpha: float | None = None  # swiglu_oai's gate slope (gpt-oss: 1.702)
    swiglu_limit: float | None = None  # swiglu_oai's clamp (gpt-oss: 7)
    gated_mlp: bool = True  # False: the MLP is proj(act(fc(x))), without a gate (Arcee's ReLU^2 MLP)
    sliding_window: int | None = None  # each token sees its last sliding_window tokens (builder/network.py)
    # per layer, LAYER_TYPES: only sliding_attention layers apply sliding_window (Gemma 2 / 3). Not given: every
    # layer alike (sliding_attention where the model has a window), filled in on creation so config.json says it
    layer_types: tuple[str, ...] = ()
    # LFM2: "conv" layers mix each channel over its last conv_kernel tokens (conv_L_cache) in place of attention
    conv_kernel: int = 0
    conv_bias: bool = False
    # Qwen3.5: "linear_attention" layers (gated DeltaNet) project q, k (linear_num_key_heads of linear_key_head_dim)
    # and v (linear_num_value_heads of linear_value_head_dim), convolve them over their last conv_kernel tokens (as
    # LFM2's conv layers), then read and update a per-sequence recurrent state [value heads, key dim, value dim]
    # (plugins/gated_delta.py)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # value head h reads key head h % key heads (llama.cpp's GGUF order), not h // (value heads / key heads)
    linear_value_heads_tiled: bool = False
    # Granite 4.0-H, Nemotron-H, Mamba2: "mamba" layers project z, x | B | C and dt, convolve x | B | C over their
    # last conv_kernel tokens (as LFM2's conv layers), then scan a per-sequence state [mamba_num_heads, mamba_head_dim,
    # mamba_state_size] whose heads share B and C in mamba_num_groups groups (plugins/mamba2.py); biases where given
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_num_groups: int = 0
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    mlp_free_layers: tuple[int, ...] = ()  # layers without an MLP (Nemotron-H's mixers not followed by one)
    local_rotary_base: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3); None: as every layer
    embedding_multiplier: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # what q.k is multiplied by; None: head_size ** -0.5
    output_norms: bool = False  # attention and MLP outputs are RMS-normalized before their adds (Gemma 2 / 3, OLMo 2)
    input_norms: bool = True  # attention and MLP inputs are RMS-normalized (every family but OLMo 2)
    norm_type: str = "rms"  # NORM_TYPES
    norm_bias: bool = False  # the LayerNorms (norm_type layer) add a bias (StarCoder 2)
    mlp_bias: bool = False  # the MLP's projections (gate, fc, proj) have biases (StarCoder 2, Llama's mlp_bias)
    # attention and MLP both read the layer's one normed input, and their outputs join the residual together (Cohere:
    # x + attn(norm(x)) + mlp(norm(x))); no post_layernorm
    parallel_residual: bool = False
    qk_norm_full: bool = False  # qk_norm spans the whole q / k projection (OLMo 2), not each head (Qwen3, Gemma 3)
    qk_norm_after_rope: bool = False  # the per-head q / k norms apply to the rotated q / k (Hunyuan), not before
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    residual_multiplier: float = 1.0  # attention and MLP outputs are multiplied by this before their adds (Granite)
    logits_scaling: float = 1.0  # the logits are divided by this (Granite)
    # mixture of experts (Qwen3-MoE, Mixtral, OLMoE): every layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size, of which a router picks num_experts_per_tok per token, weighted by the softmax of its
    # logits (renormalized over the chosen ones where moe_normalize_topk). 0 experts: a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_normalize_topk: bool = True
    # Qwen2-MoE: a shared expert (a SwiGLU MLP of this many features every token takes, scaled by the sigmoid of its
    # gate's logit unless not shared_expert_gated) beside the routed ones; 0: none
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # False: the shared expert is added as it is (Granite 4.0's shared_mlp)
    moe_bias: bool = False  # the router and the experts' projections have biases (gpt-oss)
    attention_output_gate: bool = False  # AFMoE: attention's output times sigmoid(attention.gate(x)) before its dense
    moe_dense_layers: int = 0  # the first this many layers have a dense MLP of intermediate_size (LFM2-MoE)
    # "sigmoid" (LFM2-MoE): experts chosen by sigmoid(logit) (+ the router's selection_bias where
    # moe_selection_bias), weighted by their sigmoids, renormalized where moe_normalize_topk; "softmax": as above
    moe_scoring: str = "softmax"
    moe_selection_bias: bool = False
    moe_routed_scale: float = 1.0  # the chosen experts' weights are multiplied by this
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)

    def __post_init__(self) -> None:
        """Types and ranges, checked once here so that a hand-edited config.json fails with its field's name rather
        than deep inside the builder or the runtime."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")
        for name in ("norm_epsilon", "rotary_base"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise CheckpointError(f"config.json: {name} must be a positive number, got {value!r}")
        for name in ("architecture", "family", "dtype", "hidden_act"):
            if not isinstance(getattr(self, name), str):
                raise CheckpointError(f"config.json: {name} must be a string, got {getattr(self, name)!r}")
        rd = self.rotary_dim
        if rd is not None and (not isinstance(rd, int) or isinstance(rd, bool) or not 0 < rd < self.head_size
                               or rd % 2):
            raise CheckpointError(f"config.json: rotary_dim must be null or an even number below head_size "
                                  f"({self.head_size}), got {rd!r}")
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in self.no_rope_layers):
            raise CheckpointError(f"config.json: no_rope_layers must list layer indices below num_hidden_layers "
                                  f"({self.num_hidden_layers}), got {list(self.no_rope_layers)}")
        if self.norm_type not in NORM_TYPES:
            raise CheckpointError(f"config.json: norm_type must be one of {', '.join(NORM_TYPES)}, got "
                                  f"{self.norm_type!r}")
        if self.qk_norm_after_rope and not (self.qk_norm and not self.qk_norm_full):
            raise CheckpointError("config.json: qk_norm_after_rope needs per-head q / k norms (qk_norm)")
        if self.norm_bias and self.norm_type != "layer":
            raise CheckpointError("config.json: norm_bias is for LayerNorms (norm_type layer)")
        if self.mlp_bias and self.num_experts:
            raise CheckpointError("config.json: mlp_bias is for dense MLPs; experts carry moe_bias")
        if self.parallel_residual and not self.input_norms:
            raise CheckpointError("config.json: parallel_residual needs input_norms (the one norm both blocks read)")
        if self.hidden_act not in HIDDEN_ACTS:
            raise CheckpointError(f"config.json: hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got "
                                  f"{self.hidden_act!r}")
        if not self.gated_mlp and (self.hidden_act == "swiglu_oai" or self.num_experts):
            raise CheckpointError("config.json: gated_mlp false (an MLP without a gate) does not go with hidden_act "
                                  "swiglu_oai or experts")
        if self.gated_mlp and self.hidden_act in ("relu2", "xielu"):
            raise CheckpointError(f"config.json: hidden_act {self.hidden_act} is the activation of an MLP without a "
                                  "gate (gated_mlp false)")
        if (self.hidden_act == "swiglu_oai") != (self.swiglu_alpha is not None and self.swiglu_limit is not None):
            raise CheckpointError("config.json: swiglu_alpha and swiglu_limit are set with (and only with) hidden_act "
                                  f"swiglu_oai; got hidden_act {self.hidden_act!r}, swiglu_alpha "
                                  f"{self.swiglu_alpha!r}, swiglu_limit {self.swiglu_limit!r}")
        if (self.attn_temperature_scale is None) != (self.attn_temperature_length is None) or not (
                self.attn_temperature_length is None or (isinstance(self.attn_temperature_length, int)
                                                         and self.attn_temperature_length > 0)):
            raise CheckpointError("config.json: attn_temperature_scale and attn_temperature_length are set together, "
                                  "the length a positive number of positions; got "
                                  f"{self.attn_temperature_scale!r}, {self.attn_temperature_length!r}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)  # frozen: set once, here
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise CheckpointError(f"config.json: layer_types must list one of {', '.join(LAYER_TYPES)} per layer "
                                  f"({self.num_hidden_layers}), got {list(self.layer_types)}")
        convolving = bool({"conv", "linear_attention", "mamba"} & set(self.layer_types))
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < convolving:
            raise CheckpointError(f"config.json: conv_kernel must be 0 (no conv or linear_attention layers) or "
                                  f"positive, got {self.conv_kernel!r}")
        check_recurrent_fields(self)
        for name in ("local_rotary_base", "attention_scale", "attn_logit_softcapping", "final_logit_softcapping",
                     "embedding_multiplier", "residual_multiplier", "logits_scaling", "swiglu_alpha",
                     "swiglu_limit"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0):
                raise CheckpointError(f"config.json: {name} must be null or a positive number, got {value!r}")
        moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
               self.shared_expert_intermediate_size)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in moe) or (
                self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                          and self.moe_intermediate_size >= 1)):
            raise CheckpointError(f"config.json: num_experts ({self.num_experts}), num_experts_per_tok "
                                  f"({self.num_experts_per_tok}) and moe_intermediate_size "
                                  f"({self.moe_intermediate_size}) must be 0, or a mixture of experts picking 1 to "
                                  "num_experts experts of at least one feature")
        scoring_ok = self.moe_scoring == "sigmoid" or (self.moe_scoring == "softmax" and not self.moe_selection_bias)
        if not scoring_ok or not 0 <= self.moe_dense_layers < max(1, self.num_hidden_layers) or \
                not self.moe_routed_scale > 0:
            raise CheckpointError(f"config.json: moe_scoring must be softmax or sigmoid (a selection bias only with "
                                  f"sigmoid), moe_dense_layers below the layers, moe_routed_scale positive; got "
                                  f"{self.moe_scoring!r}, {self.moe_selection_bias!r}, {self.moe_dense_layers!r}, "
                                  f"{self.moe_routed_scale!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                                  f"of num_key_value_heads ({self.num_key_value_heads})")

    # ---- serialization -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mapping"] = self.mapping.to_dict()
        d["quantization"]["exclude_modules"] = list(self.quantization.exclude_modules)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["no_rope_layers"] = list(self.no_rope_layers)
        d["layer_types"] = list(self.layer_types)
        d["mlp_free_layers"] = list(self.mlp_free_layers)
        return {"format_version": CHECKPOINT_FORMAT_VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        version = d.pop("format_version", CHECKPOINT_FORMAT_VERSION)
        if version != CHECKPOINT_FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint format version {version} is not supported (this trtbuild reads version "
                f"{CHECKPOINT_FORMAT_VERSION}); re-run `trtbuild convert` with this version."
            )
        mapping = d.pop("mapping", {}) or {}
        quant = dict(d.pop("quantization", {}) or {})
        quant["exclude_modules"] = tuple(quant.get("exclude_modules") or ())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise CheckpointError(f"unknown fields in checkpoint config.json: {sorted(unknown)}; is this a checkpoint "
                                  "written by `trtbuild convert`?")
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["no_rope_layers"] = tuple(d.get("no_rope_layers") or ())
        d["layer_types"] = tuple(d.get("layer_types") or ())
        d["mlp_free_layers"] = tuple(d.get("mlp_free_layers") or ())
        try:
            return cls(
                **d,
                mapping=Mapping(tp_size=mapping.get("tp_size", 1), pp_size=mapping.get("pp_size", 1)),
                quantization=QuantConfig(**quant),
            )
        except TypeError as e:
            raise CheckpointError(f"checkpoint config.json is incomplete: {e}") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise CheckpointError(f"{path} not found: is this a checkpoint made by `trtbuild convert`?") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); re-run `trtbuild convert`.") from None

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    def window_applies(self, max_seq_len: int) -> bool:
        """Whether an engine of `max_seq_len` positions must apply the sliding window: only where a sequence can
        outgrow it (within it, full attention is the same thing)."""
        return bool(self.sliding_window) and max_seq_len > self.sliding_window

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within the sliding window (when the model has one)."""
        return bool(self.sliding_window) and self.layer_types[layer] == "sliding_attention"

    def has_mlp(self, layer: int) -> bool:
        """Whether `layer` has an MLP (or experts) after its attention / mixer: all but mlp_free_layers."""
        return layer not in self.mlp_free_layers

    def has_experts(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (LFM2-MoE's first moe_dense_layers are dense)."""
        return self.is_moe and layer >= self.moe_dense_layers

    def is_conv(self, layer: int) -> bool:
        return self.layer_types[layer] == "conv"

    def is_linear_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def is_mamba(self, layer: int) -> bool:
        return self.layer_types[layer] == "mamba"

    def has_conv_rows(self, layer: int) -> bool:
        """Whether `layer` keeps its last conv_kernel input rows in the pool (plugins/short_conv.py)."""
        return self.layer_types[layer] in ("conv", "linear_attention", "mamba")

    def conv_channels(self, layer: int) -> int:
        """Channels of a convolving layer's rows: LFM2's hidden size, a linear attention layer's q, k and v, a Mamba2
        layer's x, B and C."""
        if self.is_mamba(layer):
            return self.mamba_inner_size + 2 * self.mamba_num_groups * self.mamba_state_size
        return self.hidden_size if self.is_conv(layer) else 2 * self.linear_key_size + self.linear_value_size

    @property
    def mamba_inner_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers with a per-sequence recurrent state (linear_attention, mamba), in order: state layer j is
        layer recurrent_layers[j]."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ("linear_attention", "mamba"))

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """One layer's state of one sequence, float32: [value heads, key dim, value dim] (gated DeltaNet), or [heads,
        head dim, state size] (Mamba2)."""
        if "mamba" in self.layer_types:
            return self.mamba_num_heads, self.mamba_head_dim, self.mamba_state_size
        return self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim

    @property
    def score_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_size**-0.5

    def with_mapping(self, mapping: Mapping) -> ModelConfig:
        return dataclasses.replace(self, mapping=mapping)
