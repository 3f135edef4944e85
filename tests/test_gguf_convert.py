"""The GGUF of stories260K converts to the same checkpoint as its safetensors, and builds an engine that agrees."""

from __future__ import annotations

import json

import torch
from helpers import STORIES260K, require_shared_models
from safetensors.torch import load_file

from trtbuild.builder.convert.convert import convert
from trtbuild.runtime.tokenizer import Tokenizer


def test_gguf_and_safetensors_give_the_same_checkpoint(tmp_path):
    require_shared_models()
    convert(STORIES260K, tmp_path / "from_hf")
    convert(STORIES260K / "stories260K-f32.gguf", tmp_path / "from_gguf")
    hf, gg = (load_file(str(tmp_path / d / "rank0.safetensors")) for d in ("from_hf", "from_gguf"))
    assert hf.keys() == gg.keys()
    for name in hf:
        assert torch.equal(hf[name], gg[name]), name
    cfg_hf, cfg_gg = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("from_hf", "from_gguf"))
    assert cfg_hf == cfg_gg
    text = "Once upon a time, a little dog"
    assert Tokenizer(tmp_path / "from_gguf").encode(text) == Tokenizer(tmp_path / "from_hf").encode(text)
