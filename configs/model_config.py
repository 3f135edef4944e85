"""The unified checkpoint's `config.json` schema (see docs/checkpoint.md) and its mapping from Hugging Face configs.

One `ModelConfig` describes every supported decoder family; the family only switches features
(`qkv_bias` for Qwen2, `qk_norm` for Qwen3). Nothing reads global state: every consumer gets this object.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild import CHECKPOINT_FORMAT_VERSION
from trtbuild.errors import CheckpointError
from trtbuild.quantization import LM_HEAD_QUANT_ALGOS, QUANT_ALGOS, KVCacheQuantAlgo, QuantAlgo

# HF `architectures[0]` -> (family, qkv_bias, qk_norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    # q/k/v and gate/up fused in the source (builder/convert/fused.py splits them); LongRoPE in the 128k variants
    "Phi3ForCausalLM": ("phi3", False, False),
    "SmolLM3ForCausalLM": ("smollm3", False, False),  # Llama with some layers' RoPE left out (NoPE)
    # GeGLU, (1 + w) RMSNorms, embeddings scaled by sqrt(hidden); Gemma 2 / 3 add sandwich norms and alternate
    # sliding-window and full attention layers, Gemma 2 soft-caps logits, Gemma 3 normalizes q and k
    "GemmaForCausalLM": ("gemma", False, False),
    "Gemma2ForCausalLM": ("gemma2", False, False),
    "Gemma3ForCausalLM": ("gemma3", False, True),
    # Llama with multipliers: of the embeddings, attention scores, residual branches and (dividing) the logits
    "GraniteForCausalLM": ("granite", False, False),
}
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")
# Vision-language models whose text decoder trtbuild builds (images are not read): HF architecture -> (the text
# model's architecture, the transformers config class whose defaults complete the released, sparse `text_config`)
TEXT_MODELS_OF: dict[str, tuple[str, str]] = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "Gemma3TextConfig"),
}
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation: SwiGLU, or GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
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


# Scale tensors each quantized linear `P` carries besides `P.weight` (format: docs/quantization.md).
QUANT_SCALES: dict[str, tuple[str, ...]] = {
    QuantAlgo.FP8: ("weights_scaling_factor", "activation_scaling_factor"),
    QuantAlgo.INT4_AWQ: ("weights_scaling_factor", "prequant_scaling_factor"),
    QuantAlgo.INT8_SQ: ("weights_scaling_factor", "activation_scaling_factor", "prequant_scaling_factor"),
    QuantAlgo.INT8_WO: ("weights_scaling_factor",),
    QuantAlgo.WEIGHT_ONLY: ("weights_scaling_factor",),  # + weights_zero_point where the linear has one
}


@dataclass(frozen=True)
class QuantConfig:
    """Quantization of weights and KV cache; all None means full precision (docs/quantization.md)."""

    quant_algo: str | None = None  # QUANT_ALGOS (trtbuild.quantization)
    kv_cache_quant_algo: str | None = None  # KVCacheQuantAlgo
    # int4_awq: input features per weight scale (128 unless set); weight_only: the one group size of every linear
    # (null: per output channel, or differing between linears)
    group_size: int | None = None
    has_zero_point: bool = False  # weight_only: some linears carry weights_zero_point
    pre_quant_scale: bool = False  # linears carry prequant_scaling_factor (int4_awq, int8_sq)
    exclude_modules: tuple[str, ...] = ()  # fnmatch patterns over linear prefixes kept unquantized
    # q/k/v and gate/up of each layer carry identical prequant / activation (and fp8 weight) scales, so an engine
    # may fuse them into one GEMM (TensorRT-LLM style); false: every linear keeps its own calibrated scales
    shared_input_scales: bool = False
    smoothquant_alpha: float | None = None  # int8_sq: SmoothQuant migration strength in [0, 1] (null: unrecorded)
    # int8_sq: activations quantized per token with a dynamic scale (max |x| of the token / 127, computed at run
    # time; no activation_scaling_factor) instead of one static calibrated scale per linear
    per_token_activations: bool = False
    # lm_head in its own format (LM_HEAD_QUANT_ALGOS) while `exclude_modules` keeps it out of quant_algo
    lm_head_quant_algo: str | None = None
    # weight_only: the embedding table is stored in the weight_only form too (8-bit or symmetric 4-bit, no zero
    # points) and gathered by ONNX Runtime's GatherBlockQuantized
    embedding_weight_only: bool = False

    def __post_init__(self) -> None:
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"checkpoint quantization config: {what}; re-run `trtbuild quantize`.")

        if self.quant_algo not in (None, *QUANT_ALGOS):
            raise bad(f"quant_algo {self.quant_algo!r} is not one of {', '.join(QUANT_ALGOS)} or null")
        if self.kv_cache_quant_algo not in (None, *KVCacheQuantAlgo):
            raise bad(f"kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not one of "
                      f"{', '.join(KVCacheQuantAlgo)} or null")
        if self.has_zero_point and self.quant_algo != QuantAlgo.WEIGHT_ONLY:
            raise bad("has_zero_point=true (asymmetric weights) is only supported with quant_algo weight_only")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise bad(f"group_size {self.group_size!r} is not a positive integer")
        if self.group_size is not None and self.quant_algo not in (QuantAlgo.INT4_AWQ, QuantAlgo.WEIGHT_ONLY):
            raise bad(f"group_size is only meaningful for int4_awq and weight_only, not {self.quant_algo!r}")
        if bool(self.pre_quant_scale) != (self.quant_algo in (QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ)):
            raise bad(f"pre_quant_scale={self.pre_quant_scale} does not match quant_algo {self.quant_algo!r}")
        if not all(isinstance(p, str) for p in self.exclude_modules):
            raise bad("exclude_modules must be a list of strings")
        if not isinstance(self.shared_input_scales, bool):
            raise bad(f"shared_input_scales {self.shared_input_scales!r} is not true or false")
        if self.shared_input_scales and self.quant_algo is None:
            raise bad("shared_input_scales=true needs a quant_algo")
        if not isinstance(self.per_token_activations, bool):
            raise bad(f"per_token_activations {self.per_token_activations!r} is not true or false")
        if self.per_token_activations and self.quant_algo != QuantAlgo.INT8_SQ:
            raise bad(f"per_token_activations is only meaningful for int8_sq, not {self.quant_algo!r}")
        alpha = self.smoothquant_alpha
        if alpha is not None and self.quant_algo != QuantAlgo.INT8_SQ:
            raise bad(f"smoothquant_alpha is only meaningful for int8_sq, not {self.quant_algo!r}")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                                  or not 0.0 <= alpha <= 1.0):
            raise bad(f"smoothquant_alpha {alpha!r} is not a number in [0, 1]")
        if self.embedding_weight_only is not False and (self.embedding_weight_only is not True
                                                         or self.quant_algo != QuantAlgo.WEIGHT_ONLY):
            raise bad(f"embedding_weight_only={self.embedding_weight_only!r} needs quant_algo weight_only")
        if self.lm_head_quant_algo not in (None, *LM_HEAD_QUANT_ALGOS):
            raise bad(f"lm_head_quant_algo {self.lm_head_quant_algo!r} is not one of {', '.join(LM_HEAD_QUANT_ALGOS)} "
                      "or null")
        if self.lm_head_quant_algo is not None and not self.is_excluded("lm_head"):
            raise bad(f"lm_head_quant_algo={self.lm_head_quant_algo} but exclude_modules does not exclude lm_head from "
                      f"quant_algo {self.quant_algo}")

    @property
    def weight_group_size(self) -> int:
        """int4_awq group size (input features per scale)."""
        return self.group_size or 128

    def is_excluded(self, prefix: str) -> bool:
        """Whether the linear with checkpoint prefix `prefix` (e.g. `lm_head`) stays unquantized."""
        return self.quant_algo is None or any(fnmatch.fnmatchcase(prefix, p) for p in self.exclude_modules)

    def algo_of(self, prefix: str) -> str | None:
        """The format of the linear `prefix`: quant_algo, lm_head_quant_algo for lm_head, or None (full precision)."""
        if prefix == "lm_head" and self.lm_head_quant_algo is not None:
            return self.lm_head_quant_algo
        return None if self.is_excluded(prefix) else self.quant_algo

    def scale_names(self, prefix: str) -> tuple[str, ...]:
        """Scale tensors the linear `prefix` carries (none when excluded or unquantized)."""
        algo = self.algo_of(prefix)
        if algo is None:
            return ()
        names = QUANT_SCALES[algo]
        if self.per_token_activations and algo == self.quant_algo:
            names = tuple(n for n in names if n != "activation_scaling_factor")
        return tuple(f"{prefix}.{s}" for s in names)


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
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention applies no RoPE (SmolLM3: every fourth)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"  # HIDDEN_ACTS
    sliding_window: int | None = None  # each token sees its last sliding_window tokens (builder/network.py)
    # per layer, LAYER_TYPES: only sliding_attention layers apply sliding_window (Gemma 2 / 3). Not given: every
    # layer alike (sliding_attention where the model has a window), filled in on creation so config.json says it
    layer_types: tuple[str, ...] = ()
    local_rotary_base: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3); None: as every layer
    embedding_multiplier: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # what q.k is multiplied by; None: head_size ** -0.5
    sandwich_norms: bool = False  # attention and MLP outputs are RMS-normalized before their residual adds
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    residual_multiplier: float = 1.0  # attention and MLP outputs are multiplied by this before their adds (Granite)
    logits_scaling: float = 1.0  # the logits are divided by this (Granite)
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
        if self.hidden_act not in HIDDEN_ACTS:
            raise CheckpointError(f"config.json: hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got "
                                  f"{self.hidden_act!r}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)  # frozen: set once, here
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise CheckpointError(f"config.json: layer_types must list one of {', '.join(LAYER_TYPES)} per layer "
                                  f"({self.num_hidden_layers}), got {list(self.layer_types)}")
        for name in ("local_rotary_base", "attention_scale", "attn_logit_softcapping", "final_logit_softcapping",
                     "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or not value > 0):
                raise CheckpointError(f"config.json: {name} must be null or a positive number, got {value!r}")
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
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_size

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within the sliding window (when the model has one)."""
        return bool(self.sliding_window) and self.layer_types[layer] == "sliding_attention"

    @property
    def score_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_size**-0.5

    def with_mapping(self, mapping: Mapping) -> ModelConfig:
        return dataclasses.replace(self, mapping=mapping)


def model_config_from_hf(hf: dict[str, Any], dtype: str = "auto") -> ModelConfig:
    """Map a Hugging Face `config.json` dict to a ModelConfig, refusing what the engine cannot run faithfully."""
    if not isinstance(hf, dict):
        raise CheckpointError("the model's config.json is not a JSON object.")
    try:
        return _model_config_from_hf(hf, dtype)
    except KeyError as e:
        raise CheckpointError(f"the model's config.json lacks the field {e}; it is incomplete.") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise CheckpointError(f"the model's config.json has an invalid value ({e}).") from None


def _rotary_dim(hf: dict[str, Any], rope_params: dict[str, Any], head_size: int) -> int | None:
    """Dimensions RoPE rotates per head when fewer than all (HF: int(head_dim * partial_rotary_factor))."""
    scaling = hf.get("rope_scaling") or rope_params
    factor = float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    dim = int(round(head_size * factor, 6))  # HF: int(head_dim * factor), which 0.1-style factors can round down
    if dim == head_size:
        return None
    if not 0 < dim < head_size or dim % 2:
        raise CheckpointError(f"partial_rotary_factor {factor} rotates {dim} of {head_size} head dimensions; it "
                              "must rotate an even number of them.")
    return dim


def _rope_scaling(hf: dict[str, Any], rope_params: dict[str, Any], rotary_dim: int) -> dict[str, Any] | None:
    """The checkpoint's `rotary_scaling`: None for plain RoPE, else the HF scaling parameters and their rope_type
    (LongRoPE's: short_factor, long_factor, original_max_position_embeddings, and factor or attention_factor where
    the model gives them)."""
    scaling = hf.get("rope_scaling") or rope_params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are).")
    if rope_type == "default":
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    out["rope_type"] = rope_type
    if rope_type == "longrope":
        out["original_max_position_embeddings"] = int(
            scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
            or hf["max_position_embeddings"])
        for key in ("short_factor", "long_factor"):
            if len(out[key]) != rotary_dim // 2:
                raise CheckpointError(f"rope scaling {key} has {len(out[key])} values; LongRoPE needs one per "
                                      f"rotated pair of the head ({rotary_dim // 2}).")
    return out


def _no_rope_layers(hf: dict[str, Any], family: str) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` (1: the layer applies RoPE, 0: it does not) as the indices of the NoPE layers, or
    every `no_rope_layer_interval`-th layer (4 by default) where the list is absent, as transformers makes it; a list
    longer than the layers (a model cut to its first layers) is read up to them."""
    layers = int(hf["num_hidden_layers"])
    flags = hf.get("no_rope_layers")
    if flags is None and family == "smollm3":
        interval = int(hf.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return tuple(i for i, use in enumerate((flags or [])[:layers]) if not use)


def _hidden_act(hf: dict[str, Any], family: str) -> str:
    """The MLP activation: SwiGLU's silu, or Gemma's tanh-approximated GELU (Gemma 1 configs say "gelu" for it, as
    transformers reads them)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if family == "gemma" and act == "gelu":
        return "gelu_pytorch_tanh"
    if act not in HIDDEN_ACTS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; {', '.join(HIDDEN_ACTS)} are.")
    return act


def _round_to_dtype(value: float, dtype: str) -> float:
    import torch

    return float(torch.tensor(value, dtype=getattr(torch, dtype)).item())


def _layer_types(hf: dict[str, Any], family: str) -> tuple[str, ...]:
    """Gemma 2 / 3's per-layer attention kinds: `layer_types`, or every `sliding_window_pattern`-th layer full
    (Gemma 2: 2, Gemma 3: 6 unless given), as transformers makes them."""
    layers = int(hf["num_hidden_layers"])
    if family not in ("gemma2", "gemma3") or not hf.get("sliding_window"):
        return ()
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or (2 if family == "gemma2" else 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return tuple(types[:layers])


def _rope_parameters(hf: dict[str, Any], family: str) -> tuple[dict[str, Any], float | None]:
    """(the RoPE parameters of the full-attention layers, the sliding layers' base when it differs: Gemma 3's)."""
    params = hf.get("rope_parameters") or {}
    if family != "gemma3":
        return params, None
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"Gemma 3 sliding-attention RoPE of type {local['rope_type']!r} is not supported.")
    base = local.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0
    return params.get("full_attention") or {"rope_theta": hf.get("rope_theta") or 1_000_000.0}, float(base)


def _gemma_fields(hf: dict[str, Any], family: str, dtype: str) -> dict[str, Any]:
    """What Gemma models do differently from Llama, as ModelConfig fields."""
    if family not in GEMMA_FAMILIES:
        return {}
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError("this Gemma attends bidirectionally (an embedding model); trtbuild builds decoders.")
    # NOTE: transformers multiplies by sqrt(hidden) rounded to the weights' dtype (a bfloat16 Gemma 3 1B: 34.0,
    # not 33.94); a GGUF's config gives llama.cpp's float32 value itself.
    multiplier = hf.get("embedding_multiplier") or _round_to_dtype(int(hf["hidden_size"]) ** 0.5, dtype)
    if family == "gemma":
        return {"embedding_multiplier": float(multiplier)}

    def optional(key: str) -> float | None:
        return float(hf[key]) if hf.get(key) else None

    scalar = optional("query_pre_attn_scalar")
    return {
        "embedding_multiplier": float(multiplier),
        "attention_scale": scalar**-0.5 if scalar else None,
        "sandwich_norms": True,
        "attn_logit_softcapping": optional("attn_logit_softcapping"),
        "final_logit_softcapping": optional("final_logit_softcapping"),
    }


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The HF config of a vision-language model's text decoder (TEXT_MODELS_OF): its `text_config` completed with
    transformers' defaults, as transformers reads it; any other config as it is."""
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    if not isinstance(archs, list) or not archs or archs[0] not in TEXT_MODELS_OF:
        return hf
    import transformers

    text_arch, config_class = TEXT_MODELS_OF[archs[0]]
    try:
        text = getattr(transformers, config_class)(**copy.deepcopy(hf.get("text_config") or {})).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the model's config.json has an invalid text_config ({e}).") from None
    dtype = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    eos = hf.get("eos_token_id", text.get("eos_token_id"))
    return {**text, "architectures": [text_arch], "torch_dtype": dtype, "eos_token_id": eos}


def _granite_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Granite's multipliers as ModelConfig fields (1 where a config leaves one out, as transformers defaults it)."""
    if family != "granite":
        return {}
    return {"embedding_multiplier": float(hf.get("embedding_multiplier") or 1.0),
            "attention_scale": float(hf.get("attention_multiplier") or 1.0),
            "residual_multiplier": float(hf.get("residual_multiplier") or 1.0),
            "logits_scaling": float(hf.get("logits_scaling") or 1.0)}


def _model_config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    hf = text_model_config(hf)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {arch!r}; trtbuild converts {', '.join(SUPPORTED_ARCHITECTURES)} and the "
            f"text models of {', '.join(TEXT_MODELS_OF)}."
        )
    family, qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    if family in ("llama", "granite") and hf.get("attention_bias"):
        qkv_bias = True
    if hf.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported.")
    heads = int(hf["num_attention_heads"])
    head_size = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    rope_params, local_base = _rope_parameters(hf, family)
    rotary_dim = _rotary_dim(hf, rope_params, head_size)
    rope_scaling = _rope_scaling(hf, rope_params, rotary_dim or head_size)
    # the families whose HF attention honours sliding_window (Gemma 2 / 3 in their sliding layers)
    window_by_default = family in ("mistral", "phi3", "gemma2", "gemma3")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", window_by_default) else None
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    hf_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype == "auto":
        dtype = hf_dtype if hf_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}.")
    layer_types = _layer_types(hf, family)
    return ModelConfig(
        architecture=arch,
        family=family,
        dtype=dtype,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_size=head_size,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rotary_base=float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
        rotary_scaling=rope_scaling,
        rotary_dim=rotary_dim,
        no_rope_layers=_no_rope_layers(hf, family),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family in GEMMA_FAMILIES)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window else None,
        hidden_act=_hidden_act(hf, family),
        layer_types=layer_types,
        local_rotary_base=local_base if window and "sliding_attention" in layer_types else None,
        **_gemma_fields(hf, family, hf_dtype if hf_dtype in DTYPES else "float32"),
        **_granite_fields(hf, family),
    )
