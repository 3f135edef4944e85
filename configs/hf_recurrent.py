"""The fields of HF configs with recurrent layers (configs/from_hf.py): Qwen3.5's gated DeltaNet layers, and Granite
4.0-H's Mamba2 layers (mapped by configs/granite4.py)."""

from __future__ import annotations

from typing import Any

from trtbuild.configs.granite4 import MAMBA_FIELDS
from trtbuild.configs.model_config import QWEN35_FAMILIES


def recurrent_layer_types(hf: dict[str, Any], family: str, layers: int) -> tuple[str, ...] | None:
    """Qwen3.5's layer types as Qwen3_5TextConfig makes them (every full_attention_interval-th layer full, the others
    linear_attention) and Granite 4.0-H's (mamba or full_attention); None for another family or an attention-only
    Granite."""
    if family in ("granite", "granitemoe", "nemotron_h") and hf.get("layer_types"):
        return tuple(hf["layer_types"][:layers])
    if family in QWEN35_FAMILIES:
        interval = int(hf.get("full_attention_interval") or 4)
        types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(layers)]
        return tuple(types[:layers])
    return None


def recurrent_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Qwen3.5's gated DeltaNet layers' heads and convolution, and its attention's output gate (NOTE: its RoPE is
    MRoPE, mrope_section, which for text, equal temporal, height and width positions, is plain RoPE); Granite
    4.0-H's Mamba2 fields."""
    if family not in QWEN35_FAMILIES:
        return dict(hf.get(MAMBA_FIELDS) or {})
    return {"attention_output_gate": True, "conv_kernel": int(hf.get("linear_conv_kernel_dim", 4)),
            "linear_value_heads_tiled": bool(hf.get("linear_value_heads_tiled")),  # a GGUF's (gguf_qwen35.py)
            **{key: int(hf[key]) for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                             "linear_value_head_dim")}}
