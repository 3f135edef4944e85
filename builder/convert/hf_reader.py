"""Read a Hugging Face checkpoint folder (config.json + *.safetensors) without importing transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtbuild.builder.convert.safetensors_io import SafetensorsError, SafetensorsFile
from trtbuild.configs.hf_quantization import prequantized_weights
from trtbuild.errors import CheckpointError


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a source model (HF name, HF shape), read from disk only when `load()` is called. `nbits` is
    (bits, group size, has zero point) when load() returns a quantized NBitsWeight (a GGUF tensor kept as it is)."""

    shape: tuple[int, ...]
    load: Callable[[], Any]
    nbits: tuple[int, int, bool] | None = None


def open_hf(model_dir: Path) -> tuple[dict[str, Any], dict[str, SourceTensor]]:
    """(hf_config_dict, HF name -> SourceTensor) of a safetensors checkpoint folder; no tensor is read yet. An FP8
    checkpoint's weights load dequantized (builder/convert/fp8_weights.py)."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; point --model at a Hugging Face model folder.")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}).") from None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (PyTorch .bin checkpoints are not read: save it with safe_serialization=True)"
        raise CheckpointError(f"{model_dir} has no *.safetensors weights{hint}.")
    sources: dict[str, SourceTensor] = {}
    for f in files:
        try:
            st = SafetensorsFile(f)
        except (SafetensorsError, OSError) as e:
            raise CheckpointError(f"{f} is corrupt or truncated ({e}); download it again.") from None
        for name in st:
            sources[name] = SourceTensor(st.shape(name), lambda st=st, name=name: _read(st, name))
    if (fp8 := prequantized_weights(hf_config)) is not None:
        from trtbuild.builder.convert.fp8_weights import dequantized_sources

        sources = dequantized_sources(sources, fp8)
    if "embed_tokens.weight" in sources:  # NOTE: a base model (Qwen3Model, ...), as embedding models are saved
        sources = {n if n.startswith("lm_head.") else "model." + n: s for n, s in sources.items()}
    return hf_config, sources


def _read(st: SafetensorsFile, name: str) -> torch.Tensor:
    try:
        return st[name]
    except (SafetensorsError, OSError) as e:
        raise CheckpointError(f"{st.path} is corrupt or truncated ({e}); download it again.") from None


def read_hf(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (hf_config_dict, hf_state_dict) of a safetensors checkpoint folder, every tensor read."""
    hf_config, sources = open_hf(model_dir)
    return hf_config, {name: s.load() for name, s in sources.items()}
