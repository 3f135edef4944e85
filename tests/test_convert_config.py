"""`trtbuild convert`'s config.json (schema, documented fields, round trip), copied tokenizer files, and dtypes."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from convert_helpers import hf_config, load_ranks
from helpers import REPO, STORIES260K, require_shared_models
from safetensors.torch import load_file, save_file

from trtbuild.builder.convert.checkpoint import TOKENIZER_FILES
from trtbuild.builder.convert.convert import convert
from trtbuild.configs import ModelConfig


# ---- config.json ------------------------------------------------------------------------------------------------
def documented_config_fields() -> set[str]:
    """Field names of the config.json table in docs/checkpoint.md."""
    section = (REPO / "docs" / "checkpoint.md").read_text().split("## config.json", 1)[1].split("\n## ", 1)[0]
    fields = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            fields.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return fields


REQUIRED_FIELDS = {"architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_size", "rotary_base", "rotary_scaling", "norm_epsilon",
                   "tie_word_embeddings", "mapping", "quantization"}
FAMILY_FIELDS = {
    "llama": dict(architecture="LlamaForCausalLM", family="llama", qkv_bias=False, qk_norm=False, head_size=16,
                  rotary_base=10000.0, rotary_scaling=None, tie_word_embeddings=False),
    "llama3_rope": dict(architecture="LlamaForCausalLM", family="llama", qkv_bias=False, qk_norm=False,
                        rotary_base=500000.0, tie_word_embeddings=True, rotary_scaling={
                            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}),
    "qwen2": dict(architecture="Qwen2ForCausalLM", family="qwen2", qkv_bias=True, qk_norm=False,
                  rotary_base=1000000.0),
    "qwen2_yarn": dict(architecture="Qwen2ForCausalLM", family="qwen2", rotary_base=1000000.0, rotary_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(architecture="Qwen3ForCausalLM", family="qwen3", qkv_bias=False, qk_norm=True, head_size=32),
    "mistral": dict(architecture="MistralForCausalLM", family="mistral", qkv_bias=False, qk_norm=False,
                    sliding_window=None),
}


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_config_json_schema_and_round_trip(family, converted):
    ckpt = converted(family)
    doc = json.loads((ckpt / "config.json").read_text())
    documented = documented_config_fields()
    assert documented >= REQUIRED_FIELDS
    assert set(doc) == documented
    common = dict(format_version=1, dtype="float32", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_size=16,
                  norm_epsilon=1e-6, max_position_embeddings=256, hidden_act="silu",
                  mapping={"world_size": 1, "tp_size": 1, "pp_size": 1},
                  quantization={"quant_algo": None, "kv_cache_quant_algo": None, "group_size": None,
                                "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": [],
                                "shared_input_scales": False, "smoothquant_alpha": None,
                                "per_token_activations": False, "lm_head_quant_algo": None,
                                "embedding_weight_only": False})
    for key, value in {**common, **FAMILY_FIELDS[family]}.items():
        assert doc[key] == value, key
    config = ModelConfig.load(ckpt / "config.json")
    assert config.to_dict() == doc
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert set(p.name for p in ckpt.iterdir()) == {"config.json", "rank0.safetensors", "generation_config.json"}


def test_stories260k_config_and_tokenizer_files_are_copied(tmp_path):
    require_shared_models()
    config = convert(STORIES260K, tmp_path / "ckpt")
    assert ModelConfig.load(tmp_path / "ckpt" / "config.json") == config
    assert (config.architecture, config.vocab_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_size, config.tie_word_embeddings) == \
        ("LlamaForCausalLM", 512, 5, 8, 4, 8, True)
    copied = {n for n in TOKENIZER_FILES if (STORIES260K / n).is_file()}
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"} <= copied
    for n in copied:
        assert (tmp_path / "ckpt" / n).read_bytes() == (STORIES260K / n).read_bytes(), n
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == copied | {"config.json", "rank0.safetensors"}


# ---- dtype ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_option_casts_every_tensor(dtype, converted):
    want = getattr(torch, dtype)
    ref = load_ranks(converted("qwen2"), 1)[0]
    ckpt = converted("qwen2", dtype=dtype)
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == dtype
    got = load_ranks(ckpt, 1)[0]
    assert got.keys() == ref.keys()
    for n, t in got.items():
        assert t.dtype == want and torch.equal(t, ref[n].to(want)), n
    sharded = load_ranks(converted("qwen2", 2, 2, dtype), 4)
    assert {t.dtype for shard in sharded for t in shard.values()} == {want}


def test_auto_dtype_keeps_a_bfloat16_model(hf_dir, tmp_path):
    src = tmp_path / "bf16"
    shutil.copytree(hf_dir("llama"), src)
    weights = load_file(str(src / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in weights.items()}, str(src / "model.safetensors"))
    hf = hf_config(src)
    hf["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(hf))
    assert convert(src, tmp_path / "ckpt").dtype == "bfloat16"
    assert {t.dtype for t in load_ranks(tmp_path / "ckpt", 1)[0].values()} == {torch.bfloat16}
