"""A GGUF converts to the same checkpoint as the HF folder it was made from: stories260K's real GGUF, and tiny random
Llama / Mistral / Qwen2 / Qwen3 models written the way llama.cpp's converter writes them (tokenizer and chat template
included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_helpers import PROBE_TEXTS, make_hf_folder, write_gguf_like_llama_cpp
from helpers import STORIES260K, require_shared_models
from safetensors.torch import load_file

from trtbuild.builder.convert.convert import convert
from trtbuild.runtime.tokenizer import Tokenizer


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = (load_file(str(d / "rank0.safetensors")) for d in (a, b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_gguf_and_safetensors_give_the_same_checkpoint(tmp_path):
    require_shared_models()
    convert(STORIES260K, tmp_path / "from_hf")
    convert(STORIES260K / "stories260K-f32.gguf", tmp_path / "from_gguf")
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")
    text = "Once upon a time, a little dog"
    assert Tokenizer(tmp_path / "from_gguf").encode(text) == Tokenizer(tmp_path / "from_hf").encode(text)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, family, monkeypatch):
    from transformers import AutoTokenizer

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder(family, tmp_path / family)
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family), tmp_path / "from_gguf")
    assert config.family == family
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")

    ref, got = Tokenizer(tmp_path / "from_hf"), Tokenizer(tmp_path / "from_gguf")
    for text in PROBE_TEXTS:
        assert got.encode(text) == ref.encode(text), text
        assert got.decode(got.encode(text), skip_special_tokens=False) == ref.decode(ref.encode(text), False), text
    assert got.vocab_size == ref.vocab_size

    template = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((tmp_path / "from_gguf" / "tokenizer_config.json").read_text())["chat_template"] == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"}]
    ref_chat, got_chat = (AutoTokenizer.from_pretrained(tmp_path / d).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) for d in ("from_hf", "from_gguf"))
    assert got_chat == ref_chat and "héllo 世界" in got_chat
    assert got.encode(got_chat, add_special_tokens=False) == ref.encode(ref_chat, add_special_tokens=False)
