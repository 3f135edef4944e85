"""`trtbuild quantize` variants: per-token activations, int8 weight-only lm_head, other families, AWQ block size."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import STORIES260K, make_random_hf_model
from quant_helpers import compare_logits

from trtbuild.builder.convert.checkpoint import expected_tensors, load_checkpoint
from trtbuild.builder.convert.convert import convert


@pytest.mark.parametrize("model", ["tiny", "stories260K"])
def test_per_token_activations(model, runs, tiny):
    """int8_sq --per-token-activations: modelopt's dynamic per-token int8 input quantizers, no activation scale in
    the checkpoint, alpha 0.5 by default, and the checkpoint's reference model computes modelopt's simulation
    (tolerances of test_reference_logits_match_modelopt_simulation)."""
    path = tiny if model == "tiny" else STORIES260K
    result, ckpt = runs("int8_sq", "int8", model=path, per_token_activations=True)
    config, tensors = load_checkpoint(ckpt)
    q = config.quantization
    assert (q.per_token_activations, q.smoothquant_alpha, q.shared_input_scales) == (True, 0.5, False)
    assert not any(n.endswith("activation_scaling_factor") for n in tensors)
    assert set(tensors) == set(expected_tensors(config, range(config.num_hidden_layers), True, True))
    quantizer = result.model.get_submodule("model.layers.0.mlp.down_proj").input_quantizer
    assert quantizer.block_sizes == {-1: None} and quantizer.pre_quant_scale is not None and quantizer.amax is None
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    weights, full_max, full_mean = compare_logits(result, ckpt, path, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)
    static = runs("int8_sq", "int8", model=path, smoothquant_alpha=0.5)[0]
    with torch.no_grad():  # the same smoothing; per-token rounding is closer to fp32 than the static scale
        from trtbuild.quantize.source import build_torch_model, read_source

        fp32 = build_torch_model(read_source(path))(ids).logits
        err = [(m(ids).logits - fp32).abs().mean().item() for m in (result.model, static.model)]
    assert err[0] < err[1], err


@pytest.mark.parametrize("qformat", ["int4_awq", "int8_sq"])
def test_lm_head_int8_weight_only(qformat, runs, tiny, unquantized):
    """`--lm-head-qformat int8_wo`: lm_head (excluded from qformat) holds int8 weights with max |row| / 127 scales,
    modelopt's simulated model computes the same weight, and the checkpoint's reference model matches it."""
    result, ckpt = runs(qformat, "int8", lm_head_qformat="int8_wo")
    config, tensors = load_checkpoint(ckpt)
    q = config.quantization
    assert (q.quant_algo, q.lm_head_quant_algo, q.algo_of("lm_head")) == (qformat, "int8_wo", "int8_wo")
    assert "lm_head" in result.excluded and sorted(n for n in tensors if n.startswith("lm_head.")) == [
        "lm_head.weight", "lm_head.weights_scaling_factor"]
    w, scale = tensors["lm_head.weight"], tensors["lm_head.weights_scaling_factor"]
    fp32 = unquantized["lm_head.weight"].float()
    assert w.dtype == torch.int8 and w.shape == fp32.shape and scale.shape == (fp32.shape[0],)
    assert torch.equal(scale, fp32.abs().amax(dim=1) / 127)
    assert w.abs().amax(dim=1).eq(127).all()  # every row uses the whole grid
    dequantized = w.float() * scale[:, None]
    assert ((dequantized - fp32).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest
    assert torch.equal(result.model.lm_head.weight.detach(), dequantized)
    assert torch.equal(tensors["transformer.vocab_embedding.weight"], unquantized["transformer.vocab_embedding.weight"])
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    weights, full_max, full_mean = compare_logits(result, ckpt, tiny, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_in_bfloat16(family, runs, tmp_path):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms) with a bfloat16 checkpoint: unquantized tensors equal
    `convert --dtype bfloat16`, and the checkpoint computes modelopt's simulation."""
    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"vocab_size": 512})
    shutil.copy(STORIES260K / "tokenizer.json", hf / "tokenizer.json")
    result, ckpt = runs("int8_sq", "int8", model=hf, dtype="bfloat16")
    convert(hf, tmp_path / "bf16", dtype="bfloat16")
    plain = load_checkpoint(tmp_path / "bf16")[1]
    config, tensors = load_checkpoint(ckpt)
    assert config.dtype == "bfloat16" and tensors["transformer.layers.0.attention.q.weight"].dtype == torch.int8
    for name in ("transformer.vocab_embedding.weight", "lm_head.weight", "transformer.layers.1.post_layernorm.weight",
                 "transformer.layers.0.attention.q.bias" if family == "qwen2" else
                 "transformer.layers.0.attention.k_norm.weight"):
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], plain[name]), name
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    weights, full_max, full_mean = compare_logits(result, ckpt, hf, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)


@pytest.mark.parametrize(("family", "qformat", "kv"), [
    ("phi3_longrope", "int4_awq", "int8"), ("phi3_partial", "int4_awq", "int8"), ("phi3_partial", "fp8", "fp8")])
def test_phi3_quantizes_through_its_mistral_form(family, qformat, kv, runs, tmp_path):
    """Phi-3 (fused q/k/v and gate/up, LongRoPE, a sliding window) and Phi-4-mini (partial rotary embeddings): the
    quantizer's torch model is the Mistral model of its split weights (Phi-4-mini's: q / k rows in the engine's
    order, on the engine's RoPE), which computes the HF model's logits; the checkpoint computes modelopt's
    simulation."""
    import transformers

    from trtbuild.quantize.source import build_torch_model, read_source

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"vocab_size": 512, "sliding_window": 12})
    shutil.copy(STORIES260K / "tokenizer.json", hf / "tokenizer.json")
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
        mistral = build_torch_model(read_source(hf))
        assert type(mistral).__name__ == "MistralForCausalLM"
        assert ((mistral(ids).logits - want).abs().max() / want.abs().max()).item() <= 1e-5
    # the int8 KV cache's reference attention keeps the window (it came 3.3x the quantization error off without it)
    result, ckpt = runs(qformat, kv, model=hf)
    config, tensors = load_checkpoint(ckpt)
    assert config.family == "phi3"
    assert (config.rotary_scaling or {}).get("rope_type") == ("longrope" if family == "phi3_longrope" else None)
    assert config.rotary_dim == (8 if family == "phi3_partial" else None)
    assert tensors["transformer.layers.0.attention.k.weight"].dtype == {"int4_awq": torch.uint8,  # int4 pairs
                                                                        "fp8": torch.float8_e4m3fn}[qformat]
    weights, full_max, full_mean = compare_logits(result, ckpt, hf, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)


def test_awq_block_size_defaults_to_the_largest_that_divides_every_linear(runs, caplog):
    """The tiny model's linears read 64 (hidden) and 96 (ffn) features: 128 and 64 do not divide 96, 32 does."""
    with caplog.at_level("WARNING"):
        result, ckpt = runs("int4_awq", awq_block_size=None)
    assert result.config.quantization.group_size == 32
    assert load_checkpoint(ckpt)[0].quantization.group_size == 32
    assert "int4_awq block size 32: the largest of 128/64/32 dividing the input features of every quantized linear " \
           "(64, 96)" in caplog.text
