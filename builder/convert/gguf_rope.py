"""A GGUF's RoPE as the Hugging Face config the file was made from holds it (builder/convert/gguf_config.py): llama 3's
frequency factors, Phi-3's LongRoPE factors, YaRN and linear scaling, from llama.cpp's keys and tensors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trtbuild.errors import CheckpointError


def f32(x: float) -> float:
    """Shortest decimal that round-trips a float32 metadata value (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in rope_freqs.weight for rope_type llama3."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, out))


def _longrope(meta: dict[str, Any], prefix: str, long: np.ndarray, short: np.ndarray, cfg: dict[str, Any]
              ) -> dict[str, Any]:
    """Phi-3's LongRoPE as HF's config holds it, from the factor tensors llama.cpp's converter writes."""
    from trtbuild.builder.rope import longrope_attention_factor

    orig = int(meta.get(f"{prefix}.rope.scaling.original_context_length") or cfg["max_position_embeddings"])
    scaling = {"rope_type": "longrope", "long_factor": [f32(x) for x in long.ravel()],
               "short_factor": [f32(x) for x in short.ravel()], "original_max_position_embeddings": orig}
    attn = meta.get(f"{prefix}.rope.scaling.attn_factor")
    default = longrope_attention_factor(cfg["max_position_embeddings"] / orig, orig)
    if attn is not None and not math.isclose(attn, default, rel_tol=1e-6):  # else HF's default, to float32 rounding
        scaling["attention_factor"] = f32(attn)
    return scaling


# GGUF architectures whose HF models run YaRN with its ramp's bounds unrounded (GptOssConfig: truncate false), which a
# GGUF does not record
_YARN_UNTRUNCATED = ("gpt-oss",)


def _yarn(meta: dict[str, Any], prefix: str, factor: float | None, cfg: dict[str, Any]) -> dict[str, Any]:
    """YaRN as the HF config the file was made from holds it: llama.cpp's converter (TextModel.set_gguf_parameters)
    writes its factor and original context, and beta_fast, beta_slow and attention_factor (as yarn_attn_factor)
    where the config gives them.

    NOTE: llama.cpp runs some files differently from transformers. It reads the yarn_* keys only for a few
    architectures (grok all but the log multiplier; mistral3 the betas and the log multiplier; the DeepSeeks the log
    multiplier): it runs trtbuild's others with betas 32 / 1 and the attention scaling 0.1 ln(factor) + 1 whatever
    the file says, where this follows the HF model the file was made from. It always
    rounds the ramp's bounds (transformers' truncate: true; gpt-oss's HF config says false). Its generic
    `rope.scaling.attn_factor` multiplies the YaRN scaling, as here."""

    def key(name: str) -> Any:
        return meta.get(f"{prefix}.rope.scaling.{name}")

    if not factor:
        raise CheckpointError(f"This GGUF's RoPE scaling is yarn but it gives no {prefix}.rope.scaling.factor; the "
                              "file is incomplete: re-export it.")
    ext = key("yarn_ext_factor")
    if ext is not None and f32(ext) != 1.0:
        raise CheckpointError(f"This GGUF blends YaRN's frequencies by {prefix}.rope.scaling.yarn_ext_factor {ext}; "
                              "trtbuild runs YaRN as transformers does, fully blended (1).")
    original = int(key("original_context_length") or cfg["max_position_embeddings"])  # llama.cpp's default too
    scaling = {"rope_type": "yarn", "factor": f32(factor), "original_max_position_embeddings": original}
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                         ("attention_factor", "yarn_attn_factor")):
        if (value := key(theirs)) is not None:
            scaling[ours] = f32(value)
    if log_multiplier := key("yarn_log_multiplier"):  # as llama-context.cpp reads it: mscale_all_dim, mscale 1
        scaling.update(mscale=1.0, mscale_all_dim=f32(log_multiplier))
    if (multiplier := key("attn_factor")) is not None and f32(multiplier) != 1.0:
        from trtbuild.builder.rope import yarn_attention_factor

        scaling["attention_factor"] = yarn_attention_factor(scaling, scaling["factor"]) * f32(multiplier)
    if prefix in _YARN_UNTRUNCATED:
        scaling["truncate"] = False
    return scaling


def rope_scaling(
    meta: dict[str, Any], prefix: str, rope_tensors: dict[str, np.ndarray], cfg: dict[str, Any]
) -> dict[str, Any] | None:
    kind = str(meta.get(f"{prefix}.rope.scaling.type", "none")).lower()
    factor = meta.get(f"{prefix}.rope.scaling.factor", meta.get(f"{prefix}.rope.scale_linear"))
    orig = meta.get(f"{prefix}.rope.scaling.original_context_length")
    long, short = (rope_tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if (long is None) != (short is None):
        raise CheckpointError("This GGUF has one of rope_factors_long.weight and rope_factors_short.weight but not "
                              "the other; LongRoPE needs both. The file is incomplete: re-export it.")
    if long is not None and short is not None:
        return _longrope(meta, prefix, long, short, cfg)
    rope_freqs = rope_tensors.get("rope_freqs.weight")
    if rope_freqs is not None:  # llama 3.1+ : llama.cpp stores the llama3 frequency factors as a tensor
        rf = rope_freqs.astype(np.float64).ravel()
        scaling = {
            "rope_type": "llama3",
            "factor": f32(rf.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(orig or 8192),
        }
        args = (scaling["factor"], 1.0, 4.0, scaling["original_max_position_embeddings"])
        if len(rf) * 2 == cfg["head_dim"] and np.allclose(
            _llama3_factors(cfg["rope_theta"], cfg["head_dim"], *args), rf, rtol=1e-4, atol=1e-4
        ):
            return scaling
        raise CheckpointError(
            "This GGUF has a rope_freqs.weight tensor that does not match llama3 RoPE scaling "
            "(low/high freq factor 1/4); such per-frequency RoPE factors are not supported."
        )
    if kind == "none" and factor and factor != 1.0:  # old files: {arch}.rope.scale_linear only
        kind = "linear"
    if kind in ("none", ""):
        return None
    if kind == "yarn":
        return _yarn(meta, prefix, factor, cfg)
    if kind != "linear" or not factor:
        raise CheckpointError(f"GGUF RoPE scaling type {kind!r} is not supported (only linear, yarn and llama3).")
    scaling = {"rope_type": kind, "factor": f32(factor)}
    if orig:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling
