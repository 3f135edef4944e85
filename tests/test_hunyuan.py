"""Hunyuan dense (0.5B / 1.8B / 4B / 7B): per-head q / k RMSNorms applied after RoPE (`qk_norm_after_rope`) and
NTK-alpha RoPE (a "dynamic" rope_scaling with a fixed alpha: base theta * alpha ** (d / (d - 2))); from its config,
from llama.cpp's `hunyuan-dense` GGUF keys (the converter folds alpha into rope.freq_base), and quantized. End-to-end
parity with transformers is in test_hf_parity.py (hunyuan_dense), the GGUF round trip in test_gguf_convert.py."""

from __future__ import annotations

import numpy as np
import pytest
from quant_helpers import assert_computes_simulation, quantize_random

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import ConfigError

# the form of tencent/Hunyuan-*-Instruct's config.json: "dynamic" RoPE with alpha 1000, tied embeddings
HUNYUAN = {"architectures": ["HunYuanDenseV1ForCausalLM"], "model_type": "hunyuan_v1_dense", "hidden_size": 2048,
           "intermediate_size": 6144, "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 32,
           "head_dim": 128, "vocab_size": 120818, "max_position_embeddings": 32768, "rms_norm_eps": 1e-05,
           "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0},
           "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}


def test_ntk_alpha_is_a_larger_base_and_the_norms_follow_rope():
    c = model_config_from_hf(HUNYUAN)
    assert c.rotary_base == float(np.float32(10000.0 * 1000.0 ** (128 / 126))) and c.rotary_scaling is None
    assert (c.family, c.qk_norm, c.qk_norm_after_rope, c.qk_norm_full) == ("hunyuan_dense", True, True, False)


def test_gguf_keys_give_the_same_model():
    """llama.cpp's HunYuanModel writes the alpha-scaled base as rope.freq_base, with scaling type none."""
    meta = {f"hunyuan-dense.{k}": v for k, v in {
        "embedding_length": 2048, "attention.head_count": 16, "attention.head_count_kv": 4, "block_count": 32,
        "feed_forward_length": 6144, "rope.freq_base": float(np.float32(10000.0 * 1000.0 ** (128 / 126))),
        "context_length": 262144, "attention.key_length": 128, "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.scaling.type": "none", "rope.scaling.factor": 1.0}.items()}
    arch = GGUF_ARCHITECTURES["hunyuan-dense"]
    c = model_config_from_hf(hf_config(meta, "hunyuan-dense", arch, {"token_embd.weight": (120818, 2048)}, {}))
    want = model_config_from_hf(HUNYUAN)
    for field in ("rotary_base", "rotary_scaling", "qk_norm", "qk_norm_after_rope", "head_size",
                  "tie_word_embeddings"):
        assert getattr(c, field) == getattr(want, field), field


def test_gpu_targets_refuse_it_before_any_work(random_hf_model, tmp_path):
    convert(random_hf_model("hunyuan_dense"), tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="q / k norms after RoPE"):
        build_engine(tmp_path / "ckpt", tmp_path / "engine", target="cuda")
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("qformat", ["int4_awq", "int8_sq"])
def test_quantized_hunyuan_computes_modelopts_simulation(tmp_path, qformat):
    assert_computes_simulation(*quantize_random("hunyuan_dense", tmp_path, qformat, None))
