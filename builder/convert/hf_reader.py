"""Read a Hugging Face checkpoint folder (config.json + *.safetensors) without importing transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trtbuild.errors import CheckpointError


def read_hf(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (hf_config_dict, hf_state_dict) of a safetensors checkpoint folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f} is corrupt or truncated ({e}); download it again.") from None
    return hf_config, tensors
