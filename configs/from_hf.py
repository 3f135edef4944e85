"""Hugging Face `config.json` -> ModelConfig, for every supported family (and the text decoders of TEXT_MODELS_OF),
refusing what the engine cannot run faithfully. GGUF files come here too, through the HF config dict
builder/convert/gguf_config.py makes of their metadata."""

from __future__ import annotations

import copy
from typing import Any

from trtbuild.configs import hf_rope
from trtbuild.configs.granite4 import GRANITE4_ARCHITECTURES, granite4_as_granite
from trtbuild.configs.hf_moe import moe_fields
from trtbuild.configs.hf_quantization import prequantized_weights
from trtbuild.configs.hf_recurrent import recurrent_fields, recurrent_layer_types
from trtbuild.configs.model_config import (
    COHERE_FAMILIES,
    DTYPES,
    GEMMA_FAMILIES,
    HIDDEN_ACTS,
    LFM2_FAMILIES,
    ModelConfig,
)
from trtbuild.configs.nemotron_h import nemotron_h_as_hybrid
from trtbuild.errors import CheckpointError

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
    # norms after the attention and the MLP (none before), q / k norms over the whole projections
    "Olmo2ForCausalLM": ("olmo2", False, True),
    "Olmo3ForCausalLM": ("olmo3", False, True),  # OLMo 2 with sliding-window layers (every fourth one full)
    # mixtures of experts (configs/hf_moe.py): Qwen3 with expert MLPs; Mistral with them; OLMoE: q / k norms over the
    # whole projections, norms before attention and MLP as Llama's
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
    "OlmoeForCausalLM": ("olmoe", False, True),
    "GraniteMoeForCausalLM": ("granitemoe", False, False),  # Granite's multipliers, its experts' gate and up fused
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, False),  # Qwen2 with experts and a gated shared expert
    # biases on the router and experts (and, by attention_bias, on q / k / v / o); attention sinks; sliding and full
    # layers alternate; clamped SwiGLU experts
    "GptOssForCausalLM": ("gpt_oss", False, False),
    # Llama with interleaved (GPT-J style) RoPE, tied embeddings by default
    "Ernie4_5ForCausalLM": ("ernie4_5", False, False),
    # interleaved RoPE over half of each head, q / k / v biases (attention_bias), gate and up fused, and four norms
    # per layer: before and after the attention and the MLP (Gemma 2's sandwich, in plain RMSNorms)
    "Glm4ForCausalLM": ("glm4", False, False),
    "GlmForCausalLM": ("glm", False, False),  # GLM-4-9B (the first) and GLM-Edge: GLM-4's without its output norms
    # OLMo 2's norms after attention and MLP with per-head q / k norms; with a sliding window, every fourth layer
    # full and without RoPE (NoPE), the others windowed
    "Exaone4ForCausalLM": ("exaone4", False, True),
    # LayerNorms (no bias), attention and MLP in parallel off one norm, interleaved RoPE, logits times logit_scale;
    # Cohere 2 (Command R7B): three windowed layers with RoPE, then a full one without (NoPE)
    "CohereForCausalLM": ("cohere", False, False),
    "Cohere2ForCausalLM": ("cohere2", False, False),
    # Mistral with YaRN and Llama 4's attention temperature (q scaled up past YaRN's original context)
    "Ministral3ForCausalLM": ("ministral3", False, False),
    # Llama whose MLP has no gate: down(relu(up(x))^2) (AFM-4.5B)
    "ArceeForCausalLM": ("arcee", False, False),
    # Llama with per-head q / k norms and an MLP without a gate, its activation xIELU (learned scalars per layer)
    "ApertusForCausalLM": ("apertus", False, True),
    # LayerNorms with biases, biases on every projection (use_bias), a GELU MLP without a gate, sliding windows
    "Starcoder2ForCausalLM": ("starcoder2", False, False),
    # per-head q / k norms after RoPE, NTK-alpha RoPE (a fixed, larger base)
    "HunYuanDenseV1ForCausalLM": ("hunyuan_dense", False, True),
    # short convolution layers (in_proj to B, C, x; C * conv(B * x); out_proj) among attention layers with per-head
    # q / k norms; tied embeddings
    "Lfm2ForCausalLM": ("lfm2", False, True),
    # + mixtures of experts after the first num_dense_layers: chosen by sigmoid scores plus a selection bias
    "Lfm2MoeForCausalLM": ("lfm2_moe", False, True),
    # Arcee's AFMoE (Trinity): per-head q / k norms, a sigmoid gate on the attention's output, sandwich norms, three
    # sliding layers with RoPE then a full one without, leading dense layers, then experts as LFM2-MoE's plus shared
    # ones; embeddings times sqrt(hidden) (muP)
    "AfmoeForCausalLM": ("afmoe", False, True),
    # Qwen3.5: three gated DeltaNet layers (linear attention with a recurrent state) then one full attention layer
    # with a sigmoid gate on its output, per-head q / k norms and RoPE over a quarter of each head; (1 + w) RMSNorms
    "Qwen3_5ForCausalLM": ("qwen3_5", False, True),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", False, True),  # + experts beside a gated shared expert (Qwen2-MoE's)
    # Mamba2 layers and attention layers without RoPE, each followed by a relu^2 MLP or not (configs/nemotron_h.py)
    "NemotronHForCausalLM": ("nemotron_h", False, False),
    "Mamba2ForCausalLM": ("nemotron_h", False, False),  # Mamba2 layers only, no MLP (configs/nemotron_h.py)
}
_UNGATED_MLP_FAMILIES = ("arcee", "starcoder2", "apertus", "nemotron_h")
# Vision-language models whose text decoder trtbuild builds (images are not read): HF architecture -> the text
# config's model_type (None: whatever it says) -> (the text model's architecture, the transformers config class whose
# defaults complete the released, sparse `text_config`)
TEXT_MODELS_OF: dict[str, dict[str | None, tuple[str, str]]] = {
    "Gemma3ForConditionalGeneration": {None: ("Gemma3ForCausalLM", "Gemma3TextConfig")},
    # Mistral Small 3.1 / 3.2 (a Mistral text model), Ministral 3 (3B / 8B / 14B)
    "Mistral3ForConditionalGeneration": {"mistral": ("MistralForCausalLM", "MistralConfig"),
                                         "ministral3": ("Ministral3ForCausalLM", "Ministral3Config")},
    "Lfm2VlForConditionalGeneration": {"lfm2": ("Lfm2ForCausalLM", "Lfm2Config")},  # LFM2-VL, LFM2.5-VL
    "Qwen3_5ForConditionalGeneration": {None: ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig")},  # every Qwen3.5 size
    "Qwen3_5MoeForConditionalGeneration": {None: ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig")},
}
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


def _no_rope_layers(hf: dict[str, Any], family: str, layer_types: tuple[str, ...]) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` (1: the layer applies RoPE, 0: it does not) as the indices of the NoPE layers, or
    every `no_rope_layer_interval`-th layer (4 by default) where the list is absent, as transformers makes it; a list
    longer than the layers (a model cut to its first layers) is read up to them. EXAONE 4 with a sliding window:
    its full-attention layers."""
    if family == "exaone4":
        return tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention") if layer_types else ()
    if family in ("cohere2", "afmoe"):  # NOTE: without a window transformers' Cohere 2 rotates no layer
        return tuple(i for i, kind in enumerate(layer_types or ["full_attention"] * int(hf["num_hidden_layers"]))
                     if kind == "full_attention")
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


# families whose layers alternate sliding-window and full attention -> the pattern's default period (every n-th full)
_LAYER_PATTERNS = {"gemma2": 2, "gemma3": 6, "olmo3": 4, "gpt_oss": 2, "exaone4": 4, "cohere2": 4, "afmoe": 4}


def _layer_types(hf: dict[str, Any], family: str) -> tuple[str, ...]:
    """Per-layer attention kinds (Gemma 2 / 3, OLMo 3): `layer_types`, or every `sliding_window_pattern`-th layer
    full (the family's default period unless given), as transformers makes them. LFM2's: conv or full_attention
    (its `full_attn_idxs` where `layer_types` is absent)."""
    layers = int(hf["num_hidden_layers"])
    if family in LFM2_FAMILIES:
        full = hf.get("full_attn_idxs")
        types = hf.get("layer_types") or ["full_attention" if full is None or i in full else "conv"
                                          for i in range(layers)]
        return tuple(types[:layers])
    if (recurrent := recurrent_layer_types(hf, family, layers)) is not None:
        return recurrent
    if family not in _LAYER_PATTERNS or not hf.get("sliding_window"):
        return ()
    types = hf.get("layer_types")
    pattern = hf.get("sliding_window_pattern") or _LAYER_PATTERNS[family]
    if types is None and isinstance(pattern, str):  # EXAONE 4's "LLLG": L a sliding layer, G a full one, repeated
        if not pattern or set(pattern) - set("LG"):
            raise CheckpointError(f"sliding_window_pattern {pattern!r} is not a string of L (local) and G (global).")
        types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(layers)]
    elif types is None:
        types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    return tuple(types[:layers])


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
        "output_norms": True,
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

    kinds = TEXT_MODELS_OF[archs[0]]
    kind = (hf.get("text_config") or {}).get("model_type")
    if kind not in kinds and None not in kinds:
        raise CheckpointError(f"the {archs[0]}'s text model is a {kind!r}; trtbuild builds its "
                              f"{', '.join(k for k in kinds if k)} text models.")
    text_arch, config_class = kinds.get(kind) or kinds[None]
    try:
        text = getattr(transformers, config_class)(**copy.deepcopy(hf.get("text_config") or {})).to_dict()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the model's config.json has an invalid text_config ({e}).") from None
    dtype = hf.get("torch_dtype") or hf.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    eos = hf.get("eos_token_id", text.get("eos_token_id"))
    quant = {"quantization_config": hf["quantization_config"]} if hf.get("quantization_config") else {}
    return {**text, "architectures": [text_arch], "torch_dtype": dtype, "eos_token_id": eos, **quant}


def _granite_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Granite's multipliers as ModelConfig fields (1 where a config leaves one out, as transformers defaults it)."""
    if family not in ("granite", "granitemoe"):
        return {}
    return {"embedding_multiplier": float(hf.get("embedding_multiplier") or 1.0),
            "attention_scale": float(hf.get("attention_multiplier") or 1.0),
            "residual_multiplier": float(hf.get("residual_multiplier") or 1.0),
            "logits_scaling": float(hf.get("logits_scaling") or 1.0)}


def _intermediate_size(hf: dict[str, Any], family: str) -> int:
    """The MLP's features; LFM2's: two thirds of block_ff_dim (intermediate_size) times block_ffn_dim_multiplier,
    rounded up to block_multiple_of, where block_auto_adjust_ff_dim (as transformers)."""
    if family != "lfm2":
        return int(hf["intermediate_size"])
    features = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if not hf.get("block_auto_adjust_ff_dim", True):
        return features
    features = int(2 * features / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return features
    multiple = int(hf.get("block_multiple_of", 256))
    return -(-int(float(multiplier) * features) // multiple) * multiple


def _lfm2_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """LFM2's convolution layers' kernel length and biases."""
    if family not in LFM2_FAMILIES:
        return {}
    return {"conv_kernel": int(hf.get("conv_L_cache", 3)), "conv_bias": bool(hf.get("conv_bias", False))}


def _norm_epsilon(hf: dict[str, Any], family: str) -> float:
    """The norms' epsilon, under each family's key."""
    if family in LFM2_FAMILIES:
        return float(hf.get("norm_eps") or 1e-5)
    if family in COHERE_FAMILIES:
        return float(hf.get("layer_norm_eps") or 1e-5)
    if family == "starcoder2":
        return float(hf.get("norm_epsilon") or 1e-5)
    return float(hf.get("rms_norm_eps", 1e-6))


def _norm_layout(family: str) -> dict[str, Any]:
    """Where the family's layers normalize, beyond Llama's norms before attention and MLP."""
    if family in ("olmo2", "olmo3", "exaone4"):  # after them instead (OLMo 2 / 3 normalize q / k whole)
        return {"output_norms": True, "input_norms": False, "qk_norm_full": family != "exaone4"}
    if family in ("glm4", "afmoe"):  # before and after them
        return {"output_norms": True}
    if family in COHERE_FAMILIES:  # one LayerNorm both read
        return {"norm_type": "layer", "parallel_residual": True}
    if family == "starcoder2":  # LayerNorms with biases where Llama has RMSNorms
        return {"norm_type": "layer", "norm_bias": True}
    if family == "hunyuan_dense":
        return {"qk_norm_after_rope": True}
    return {"qk_norm_full": True} if family == "olmoe" else {}


def _cohere_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Cohere's logit_scale (the logits' multiplier, 1/16 unless given), refusing its per-head q / k LayerNorms."""
    if family not in COHERE_FAMILIES:
        return {}
    if hf.get("use_qk_norm"):
        raise CheckpointError("use_qk_norm=true (Command R+'s per-head q / k LayerNorms) is not supported.")
    return {"logits_scaling": 1.0 / float(hf.get("logit_scale") or 0.0625)}


def _afmoe_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """AFMoE's attention output gate and muP embedding scale."""
    if family != "afmoe":
        return {}
    return {"attention_output_gate": True,
            "embedding_multiplier": float(hf["hidden_size"]) ** 0.5 if hf.get("mup_enabled") else 1.0}


def _gpt_oss_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """gpt-oss's attention sinks and clamped SwiGLU (its q / k / v / o biases are `attention_bias`'s)."""
    if family != "gpt_oss":
        return {}
    return {"attention_sinks": True, "hidden_act": "swiglu_oai", "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0))}


def _model_config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    prequantized_weights(hf)  # NOTE: refuses a quantization the readers do not undo (configs/hf_quantization.py)
    hf = nemotron_h_as_hybrid(granite4_as_granite(text_model_config(hf)))
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if isinstance(arch, str) and arch.endswith("Model") and arch[:-5] + "ForCausalLM" in SUPPORTED_ARCHITECTURES:
        arch = arch[:-5] + "ForCausalLM"  # its base model without the head, as embedding models are saved
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise CheckpointError(f"unsupported architecture {arch!r}; trtbuild converts {known}, "
                              f"{', '.join(GRANITE4_ARCHITECTURES)}, and the text models of "
                              f"{', '.join(TEXT_MODELS_OF)}.")
    family, qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
    # NOTE: these families' attention_bias puts a bias on the output projection too
    dense_bias = family in ("llama", "granite", "granitemoe", "gpt_oss", *COHERE_FAMILIES) and bool(
        hf.get("attention_bias", False)) or (family == "starcoder2" and bool(hf.get("use_bias", True)))
    qkv_bias = qkv_bias or dense_bias or (family in ("glm", "glm4") and bool(hf.get("attention_bias", True)))
    mlp_bias = bool(hf.get("mlp_bias")) or (family == "starcoder2" and dense_bias)
    if family == "ernie4_5" and hf.get("use_bias"):
        raise CheckpointError("ERNIE 4.5 with use_bias (biases on every projection) is not supported.")
    if mlp_bias and family not in ("llama", "starcoder2"):
        raise CheckpointError(f"biases on the MLP's projections (mlp_bias) are not supported for {family}.")
    if family in ("glm", "glm4") and "partial_rotary_factor" not in hf and "partial_rotary_factor" not in (
            hf.get("rope_parameters") or {}):
        hf = {**hf, "partial_rotary_factor": 0.5}  # Glm4Config's default
    heads = int(hf["num_attention_heads"])
    head_size = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    hf = hf_rope.with_ntk_alpha(hf, head_size) if family == "hunyuan_dense" else hf
    rope_params, local_base = hf_rope.rope_parameters(hf, family)
    rotary_dim = hf_rope.rotary_dim(hf, rope_params, head_size)
    rope_scaling = hf_rope.rope_scaling(hf, rope_params, rotary_dim or head_size, family)
    # the families whose HF attention honours sliding_window (Gemma 2 / 3 in their sliding layers)
    window_by_default = family in ("mistral", "mixtral", "phi3", "ministral3", "starcoder2", *_LAYER_PATTERNS)
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
        intermediate_size=_intermediate_size(hf, family),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_size=head_size,
        norm_epsilon=_norm_epsilon(hf, family),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        rotary_base=float(hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
        rotary_scaling=rope_scaling,
        rotary_dim=rotary_dim,
        rotary_interleaved=family in ("ernie4_5", "glm", "glm4", *COHERE_FAMILIES),
        no_rope_layers=_no_rope_layers(hf, family, layer_types if window else ()),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", hf.get("tie_embedding", family in (
            *GEMMA_FAMILIES, *COHERE_FAMILIES, *LFM2_FAMILIES, "ernie4_5", "starcoder2")))),
        qkv_bias=qkv_bias,
        dense_bias=dense_bias,
        qk_norm=qk_norm,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=int(window) if window else None,
        **(_gpt_oss_fields(hf, family) or {"hidden_act": _hidden_act(hf, family)}),
        gated_mlp=family not in _UNGATED_MLP_FAMILIES,
        mlp_bias=mlp_bias,
        layer_types=layer_types,
        mlp_free_layers=tuple(hf.get("mlp_free_layers") or ()),
        local_rotary_base=local_base if window and "sliding_attention" in layer_types else None,
        **_gemma_fields(hf, family, hf_dtype if hf_dtype in DTYPES else "float32"),
        **_granite_fields(hf, family),
        **_afmoe_fields(hf, family),
        **_cohere_fields(hf, family),
        **hf_rope.temperature_fields(hf.get("rope_scaling") or rope_params),
        **moe_fields(hf, family),
        **_lfm2_fields(hf, family),
        **recurrent_fields(hf, family),
        **_norm_layout(family),
    )
