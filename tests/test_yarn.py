"""YaRN rotary scaling (rope_type "yarn": Qwen2.5 / Qwen3 long context, gpt-oss, DeepSeek) against transformers: the
blended inverse frequencies, the attention scaling and the cos / sin tables, bit for bit in fp32; and the configs
the engine cannot run, refused with the reason. End-to-end parity is in test_hf_parity.py (qwen2_yarn), GGUF
metadata in test_gguf_reader.py and test_gguf_convert.py."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gguf_reader import _write_llama

from trtbuild.builder.convert.gguf_reader import read_gguf
from trtbuild.builder.rope import attention_factor, inverse_frequencies, rope_tables
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import CheckpointError

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 256,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 131072, "rope_theta": 1000000.0}
QWEN_LONG = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
# name -> (config fields, rope_scaling)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen_long_context": ({}, QWEN_LONG),
    "gpt_oss": ({"head_dim": 64, "rope_theta": 150000.0},
                {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                 "beta_slow": 1.0, "truncate": False}),
    "deepseek_mscale": ({"max_position_embeddings": 163840, "rope_theta": 10000.0},
                        {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}),
    "explicit_attention_factor": ({"max_position_embeddings": 8192},
                                  {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25, "beta_fast": 16}),
    # DeepSeek-V3's form: the factor from the context lengths
    "factor_null": ({"max_position_embeddings": 8192},
                    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048}),
    # transformers lets a top-level original_max_position_embeddings win over the rope dict's
    "top_level_original_context": ({"max_position_embeddings": 8192, "original_max_position_embeddings": 1024},
                                   {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048}),
    "factor_below_one": ({}, {"rope_type": "yarn", "factor": 0.5, "beta_slow": 2.0, "truncate": True}),
}


def configs(case: str) -> tuple[Any, Any]:
    """(trtbuild's ModelConfig, transformers' Qwen2Config) of a CASES entry."""
    from transformers import Qwen2Config

    fields, scaling = CASES[case]
    hf = {**QWEN2, **fields, "rope_scaling": scaling}
    ours = model_config_from_hf(copy.deepcopy(hf))
    theirs = Qwen2Config(**{k: v for k, v in copy.deepcopy(hf).items() if k not in ("architectures", "model_type")})
    return ours, theirs


@pytest.mark.parametrize("case", list(CASES))
def test_inverse_frequencies_and_attention_factor_equal_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ours, theirs = configs(case)
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    assert torch.equal(inverse_frequencies(ours, 4096), want)
    assert attention_factor(ours) == scale
    assert not torch.equal(want, inverse_frequencies(dataclasses.replace(ours, rotary_scaling=None), 4096))


@pytest.mark.parametrize("case", ["qwen_long_context", "gpt_oss", "deepseek_mscale"])
def test_cos_and_sin_tables_equal_transformers_rotary_embedding(case):
    """cos and sin of every position, attention scaling included, as transformers' rotary module gives them."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    ours, theirs = configs(case)
    positions = 4096
    x = torch.zeros(1, positions, ours.head_size)
    want_cos, want_sin = Qwen2RotaryEmbedding(theirs)(x, torch.arange(positions)[None])
    cos, sin = (torch.from_numpy(t) for t in rope_tables(ours, positions))
    half = ours.head_size // 2
    assert torch.equal(cos, want_cos[0, :, :half]) and torch.equal(sin, want_sin[0, :, :half])


@pytest.mark.parametrize("case", ["gpt_oss", "deepseek_mscale", "top_level_original_context"])
def test_the_quantizers_hf_config_runs_the_same_yarn(case):
    """quantize/source.py rebuilds an HF config from the checkpoint's for its torch model: transformers computes the
    checkpoint's YaRN from it, and it maps back to the same checkpoint config."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trtbuild.quantize.source import hf_config_from_model_config

    ours = configs(case)[0]
    rebuilt = hf_config_from_model_config(ours)
    theirs = AutoConfig.for_model(rebuilt["model_type"], **{k: v for k, v in copy.deepcopy(rebuilt).items()
                                                            if k not in ("model_type", "torch_dtype")})
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    assert torch.equal(inverse_frequencies(ours, 4096), want) and attention_factor(ours) == scale
    assert model_config_from_hf(rebuilt) == ours


def test_the_checkpoint_keeps_the_resolved_parameters():
    """factor and the original context resolved as transformers resolves them, the rest as given, floats."""
    assert model_config_from_hf({**QWEN2, "rope_scaling": QWEN_LONG}).rotary_scaling == QWEN_LONG
    assert configs("factor_null")[0].rotary_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 2048}
    assert configs("deepseek_mscale")[0].rotary_scaling == {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    no_original = model_config_from_hf({**QWEN2, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                                      "rope_theta": 1000000.0}})
    assert no_original.rotary_scaling["original_max_position_embeddings"] == 131072


def test_a_phi3_config_reads_yarn_as_longrope_as_transformers_does():
    phi3 = {**QWEN2, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "original_max_position_embeddings": 4,
            "rope_scaling": {"type": "yarn", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64}}
    assert model_config_from_hf(phi3).rotary_scaling["rope_type"] == "longrope"


@pytest.mark.parametrize(("scaling", "message"), [
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, r"rope scaling yarn gives no factor"),
    ({"rope_type": "yarn", "factor": 0}, r"rope scaling yarn factor must be above 0, got 0\."),
    ({"rope_type": "yarn", "factor": -4.0}, r"factor must be above 0, got -4\.0"),
    ({"rope_type": "yarn", "factor": "4"}, r"rope scaling yarn factor must be a number, got '4'"),
    ({"rope_type": "yarn", "factor": True}, r"factor must be a number, got True"),
    ({"rope_type": "yarn", "factor": float("inf")}, r"factor must be a number, got inf"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0},
     r"original_max_position_embeddings must be a positive whole number of positions, got 0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024.5},
     r"original_max_position_embeddings must be a positive whole number of positions, got 1024\.5"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}, r"beta_fast must be at least 0, got -32"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_slow": [1]}, r"beta_slow must be a number, got \[1\]"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, r"attention_factor must be above 0, got 0\.0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": "1"}, r"mscale must be a number"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "false"}, r"truncate must be true or false, got 'false'"),
])
def test_a_bad_yarn_config_is_refused_with_the_reason(scaling, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf({**QWEN2, "rope_scaling": scaling})


# GGUF YaRN metadata (after "llama.rope.scaling.") -> the HF rope_scaling llama.cpp's converter wrote it from
YARN_FILES = {
    "qwen_long_context": ({"factor": 4.0, "original_context_length": 32},
                          {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "gpt_oss_style": ({"factor": 32.0, "original_context_length": 4, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0},
                      {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4,
                       "beta_fast": 32.0, "beta_slow": 1.0}),
    "attention_factor": ({"factor": 2.0, "yarn_attn_factor": 1.2},
                         {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                          "attention_factor": 1.2}),
    # llama-context.cpp's reading: mscale_all_dim, with mscale 1
    "log_multiplier": ({"factor": 8.0, "yarn_log_multiplier": 0.5, "yarn_ext_factor": 1.0},
                       {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                        "mscale_all_dim": 0.5}),
}


@pytest.mark.parametrize("case", list(YARN_FILES))
def test_yarn_metadata_gives_the_hf_rope_scaling(tmp_path: Path, case: str) -> None:
    meta, want = YARN_FILES[case]
    _write_llama(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": "yarn",
                                            **{f"llama.rope.scaling.{k}": v for k, v in meta.items()}})
    cfg = read_gguf(tmp_path / "m.gguf")[0]
    assert cfg["rope_scaling"] == want
    assert model_config_from_hf(cfg).rotary_scaling == want


def test_a_gpt_oss_file_runs_yarn_unrounded_as_its_hf_config_says() -> None:
    """GptOssConfig's truncate: false, which the GGUF does not record (llama.cpp rounds the ramp's bounds)."""
    from trtbuild.builder.convert.gguf_rope import rope_scaling as _rope_scaling

    meta = {f"gpt-oss.rope.scaling.{k}": v for k, v in (("type", "yarn"), ("factor", 32.0),
                                                         ("original_context_length", 4096), ("yarn_beta_fast", 32.0),
                                                         ("yarn_beta_slow", 1.0))}
    assert _rope_scaling(meta, "gpt-oss", {}, {"max_position_embeddings": 131072}) == {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False}


def test_the_generic_attn_factor_multiplies_the_yarn_scaling_as_llama_cpp_does(tmp_path: Path) -> None:
    _write_llama(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                            "llama.rope.scaling.attn_factor": 0.5})
    scaling = read_gguf(tmp_path / "m.gguf")[0]["rope_scaling"]
    assert scaling["attention_factor"] == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1), rel=1e-12)


@pytest.mark.parametrize(("meta", "message"), [
    ({}, r"RoPE scaling is yarn but it gives no llama\.rope\.scaling\.factor; the file is incomplete"),
    ({"llama.rope.scaling.factor": 4.0, "llama.rope.scaling.yarn_ext_factor": 0.5},
     r"blends YaRN's frequencies by llama\.rope\.scaling\.yarn_ext_factor 0\.5; trtbuild runs YaRN as "
     r"transformers does, fully blended \(1\)"),
])
def test_a_yarn_file_trtbuild_cannot_run_is_refused(tmp_path: Path, meta: dict, message: str) -> None:
    _write_llama(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": "yarn", **meta})
    with pytest.raises(CheckpointError, match=message):
        read_gguf(tmp_path / "m.gguf")
