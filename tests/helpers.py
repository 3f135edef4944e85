"""Test helpers: paths to the real tiny models, tiny random HF models per family, and an EngineCore driver
(importable as `helpers`)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtbuild import cpu_ops
from trtbuild.builder.engine_dir import cpu_features
from trtbuild.runtime.engine_core import EngineCore, RequestOutput, StepStats

REPO = Path(__file__).resolve().parents[1]

# What this CPU runs of trtbuild's native ops (cpu_ops/): their AVX-512 or AVX2 kernels, and BlockQuantMatMul's tiles
# (AVX-512 VNNI or AVX2). Without them the builder's auto tactics choose ONNX Runtime's ops, and an explicit `native` is
# refused. VNNI alone also decides how int8 GEMMs are lowered (builder/passes/lower_quant_cpu.py).
AVX512, VNNI, BLOCK_QUANT = cpu_ops.has_avx512(), cpu_ops.has_vnni(), cpu_ops.runs_block_quant()
DENSE = cpu_ops.runs_dense()  # DenseMatMul / DenseGather: AVX-512 or AVX2
# A float16 KV pool: the native attention widens its rows with F16C (every AVX-512 CPU has it)
F16C = "f16c" in cpu_features()
needs_f16c = pytest.mark.skipif(not F16C, reason="this CPU has no F16C, which the native attention widens a float16 "
                                                 "KV pool with (engines built here keep a float32 pool)")
needs_dense = pytest.mark.skipif(not DENSE, reason="this CPU has neither AVX-512 nor AVX2, which trtbuild::DenseMatMul "
                                                   "and LoraAdd are written with (engines built here use MatMul)")
needs_block_quant = pytest.mark.skipif(
    not BLOCK_QUANT, reason="this CPU has neither AVX-512 VNNI nor AVX2, which trtbuild::BlockQuantMatMul is written "
                            "with (engines built here use MatMulNBits instead)")


def shared_dir() -> Path:
    """shared/ beside the repository (the layout of both the work tree and CI's clone); TRTBUILD_SHARED overrides."""
    return Path(os.environ.get("TRTBUILD_SHARED", REPO.parent / "shared"))


MODELS = shared_dir() / "models"
STORIES260K = MODELS / "stories260K"
TINYSTORIES656K = MODELS / "tinystories-656K"

# Small but structurally complete configs (GQA, several layers) for each supported family.
_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
_SMOLLM3 = dict(_COMMON, rope_theta=5000000.0, num_hidden_layers=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_GRANITE4 = dict(_COMMON, shared_intermediate_size=48, layer_types=["attention"] * 2, embedding_multiplier=12.0,
                 attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
_MAMBA = dict(layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
              mamba_n_groups=2, mamba_expand=2, mamba_d_conv=4)
RANDOM_CONFIGS = {
    "llama": ("LlamaConfig", dict(_COMMON, rope_theta=10000.0)),
    "llama3_rope": ("LlamaConfig", dict(_COMMON, rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # q, k, v and o biases (attention_bias), and the MLP's (mlp_bias)
    "llama_bias": ("LlamaConfig", dict(_COMMON, rope_theta=10000.0, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(_COMMON, rope_theta=1000000.0)),
    # contexts past 512 keys, where a decode step's attention splits each token's keys into ranges over tasks
    "qwen2_long": ("Qwen2Config", dict(_COMMON, rope_theta=1000000.0, max_position_embeddings=1024)),
    # YaRN past an original context of 64 (Qwen2.5's long-context form, 4 times it): pairs 0 to 2 of each head run
    # on the ramp's blend of original and interpolated speeds, the others interpolated, cos / sin scaled by 1.14
    "qwen2_yarn": ("Qwen2Config", dict(_COMMON, rope_theta=1000000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", dict(_COMMON, sliding_window=None)),
    # sliding windows far shorter than the engines (256): the attention applies them
    "mistral_window": ("MistralConfig", dict(_COMMON, sliding_window=6)),
    # fused qkv_proj / gate_up_proj, and a sliding window
    "phi3": ("Phi3Config", dict(_COMMON, rope_theta=10000.0, sliding_window=24, bos_token_id=1, eos_token_id=2,
                                pad_token_id=0)),
    # LongRoPE past an original context of 4, so that every test sequence runs on the long factors in HF too (its
    # choice is per forward); the factors are multiples of 1/8, which a GGUF's float32 holds exactly
    "phi3_longrope": ("Phi3Config", dict(_COMMON, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                         original_max_position_embeddings=4, rope_scaling={
                                             "rope_type": "longrope", "short_factor": [1 + i / 8 for i in range(8)],
                                             "long_factor": [1 + i for i in range(8)]})),
    # NoPE: layer 3 of 4 applies no RoPE (SmolLM3's default every fourth layer, as llama.cpp fixes it); _spm: the
    # same model given a SentencePiece tokenizer (tests/gguf_helpers.py)
    "smollm3": ("SmolLM3Config", _SMOLLM3),
    "smollm3_spm": ("SmolLM3Config", _SMOLLM3),
    # Phi-4-mini's partial rotary embeddings: the first half of each head rotated
    "phi3_partial": ("Phi3Config", dict(_COMMON, rope_theta=10000.0, partial_rotary_factor=0.5, bos_token_id=1,
                                        eos_token_id=2, pad_token_id=0)),
    # GeGLU, (1 + w) norms, sqrt(hidden)-scaled embeddings, tied
    "gemma": ("GemmaConfig", dict(_COMMON, head_dim=16, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)),
    # + sandwich norms, windowed (6) layers 0 and 2, query_pre_attn_scalar 24 (not head_dim), soft-capped
    # attention scores and logits (caps small enough that random weights reach them)
    "gemma2": ("Gemma2Config", dict(_COMMON, head_dim=16, num_hidden_layers=3, tie_word_embeddings=True,
                                    sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=0.05,
                                    final_logit_softcapping=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # + q/k norms; layers 0, 1 and 3 sliding (window 6) with their own RoPE base, layer 2 full with linear scaling
    "gemma3": ("Gemma3TextConfig", dict(_COMMON, head_dim=16, num_hidden_layers=4, sliding_window=6,
                                        tie_word_embeddings=True, query_pre_attn_scalar=24, layer_types=[
                                            "sliding_attention", "sliding_attention", "full_attention",
                                            "sliding_attention"], rope_parameters={
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0},
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Llama with multipliers: embeddings x12, attention scores x0.05 (not 1/sqrt(16)), residual branches x0.22,
    # logits / 8
    "granite": ("GraniteConfig", dict(_COMMON, rope_theta=10000.0, embedding_multiplier=12.0,
                                      attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # no norms before attention and MLP, one after each; q / k norms over the whole projections
    "olmo2": ("Olmo2Config", dict(_COMMON, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # + layers 0-2 windowed (6), layer 3 full
    "olmo3": ("Olmo3Config", dict(_COMMON, num_hidden_layers=4, sliding_window=6, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)),
    # mixtures of experts: 8 experts of 32 features, 2 per token, renormalized (Qwen3-MoE, Mixtral) or not (OLMoE)
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, head_dim=32, rope_theta=1000000.0, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                      sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                  norm_topk_prob=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # + a shared expert of 48 features beside the routed ones, scaled by its sigmoid gate (Qwen2-MoE)
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, rope_theta=1000000.0, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False,
                                         shared_expert_intermediate_size=48)),
    # + Granite's multipliers, every expert's gate and up in one tensor
    "granitemoe": ("GraniteMoeConfig", dict(_COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                            embedding_multiplier=12.0, attention_multiplier=0.05,
                                            residual_multiplier=0.22, logits_scaling=8.0, bos_token_id=1,
                                            eos_token_id=2, pad_token_id=0)),
    # Granite 4.0 (GraniteMoeHybrid without Mamba2 layers): the shared MLP as the MLP, RoPE or none (NoPE), and
    # with experts beside an ungated shared one
    "granite4": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=0, position_embedding_type="rope")),
    "granite4_nope": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=0)),
    "granite4_moe": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=4, num_experts_per_tok=2,
                                                    intermediate_size=32, position_embedding_type="rope")),
    # Granite 4.0-H: Mamba2 layers (8 heads of 16 in 2 groups, state 16, kernel 4, a conv bias) around an attention
    # layer, NoPE; with experts beside the shared MLP
    "granite4_h": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=0, num_hidden_layers=4, **_MAMBA)),
    "granite4_h_moe": ("GraniteMoeHybridConfig", dict(_GRANITE4, num_local_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=32, num_hidden_layers=4, **_MAMBA)),
    # Nemotron-H: Mamba2 (8 heads of 16 in 2 groups), relu^2 MLPs, attention without RoPE; the second Mamba2 layer
    # has no MLP after it
    "nemotron_h": ("NemotronHConfig", dict(
        {k: v for k, v in _COMMON.items() if k not in ("num_hidden_layers", "rms_norm_eps")}, head_dim=16,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "linear_attention",
                           "mlp"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        conv_kernel=4, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Mamba2: Mamba2 layers only (8 heads of 16 in 2 groups), no MLP; tied embeddings
    "mamba2": ("Mamba2Config", dict(vocab_size=_COMMON["vocab_size"], hidden_size=64, num_hidden_layers=3, num_heads=8,
                                    head_dim=16, state_size=16, n_groups=2, expand=2, conv_kernel=4,
                                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict({k: v for k, v in _GRANITE4.items() if k != "layer_types"},
                                                        num_local_experts=4, num_experts_per_tok=2,
                                                        intermediate_size=32)),
    # gpt-oss: biases everywhere, attention sinks, layers 0 and 2 windowed (6), experts with biases and a clamped
    # SwiGLU whose limit (0.1) random activations reach
    "gpt_oss": ("GptOssConfig", dict(_COMMON, head_dim=16, num_hidden_layers=4, intermediate_size=32,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # interleaved RoPE (adjacent pairs), heads wider than hidden / heads, tied embeddings
    "ernie4_5": ("Ernie4_5Config", dict(_COMMON, head_dim=32, rope_theta=500000.0, tie_word_embeddings=True,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # interleaved RoPE over the first half of each head, q / k / v biases, gate and up fused, norms before and after
    # attention and MLP
    "glm4": ("Glm4Config", dict(_COMMON, head_dim=32, rope_theta=10000.0, partial_rotary_factor=0.5,
                                attention_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # GLM-4-9B's first release and GLM-Edge (GlmForCausalLM): GLM-4's without the norms after attention and MLP
    "glm": ("GlmConfig", dict(_COMMON, head_dim=32, rope_theta=10000.0, partial_rotary_factor=0.5,
                              attention_bias=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # norms after attention and MLP, per-head q / k norms; _window: layers 0-2 windowed (6) with RoPE, layer 3 full
    # without
    "exaone4": ("Exaone4Config", dict(_COMMON, rope_theta=1000000.0, sliding_window=None, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0, layer_types=["full_attention"] * 2)),
    "exaone4_window": ("Exaone4Config", dict(_COMMON, num_hidden_layers=4, rope_theta=1000000.0, sliding_window=6,
                                             sliding_window_pattern=4, bos_token_id=1, eos_token_id=2,
                                             pad_token_id=0)),
    # LayerNorms, attention and MLP in parallel off one norm, interleaved RoPE, logits x 0.25, q / k / v / o biases,
    # tied (llama.cpp's Cohere files have no output tensor)
    "cohere": ("CohereConfig", dict(_COMMON, rope_theta=10000.0, logit_scale=0.25, layer_norm_eps=1e-5,
                                    attention_bias=True, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)),
    # + layers 0-2 windowed (6) with RoPE, layer 3 full without
    "cohere2": ("Cohere2Config", dict(_COMMON, num_hidden_layers=4, rope_theta=50000.0, logit_scale=0.25,
                                      sliding_window=6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)),
    # Mistral with YaRN past an original context of 8 (4 times it) and the attention temperature stepping up every 8
    # positions (0.5 log(1 + floor(pos / 8)))
    "ministral3": ("Ministral3Config", dict(_COMMON, head_dim=16, sliding_window=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # LayerNorms with biases, biases on every projection, a GELU MLP without a gate, a sliding window of 6
    "starcoder2": ("Starcoder2Config", dict(_COMMON, hidden_act="gelu_pytorch_tanh", use_bias=True, norm_epsilon=1e-6,
                                            sliding_window=6, rope_theta=100000.0, tie_word_embeddings=True,
                                            bos_token_id=1, eos_token_id=2)),
    # per-head q / k norms after RoPE; NTK-alpha RoPE (base 10000 * 1000 ** (32 / 30))
    "hunyuan_dense": ("HunYuanDenseV1Config", dict(_COMMON, head_dim=32, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # short convolution layers (kernel 3) around an attention layer with per-head q / k norms; the MLP's features
    # two thirds of 96 rounded up to 32 (64); a token's convolution state fills one pool slot (2 x 2 x 16 values).
    # _wide: a state of two slots a token, the second half padding (one 24-wide KV head), a kernel of 4, and two
    # attention layers
    "lfm2": ("Lfm2Config", dict(_COMMON, rope_theta=1000000.0, norm_eps=1e-5, block_multiple_of=32,
                                layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4,
                                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "lfm2_wide": ("Lfm2Config", dict(_COMMON, rope_theta=1000000.0, norm_eps=1e-5, block_multiple_of=32,
                                     num_key_value_heads=1, head_dim=24, conv_L_cache=4, num_hidden_layers=5,
                                     layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
                                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # LFM2-MoE: layer 0 dense, the others 8 experts of 32 features, 2 a token, chosen by sigmoid + a selection bias,
    # weighted by their renormalized sigmoids x 1.5; _raw: not renormalized
    "lfm2_moe": ("Lfm2MoeConfig", dict(_COMMON, norm_eps=1e-5, moe_intermediate_size=32, num_dense_layers=1,
                                       num_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5,
                                       layer_types=["conv", "full_attention", "conv", "conv"], num_hidden_layers=4,
                                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "lfm2_moe_raw": ("Lfm2MoeConfig", dict(_COMMON, norm_eps=1e-5, moe_intermediate_size=32, num_dense_layers=1,
                                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                           layer_types=["conv", "full_attention", "conv", "conv"],
                                           num_hidden_layers=4, tie_word_embeddings=True, bos_token_id=1,
                                           eos_token_id=2, pad_token_id=0)),
    # Llama whose MLP has no gate (relu(up(x))^2), with YaRN past an original context of 64 as AFM-4.5B runs
    # Apertus: xIELU's learned scalars moved off their initial values (make_random_hf_model), llama3 RoPE (as
    # released: llama.cpp's GGUFs leave the original context out, 8192 by default)
    "apertus": ("ApertusConfig", dict(_COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0})),
    # AFMoE: a dense first layer, then 4 experts (2 a token, sigmoid + selection bias, scaled) and a shared one;
    # three sliding layers (window 6) with RoPE, then a full one without; muP embedding scale
    "afmoe": ("AfmoeConfig", dict(_COMMON, head_dim=16, num_hidden_layers=4, num_dense_layers=1, num_experts=4,
                                  num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
                                  route_scale=2.5, sliding_window=6, global_attn_every_n_layers=4, mup_enabled=True,
                                  rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Qwen3.5: three gated DeltaNet layers (2 key heads, 4 value heads of 16, conv kernel 4), then a full attention
    # layer with an output gate and RoPE over a quarter of each head
    "qwen3_5": ("Qwen3_5TextConfig", dict(_COMMON, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                          linear_conv_kernel_dim=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # + 4 experts (2 a token, renormalized) beside a sigmoid-gated shared expert in every layer
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(_COMMON, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                                                 linear_num_value_heads=4, linear_key_head_dim=16,
                                                 linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, bos_token_id=1, eos_token_id=2,
                                                 pad_token_id=0)),
    "arcee": ("ArceeConfig", dict(_COMMON, hidden_act="relu2", rope_theta=10000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}


def make_random_hf_model(family: str, out_dir: Path, seed: int = 0, overrides: dict | None = None) -> Path:
    """Save a randomly initialised transformers model of `family` (a RANDOM_CONFIGS key) to out_dir.

    `overrides` replaces entries of the family's config (e.g. {"vocab_size": 321} for a vocab TP does not divide).
    """
    import torch
    import transformers

    cls_name, kwargs = RANDOM_CONFIGS[family]
    # NOTE: a copy: transformers fills in the rope dict it is given (rope_theta, partial_rotary_factor)
    config = getattr(transformers, cls_name)(**copy.deepcopy({**kwargs, **(overrides or {})}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial so that a mis-mapped tensor shows in the logits
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias", ".sinks", "act_fn.alpha_p", "act_fn.alpha_n",
                              "A_log", "mamba.D")):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("A_log"):  # NOTE: decay rates as initialised forget the state within one token
                p.copy_(torch.log(torch.rand_like(p) * 0.05 + 0.005))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def save_with_nontrivial_norms(model, out_dir: Path) -> Path:
    """Save a randomly initialised transformers model (its norms moved off 1, so that a mis-mapped norm shows in the
    logits) to out_dir."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, **lora_config: object) -> Path:
    """Save a LoRA adapter of the HF model at base_dir as PEFT does (`lora_config`: peft.LoraConfig's fields), its A
    and B both random (PEFT's init_lora_weights=False), so that it changes the model's logits."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_config)).save_pretrained(out_dir)
    return out_dir


def peft_logits(base_dir: Path, adapter_dir: Path | None, ids: list[int]):
    """Every position's logits [len(ids), vocab] of the HF model at base_dir under the PEFT adapter (None: none)."""
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def require_shared_models() -> None:
    if not STORIES260K.is_dir():
        pytest.fail(f"shared models not found at {MODELS}; set TRTBUILD_SHARED to the folder holding models/")


def alone(llm, prompt: str, **sampling: object) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one request run by itself on an in-process `LLM`: the reference that
    batched and served runs must reproduce exactly."""
    from trtbuild.runtime.sampling import SamplingParams

    out = llm.generate([prompt], SamplingParams(**sampling))[0]
    return out.token_ids, out.text, out.finish_reason


def drive(core: EngineCore, prompts, params) -> tuple[list[list[int]], list[RequestOutput], list[StepStats]]:
    """Add every prompt, step until done; returns each request's tokens, its final output, and every step's stats."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [core.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for r in requests:
        core.add_request(r)
    index = {r.request_id: i for i, r in enumerate(requests)}
    tokens: list[list[int]] = [[] for _ in prompts]
    finals: list[RequestOutput | None] = [None] * len(prompts)
    stats = []
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        core.last_stats = None
        for out in core.step():
            i = index[out.request_id]
            assert finals[i] is None, "output after the final one"
            tokens[i] += out.new_token_ids
            if out.finished:
                finals[i] = out
        assert core.last_stats is not None, "a step with unfinished requests scheduled nothing"
        stats.append(core.last_stats)
    assert not core.has_unfinished() and all(finals)
    return tokens, finals, stats


def assert_pool_full(core: EngineCore) -> None:
    assert core.kv.pool.num_free == core.kv.pool.num_blocks and not core.kv.blocks and not core.tracked


def prefill_logits(engine_dir: Path, ids: list[int]):
    """Every position's logits of one prompt, in one step of a fresh CPU engine (blocks for it in every KV cache
    group)."""
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group

    info = read_engine_config(engine_dir)
    groups, blocks = len(info.kv_cache_groups), -(-len(ids) // info.build.tokens_per_block)
    engine = CpuEngine(info, num_threads=1, num_blocks=groups * blocks)
    return engine.step(in_every_group([SequenceChunk(0, ids, 0, len(ids), list(range(blocks)))], groups, blocks))


def prefix_cached_tokens(core: EngineCore, prompt: list[int], lora: str | None = None) -> int:
    """Run `prompt` for one token under LoRA adapter `lora` on `core`; how many of its tokens came from the
    prefix cache."""
    from trtbuild.runtime.sampling import SamplingParams

    request = core.make_request(prompt, SamplingParams(max_tokens=1), lora=lora)
    core.add_request(request)
    while core.has_unfinished():
        core.step()
    return request.metrics.num_prefix_cached_tokens


def assert_soak_passes(engine: Path, kv_cache_blocks: int, speculative_tokens: int = 0) -> None:
    """benchmarks/soak.py for 8 seconds, 8 workers, a pool of `kv_cache_blocks` (and prompt-lookup drafts): it
    passes (every completed stream equals its request alone, the pool whole, nothing unfinished, RSS flat), with
    preemptions and no mismatch."""
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "soak.py"), "--engine",
                          str(engine), "--duration", "8", "--concurrency", "8", "--kv-cache-blocks",
                          str(kv_cache_blocks), "--threads", "1", "--speculative-tokens", str(speculative_tokens)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "soak: PASS" in out.stdout, out.stdout + out.stderr[-2000:]
    assert re.search(r"[1-9]\d* preemptions", out.stdout) and "0 mismatches" in out.stdout, out.stdout
    if speculative_tokens:  # drafts were verified, and some rejected
        accepted, drafted = map(int, re.search(r"drafts: +(\d+) of (\d+) accepted", out.stdout).groups())
        assert drafted > accepted, out.stdout
