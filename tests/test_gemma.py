"""Gemma's differences from Llama as the converter reads them: the configs released on the Hub (their older keys
and transformers' current ones), the norm multipliers, the embedding multiplier rounded as transformers rounds it,
the GGUF files' defaults (llama.cpp's), and what is refused. End-to-end parity with transformers is in
test_hf_parity.py (gemma, gemma2, gemma3), GGUF round trips in test_gguf_convert.py."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from helpers import make_random_hf_model, prefill_logits, require_shared_models, save_with_nontrivial_norms

from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.builder.convert.safetensors_io import SafetensorsFile
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.configs.model_config import ModelConfig
from trtbuild.errors import CheckpointError

# google/gemma-3-1b-it's config.json as released (transformers 4.50 keys)
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}
# google/gemma-2-2b-it's (hidden_act and hidden_activation both given, as released)
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
             "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
             "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
             "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
             "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
             "torch_dtype": "float32", "vocab_size": 256000}


def _transformers_view(cls_name: str, released: dict) -> dict:
    """The config dict transformers itself makes of a released config.json (its current keys)."""
    import transformers

    return getattr(transformers, cls_name)(**copy.deepcopy(released)).to_dict()


@pytest.mark.parametrize(("cls_name", "released"), [("Gemma3TextConfig", GEMMA3_1B), ("Gemma2Config", GEMMA2_2B)])
def test_released_configs_read_as_transformers_reads_them(cls_name, released):
    ours, theirs = model_config_from_hf(released), model_config_from_hf(_transformers_view(cls_name, released))
    assert ours == theirs


def test_gemma3_1b_layers_windows_and_rope_bases():
    c = model_config_from_hf(GEMMA3_1B)
    full = [i for i in range(c.num_hidden_layers) if not c.is_sliding(i)]
    assert full == [5, 11, 17, 23] and c.sliding_window == 512
    assert (c.rotary_base, c.local_rotary_base, c.rotary_scaling) == (1e6, 10000.0, None)
    assert c.attention_scale == 256**-0.5 and c.output_norms and c.qk_norm and c.tie_word_embeddings
    assert c.hidden_act == "gelu_pytorch_tanh" and c.eos_token_ids == (1, 106)


def test_gemma3_4b_scales_only_its_full_layers_rope():
    c = model_config_from_hf({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert c.rotary_scaling == {"rope_type": "linear", "factor": 8.0} and c.local_rotary_base == 10000.0


def test_the_embedding_multiplier_is_rounded_to_the_weights_dtype_as_transformers_does():
    """sqrt(1152) = 33.94 is 34.0 in bfloat16, what a bfloat16 Gemma 3 1B multiplies by in transformers."""
    assert model_config_from_hf(GEMMA3_1B).embedding_multiplier == 34.0
    f32 = model_config_from_hf({**GEMMA3_1B, "torch_dtype": "float32"}).embedding_multiplier
    assert f32 == float(torch.tensor(1152**0.5, dtype=torch.float32)) != 34.0


def test_gemma1_legacy_gelu_means_the_tanh_approximation():
    gemma = {**GEMMA2_2B, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu", "hidden_activation": None}
    c = model_config_from_hf(gemma)
    assert c.hidden_act == "gelu_pytorch_tanh" and not c.output_norms and c.attention_scale is None
    assert c.attn_logit_softcapping is None and c.sliding_window is None
    assert c.layer_types == ("full_attention",) * 26


@pytest.mark.parametrize(("edit", "message"), [
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
    ({"use_bidirectional_attention": True}, "attends bidirectionally"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding-attention RoPE of type 'linear' is not supported"),
])
def test_what_the_engine_cannot_run_is_refused(edit, message):
    with pytest.raises(CheckpointError, match=message):
        model_config_from_hf({**GEMMA3_1B, **edit})


def test_checkpoint_norms_are_the_multipliers_in_float32(tmp_path):
    """1 + w, in float32 even in a bfloat16 checkpoint (where 1 + w would lose w's low bits)."""
    hf = make_random_hf_model("gemma3", tmp_path / "hf")
    config = convert(hf, tmp_path / "ckpt", dtype="bfloat16")
    source, ckpt = SafetensorsFile(hf / "model.safetensors"), SafetensorsFile(tmp_path / "ckpt" / "rank0.safetensors")
    pairs = {"model.layers.1.post_attention_layernorm.weight": "transformer.layers.1.attention.output_norm.weight",
             "model.layers.1.pre_feedforward_layernorm.weight": "transformer.layers.1.post_layernorm.weight",
             "model.layers.1.post_feedforward_layernorm.weight": "transformer.layers.1.mlp.output_norm.weight",
             "model.layers.0.self_attn.q_norm.weight": "transformer.layers.0.attention.q_norm.weight",
             "model.norm.weight": "transformer.ln_f.weight"}
    for hf_name, name in pairs.items():
        got = ckpt[name]
        assert got.dtype == torch.float32 and torch.equal(got, source[hf_name].float() + 1), name
    assert ckpt.dtype("transformer.layers.0.attention.q.weight") == torch.bfloat16
    assert ModelConfig.load(tmp_path / "ckpt" / "config.json") == config


@pytest.fixture(scope="module")
def quantized_gemma(tmp_path_factory):
    """factory(family, qformat, kv, source="hf"|"checkpoint") -> (QuantizeResult, checkpoint, HF folder), cached:
    a tiny random Gemma quantized from its HF folder or its trtbuild checkpoint."""
    from quant_helpers import quantize_random

    cache: dict = {}

    def get(family: str, qformat: str, kv: str | None, source: str = "hf"):
        key = (family, qformat, kv, source)
        if key not in cache:
            cache[key] = quantize_random(family, tmp_path_factory.mktemp(f"q_{family}"), qformat, kv,
                                         from_checkpoint=source == "checkpoint", awq_block_size=32)
        return cache[key]

    return get


IDS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(("family", "qformat", "kv"), [("gemma3", "int4_awq", "int8"), ("gemma2", "fp8", None),
                                                       ("gemma2", "int4_awq", "int8"), ("gemma", "int8_sq", "fp8")])
def test_quantized_gemma_checkpoint_computes_modelopts_simulation(quantized_gemma, family, qformat, kv, tmp_path):
    """Calibrated on transformers' Gemma (its 1 + w norms, GeGLU, sandwich norms, windows, soft-caps); the checkpoint
    holds the norm multipliers and, rebuilt from it alone, computes modelopt's simulated model (Gemma 2's quantized
    KV cache through the reference's eager, soft-capping attention)."""
    from quant_helpers import assert_computes_simulation

    result, ckpt, hf = quantized_gemma(family, qformat, kv)
    config = ModelConfig.load(ckpt / "config.json")
    assert config.family == family and config.quantization.quant_algo == qformat
    convert(hf, tmp_path / "plain")
    plain = SafetensorsFile(tmp_path / "plain" / "rank0.safetensors")
    got = SafetensorsFile(ckpt / "rank0.safetensors")
    for name in ("transformer.ln_f.weight", "transformer.layers.1.post_layernorm.weight"):
        assert torch.equal(got[name], plain[name]) and got[name].dtype == torch.float32, name
    assert_computes_simulation(result, ckpt, hf)


def test_gemma_quantized_from_its_checkpoint_equals_from_its_hf_folder(quantized_gemma):
    """The checkpoint's norm multipliers go back to transformers' w (1 + w in float32 is the multiplier again)."""
    a = SafetensorsFile(quantized_gemma("gemma3", "int4_awq", "int8")[1] / "rank0.safetensors")
    b = SafetensorsFile(quantized_gemma("gemma3", "int4_awq", "int8", source="checkpoint")[1] / "rank0.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_gemma_gguf_quantizes_like_its_hf_folder(tmp_path):
    """A GGUF's norms hold the multipliers already: read back as transformers' w for calibration, written as the
    same multipliers: the checkpoint is the HF folder's, bit for bit (the calibration model computes the same)."""
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp

    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    require_shared_models()
    hf = make_hf_folder("gemma3", tmp_path / "hf", {"query_pre_attn_scalar": 16})
    gguf = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "gemma3")
    for name, model in (("from_hf", hf), ("from_gguf", gguf)):
        quantize(QuantizeOptions(model, tmp_path / name, "fp8", calib_size=8, calib_max_seq_len=64))
    a, b = (SafetensorsFile(tmp_path / n / "rank0.safetensors") for n in ("from_hf", "from_gguf"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_weight_only_gemma_engine_matches_the_checkpoints_reference(quantized_gemma, tmp_path):
    """int4_awq without a quantized KV cache rounds nothing at run time: the engine computes the format's math."""
    import numpy as np

    from trtbuild.builder.build import build_engine
    from trtbuild.quantize.reference import reference_model

    result, ckpt, _ = quantized_gemma("gemma3", "int4_awq", None)
    engine = build_engine(ckpt, tmp_path / "engine", max_seq_len=64, tokens_per_block=8, int4_accuracy_level=1,
                          kv_pool_dtype="float32")
    ids = IDS[0].tolist()
    with torch.no_grad():
        want = reference_model(ckpt)(IDS[:1]).logits[0].numpy()
    got = prefill_logits(engine, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_gemma2_engine_verifying_drafts_gives_plain_greedy_tokens(random_hf_model, engine_from_hf):
    """Draft-tokens mode: the engine's SpeculativeAccept verifies drafts on the soft-capped logits (the cap comes
    before it), and greedy decoding gives plain decoding's tokens."""
    from conftest import RUNTIME_ENGINE_OPTIONS
    from helpers import drive

    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams
    from trtbuild.runtime.speculative import SpeculativeConfig

    hf = random_hf_model("gemma2")
    plain = engine_from_hf(hf, **RUNTIME_ENGINE_OPTIONS)
    accept = engine_from_hf(hf, **RUNTIME_ENGINE_OPTIONS, speculative_decoding_mode="draft-tokens", max_draft_len=4)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11, 12, 9, 10, 11], [40, 41]]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = drive(EngineCore(plain, RuntimeConfig(num_threads=1)), prompts, params)[0]
    got, finals, _ = drive(EngineCore(accept, RuntimeConfig(num_threads=1, speculative=SpeculativeConfig(4))),
                           prompts, params)
    assert got == want
    assert sum(f.metrics.num_accepted_draft_tokens for f in finals) > 0


def test_gemma3_vision_language_folder_converts_its_text_decoder(tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: its text decoder (`language_model.model.*`, a sparse
    text_config completed with transformers' defaults) builds; the engine's logits are the HF model's on text."""
    import numpy as np
    import transformers

    from trtbuild.builder.build import build_engine

    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=6,
                rope_scaling={"rope_type": "linear", "factor": 2.0})  # released: only what differs from defaults
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        architectures=["Gemma3ForConditionalGeneration"])).eval()
    save_with_nontrivial_norms(model, tmp_path / "hf")
    config = convert(tmp_path / "hf", tmp_path / "ckpt")
    assert (config.architecture, config.local_rotary_base, config.rotary_scaling["factor"]) == \
        ("Gemma3ForCausalLM", 1e4, 2.0)
    assert [i for i in range(6) if not config.is_sliding(i)] == [5]
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, tokens_per_block=8)
    ids = np.random.default_rng(0).integers(3, 256, size=20).tolist()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = prefill_logits(engine, ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# ---- GGUF metadata as llama.cpp reads it ----------------------------------------------------------------------
def _gguf_meta(arch: str, layers: int, **extra) -> dict:
    return {f"{arch}.{k}": v for k, v in {"embedding_length": 1152, "attention.head_count": 4, "block_count": layers,
                                          "attention.head_count_kv": 1, "feed_forward_length": 6912,
                                          "attention.key_length": 256, "rope.freq_base": 1e6, **extra}.items()}


def _gguf_config(arch: str, layers: int, **extra) -> ModelConfig:
    shapes = {"token_embd.weight": (262144, 1152)}
    return model_config_from_hf(hf_config(_gguf_meta(arch, layers, **extra), arch, GGUF_ARCHITECTURES[arch], shapes,
                                          {}))


def test_gemma3_gguf_defaults_are_llama_cpps():
    """No sliding_window_pattern: every sixth layer full; no freq_base_swa: 10000; sqrt(hidden) in float32."""
    c = _gguf_config("gemma3", 26, **{"attention.sliding_window": 512})
    assert [i for i in range(26) if not c.is_sliding(i)] == [5, 11, 17, 23]
    assert c.local_rotary_base == 10000.0 and c.attention_scale == 256**-0.5
    assert c.embedding_multiplier == pytest.approx(1152**0.5, rel=1e-7) and c.final_logit_softcapping is None
    explicit = _gguf_config("gemma3", 4, **{"attention.sliding_window": 512, "rope.freq_base_swa": 500.0,
                                             "attention.sliding_window_pattern": [True, False, False, True]})
    assert [explicit.is_sliding(i) for i in range(4)] == [True, False, False, True]
    assert explicit.local_rotary_base == 500.0


def test_gemma_27b_ggufs_scale_attention_by_hidden_over_heads():
    """llama.cpp's rule for the 27B sizes (62 Gemma 3 layers, 46 Gemma 2 ones): 1 / sqrt(hidden / heads)."""
    assert _gguf_config("gemma3", 62).attention_scale == (1152 // 4) ** -0.5
    gemma2 = _gguf_config("gemma2", 46)
    assert gemma2.attention_scale == (1152 // 4) ** -0.5
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.sliding_window) == (50.0, 30.0, 4096)
    assert [gemma2.is_sliding(i) for i in range(4)] == [True, False, True, False]


def test_config_json_lists_every_layers_attention_and_older_ones_still_load(tmp_path):
    """layer_types is always written in full (transformers checks a config.json's list against its layers, and
    AutoTokenizer reads a checkpoint's); a config.json from before it gets every layer alike."""
    from gguf_helpers import make_hf_folder

    require_shared_models()
    convert(make_hf_folder("mistral", tmp_path / "hf", {"sliding_window": 6}), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    doc = json.loads(path.read_text())
    assert doc["layer_types"] == ["sliding_attention"] * 2
    del doc["layer_types"]
    assert ModelConfig.from_dict(doc) == ModelConfig.load(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tmp_path / "ckpt")  # reads the checkpoint's config.json too


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
