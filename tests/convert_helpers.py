"""Helpers of the `trtbuild convert` tests: an HF model's config.json and a checkpoint's tensors per rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def load_ranks(ckpt: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    names = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert names == sorted(f"rank{r}.safetensors" for r in range(world_size))
    return [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(world_size)]
