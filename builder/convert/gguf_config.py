"""GGUF metadata -> Hugging Face config dict, for every GGUF architecture trtbuild reads.

llama.cpp prefixes each hyper-parameter with the architecture name (`qwen2.embedding_length`, `llama.rope.freq_base`),
so one reader serves all of them; `GGUF_ARCHITECTURES` holds what differs. The dict returned is what
`configs/from_hf.py: model_config_from_hf` accepts for the family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild.builder.convert import gguf_granite_hybrid, gguf_qwen35
from trtbuild.builder.convert.gguf_rope import f32, rope_scaling
from trtbuild.configs.model_config import COHERE_FAMILIES, LFM2_FAMILIES
from trtbuild.errors import CheckpointError

# Per-layer GGUF tensors (the part after `blk.N.`) of the architectures with separate projections, and of those with
# fused ones (Phi-3: attn_qkv, and ffn_up holding gate and up).
_BASE_LAYER_TENSORS = tuple(f"{n}.weight" for n in ("attn_norm", "ffn_norm", "ffn_down", "attn_output"))
SEPARATE_LAYER_TENSORS = (*_BASE_LAYER_TENSORS, *(f"attn_{p}.weight" for p in "qkv"), "ffn_gate.weight",
                          "ffn_up.weight")
FUSED_LAYER_TENSORS = (*_BASE_LAYER_TENSORS, "attn_qkv.weight", "ffn_up.weight")
# Whole-model tensors that are RoPE parameters (they go into the config): llama 3's per-frequency divisors, Phi-3's
# LongRoPE factors.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_QKV_BIAS = tuple(f"attn_{p}.bias" for p in "qkv")
_QK_NORM = ("attn_q_norm.weight", "attn_k_norm.weight")
# the norms after attention and MLP (Gemma 2 / 3, OLMo 2; Gemma's ffn_norm is the pre-MLP one)
_OUTPUT_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")
# OLMo 2: no norms before the attention and the MLP, one after each; q / k norms
_OLMO2_LAYER_TENSORS = (*(f"attn_{p}.weight" for p in "qkv"), "attn_output.weight", *_QK_NORM, *_OUTPUT_NORMS,
                        *(f"ffn_{p}.weight" for p in ("gate", "up", "down")))

# GLM-4: q / k / v with biases, gate and up in one ffn_up, norms before and after attention and MLP
_GLM4_LAYER_TENSORS = (*SEPARATE_LAYER_TENSORS[:-2], "ffn_up.weight", *_OUTPUT_NORMS)

# Cohere: one norm per layer, which attention and MLP both read
_COHERE_LAYER_TENSORS = tuple(t for t in SEPARATE_LAYER_TENSORS if t != "ffn_norm.weight")

# A mixture of experts' layer: attention as usual, then the router and the experts stacked ([experts, out, in])
_ATTENTION_LAYER_TENSORS = (*(f"{n}.weight" for n in ("attn_norm", "ffn_norm", "attn_output")),
                            *(f"attn_{p}.weight" for p in "qkv"))
_MOE_LAYER_TENSORS = (*_ATTENTION_LAYER_TENSORS,
                      *(f"ffn_{p}.weight" for p in ("gate_inp", "gate_exps", "up_exps", "down_exps")))

# gpt-oss: biases on every projection, the router and the experts; attention sinks; the pre-MLP norm is named
# post_attention_norm
_GPT_OSS_LAYER_TENSORS = ("attn_norm.weight", "post_attention_norm.weight", "attn_sinks.weight",
                          *(f"attn_{p}.{w}" for p in ("q", "k", "v", "output") for w in ("weight", "bias")),
                          *(f"ffn_{p}.{w}" for p in ("gate_inp", "gate_exps", "up_exps", "down_exps")
                            for w in ("weight", "bias")))


@dataclass(frozen=True)
class GgufArch:
    """What one GGUF architecture maps back to on the Hugging Face side."""

    hf_architecture: str  # config.json `architectures[0]`
    model_type: str
    # llama.cpp's converter permuted the q/k rows (LlamaModel.permute) for its interleaved RoPE; Qwen2/Qwen3/Phi-3
    # run NeoX-style RoPE in llama.cpp, so their rows are stored as in HF.
    permute_qk: bool
    layer_tensors: tuple[str, ...] = SEPARATE_LAYER_TENSORS  # required per-layer tensors
    optional_layer_tensors: tuple[str, ...] = ()
    fused: bool = False  # attn_qkv and a gate+up ffn_up, as HF's qkv_proj and gate_up_proj
    no_rope_interval: int = 0  # every this-th layer applies no RoPE (llama.cpp fixes SmolLM3's at 4, unwritten)
    output_norms: bool = False  # post_attention_norm and post_ffw_norm (Gemma 2 / 3)
    # a mixture of experts: whether llama.cpp renormalizes the router's weights over the chosen experts (its
    # build_moe_ffn's norm_w, fixed per architecture); None: a dense model
    moe_normalize: bool | None = None
    # GGUF layer tensor -> HF name where the architecture's differ from the common table's (gguf_reader.py)
    renames: tuple[tuple[str, str], ...] = ()
    hidden_act: str = "silu"  # the MLP's activation, fixed per architecture in llama.cpp
    final_norm: str = "output_norm.weight"  # the GGUF name of the norm before the LM head


GGUF_ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("LlamaForCausalLM", "llama", True, optional_layer_tensors=(*_QKV_BIAS, "attn_output.bias")),
    # llama.cpp writes MistralForCausalLM as general.architecture "llama" (see resolve_architecture); "mistral" is
    # also accepted as a literal architecture name.
    "mistral": GgufArch("MistralForCausalLM", "mistral", True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", False, (*SEPARATE_LAYER_TENSORS, *_QKV_BIAS)),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3", False, (*SEPARATE_LAYER_TENSORS, *_QK_NORM)),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", False, FUSED_LAYER_TENSORS, fused=True),
    "smollm3": GgufArch("SmolLM3ForCausalLM", "smollm3", True, no_rope_interval=4),
    "granite": GgufArch("GraniteForCausalLM", "granite", True, optional_layer_tensors=_QKV_BIAS),
    "olmo2": GgufArch("Olmo2ForCausalLM", "olmo2", False, _OLMO2_LAYER_TENSORS, output_norms=True),
    # llama.cpp writes OLMo 3 as olmo2 with a sliding window (see resolve_architecture)
    "olmo3": GgufArch("Olmo3ForCausalLM", "olmo3", False, _OLMO2_LAYER_TENSORS, output_norms=True),
    "gemma": GgufArch("GemmaForCausalLM", "gemma", False),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", False, (*SEPARATE_LAYER_TENSORS, *_OUTPUT_NORMS),
                       output_norms=True),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", False,
                       (*SEPARATE_LAYER_TENSORS, *_OUTPUT_NORMS, *_QK_NORM), output_norms=True),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", False, (*_MOE_LAYER_TENSORS, *_QK_NORM),
                         moe_normalize=True),
    "olmoe": GgufArch("OlmoeForCausalLM", "olmoe", False, (*_MOE_LAYER_TENSORS, *_QK_NORM), moe_normalize=False),
    # llama.cpp writes Mixtral as general.architecture "llama" with experts (see resolve_architecture)
    "mixtral": GgufArch("MixtralForCausalLM", "mixtral", True, _MOE_LAYER_TENSORS, moe_normalize=True),
    # Granite 4.0's experts come with an ungated shared expert (the _shexp tensors)
    "granitemoe": GgufArch("GraniteMoeForCausalLM", "granitemoe", True, _MOE_LAYER_TENSORS,
                           optional_layer_tensors=(*_QKV_BIAS, *(f"ffn_{p}_shexp.weight" for p in ("gate", "up",
                                                                                                   "down"))),
                           moe_normalize=True),
    "qwen2moe": GgufArch("Qwen2MoeForCausalLM", "qwen2_moe", False, (*_MOE_LAYER_TENSORS, *_QKV_BIAS),
                         optional_layer_tensors=tuple(f"ffn_{p}_shexp.weight" for p in ("gate_inp", "gate", "up",
                                                                                          "down")),
                         moe_normalize=False),
    "gpt-oss": GgufArch("GptOssForCausalLM", "gpt_oss", False, _GPT_OSS_LAYER_TENSORS, moe_normalize=True),
    # ERNIE 4.5 and GLM-4 rotate interleaved pairs (llama.cpp's "norm" RoPE) on rows stored as in HF
    "ernie4_5": GgufArch("Ernie4_5ForCausalLM", "ernie4_5", False),
    "glm4": GgufArch("Glm4ForCausalLM", "glm4", False, _GLM4_LAYER_TENSORS, optional_layer_tensors=_QKV_BIAS, renames=(
        ("ffn_up.weight", "mlp.gate_up_proj.weight"), ("post_attention_norm.weight", "post_self_attn_layernorm.weight"),
        ("post_ffw_norm.weight", "post_mlp_layernorm.weight"))),
    "exaone4": GgufArch("Exaone4ForCausalLM", "exaone4", False, _OLMO2_LAYER_TENSORS, output_norms=True),
    # Command R / Aya (CohereForCausalLM) and Command R7B (Cohere2ForCausalLM): interleaved RoPE as HF stores it
    "command-r": GgufArch("CohereForCausalLM", "cohere", False, _COHERE_LAYER_TENSORS,
                          optional_layer_tensors=(*_QKV_BIAS, "attn_output.bias")),
    "cohere2": GgufArch("Cohere2ForCausalLM", "cohere2", False, _COHERE_LAYER_TENSORS),
    # Ministral 3: llama.cpp's LlamaModel layout (q / k permuted) with YaRN and the attention temperature
    "mistral3": GgufArch("Ministral3ForCausalLM", "ministral3", True),
    # StarCoder 2: LayerNorms with biases, biases on every projection, a GELU MLP without a gate; NeoX RoPE (rows as
    # in HF); llama.cpp runs it without the sliding window
    "starcoder2": GgufArch("Starcoder2ForCausalLM", "starcoder2", False, (
        *_BASE_LAYER_TENSORS, *(f"attn_{p}.weight" for p in "qkv"), "ffn_up.weight", *_QKV_BIAS,
        *(f"{n}.bias" for n in ("attn_norm", "ffn_norm", "attn_output", "ffn_up", "ffn_down"))),
        hidden_act="gelu_pytorch_tanh", renames=tuple((f"ffn_{g}.{w}", f"mlp.c_{hf}.{w}") for g, hf in (
            ("up", "fc"), ("down", "proj")) for w in ("weight", "bias"))),
    # Hunyuan dense: per-head q / k norms (after RoPE), the NTK-alpha base folded into rope.freq_base by the converter
    "hunyuan-dense": GgufArch("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense", False,
                              (*SEPARATE_LAYER_TENSORS, *_QK_NORM), renames=(
                                  ("attn_q_norm.weight", "self_attn.query_layernorm.weight"),
                                  ("attn_k_norm.weight", "self_attn.key_layernorm.weight"))),
    # Arcee (AFM): LlamaModel's layout (q / k permuted) with an MLP of ffn_up and ffn_down only, relu(x)^2 between
    # AFMoE (Trinity): Gemma 2's four norms, per-head q / k norms, the attention's output gate; dense leading layers
    # (ffn_gate / up / down), then a router with its selection bias, experts and shared experts
    "afmoe": GgufArch("AfmoeForCausalLM", "afmoe", True, (
        *(f"{n}.weight" for n in ("attn_norm", "post_attention_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                  "attn_gate", "ffn_norm", "post_ffw_norm")), *_QK_NORM), optional_layer_tensors=(
        *(f"ffn_{p}.weight" for p in ("gate", "up", "down", "gate_inp", "gate_exps", "up_exps", "down_exps",
                                      "gate_shexp", "up_shexp", "down_shexp")), "exp_probs_b.bias"),
        moe_normalize=True, renames=(
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("ffn_norm.weight", "pre_mlp_layernorm.weight"), ("post_ffw_norm.weight", "post_mlp_layernorm.weight"),
            ("attn_gate.weight", "self_attn.gate_proj.weight"), ("ffn_gate_inp.weight", "mlp.router.gate.weight"),
            ("exp_probs_b.bias", "mlp.expert_bias"),
            *((f"ffn_{p}_shexp.weight", f"mlp.shared_experts.{p}_proj.weight") for p in ("gate", "up", "down")))),
    # Apertus: per-head q / k norms, an MLP without a gate whose xIELU scalars are metadata (xielu.*, per layer)
    "apertus": GgufArch("ApertusForCausalLM", "apertus", False, (*_BASE_LAYER_TENSORS, *(
        f"attn_{p}.weight" for p in "qkv"), "ffn_up.weight", *_QK_NORM), optional_layer_tensors=("attn_output.bias",),
        hidden_act="xielu", renames=(("attn_norm.weight", "attention_layernorm.weight"),
                                     ("ffn_norm.weight", "feedforward_layernorm.weight"))),
    "arcee": GgufArch("ArceeForCausalLM", "arcee", True, (*_BASE_LAYER_TENSORS, *(f"attn_{p}.weight" for p in "qkv"),
                                                          "ffn_up.weight"), hidden_act="relu2"),
    # LFM2: attention layers (per-head q / k norms) and short convolution layers (head_count_kv 0); the final norm
    # is written as token_embd_norm; HF's names of norms, MLP and output projection differ from Llama's
    "lfm2": GgufArch("Lfm2ForCausalLM", "lfm2", False, ("attn_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
                                                        "ffn_up.weight", "ffn_down.weight"),
                     optional_layer_tensors=(*(f"attn_{p}.weight" for p in "qkv"), "attn_output.weight", *_QK_NORM,
                                             *(f"shortconv.{p}.weight" for p in ("conv", "in_proj", "out_proj"))),
                     renames=(("attn_norm.weight", "operator_norm.weight"), ("ffn_norm.weight", "ffn_norm.weight"),
                              *((f"ffn_{g}.weight", f"feed_forward.{w}.weight") for g, w in (
                                  ("gate", "w1"), ("up", "w3"), ("down", "w2"))),
                              ("attn_output.weight", "self_attn.out_proj.weight"),
                              ("attn_q_norm.weight", "self_attn.q_layernorm.weight"),
                              ("attn_k_norm.weight", "self_attn.k_layernorm.weight"),
                              *((f"shortconv.{p}.weight", f"conv.{p}.weight") for p in ("conv", "in_proj",
                                                                                       "out_proj"))),
                     final_norm="token_embd_norm.weight"),
}
# Qwen3.5: gated DeltaNet layers (ssm_* tensors) among gated full attention layers (builder/convert/gguf_qwen35.py)
GGUF_ARCHITECTURES["qwen35"] = GgufArch("Qwen3_5ForCausalLM", "qwen3_5_text", False, gguf_qwen35.LAYER_TENSORS,
                                        gguf_qwen35.OPTIONAL_LAYER_TENSORS, renames=gguf_qwen35.RENAMES)
GGUF_ARCHITECTURES["qwen35moe"] = GgufArch(  # + Qwen2-MoE's experts and gated shared expert in every layer
    "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False, gguf_qwen35.MOE_LAYER_TENSORS,
    (*gguf_qwen35.OPTIONAL_LAYER_TENSORS, *gguf_qwen35.SHARED_EXPERT_TENSORS), moe_normalize=True,
    renames=gguf_qwen35.RENAMES)
# Granite 4.0-H: Mamba2 layers (ssm_* tensors) among attention layers (builder/convert/gguf_granite_hybrid.py)
GGUF_ARCHITECTURES["granitehybrid"] = GgufArch(
    "GraniteMoeHybridForCausalLM", "granitemoehybrid", True, gguf_granite_hybrid.LAYER_TENSORS,
    gguf_granite_hybrid.OPTIONAL_LAYER_TENSORS, renames=gguf_granite_hybrid.RENAMES)
GGUF_ARCHITECTURES["nemotron_h"] = GgufArch(
    "NemotronHForCausalLM", "nemotron_h", True, ("attn_norm.weight",), gguf_granite_hybrid.NEMOTRON_H_TENSORS,
    renames=gguf_granite_hybrid.NEMOTRON_H_RENAMES)
GGUF_ARCHITECTURES["mamba2"] = dataclasses.replace(  # Mamba2 layers only (no attention heads, no MLP)
    GGUF_ARCHITECTURES["nemotron_h"], hf_architecture="Mamba2ForCausalLM", model_type="mamba2")
# LFM2-MoE: LFM2's layers, a dense MLP before leading_dense_block_count, experts after it (chosen by sigmoid scores
# plus exp_probs_b, renormalized: llama.cpp's build_moe_ffn with norm_w for this architecture)
_LFM2 = GGUF_ARCHITECTURES["lfm2"]
GGUF_ARCHITECTURES["lfm2moe"] = dataclasses.replace(
    _LFM2, hf_architecture="Lfm2MoeForCausalLM", model_type="lfm2_moe", layer_tensors=_LFM2.layer_tensors[:2],
    optional_layer_tensors=(*_LFM2.optional_layer_tensors, *_LFM2.layer_tensors[2:], "exp_probs_b.bias",
                            *(f"ffn_{p}.weight" for p in ("gate_inp", "gate_exps", "up_exps", "down_exps"))),
    renames=(*_LFM2.renames, ("ffn_gate_inp.weight", "feed_forward.gate.weight"),
             ("exp_probs_b.bias", "feed_forward.expert_bias")), moe_normalize=True)
# Layers llama.cpp gives the larger Gemmas (27B), whose attention scale it takes from hidden / heads, not head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _is_mistral(meta: dict[str, Any], prefix: str) -> bool:
    """A llama-architecture GGUF converted from MistralForCausalLM.

    llama.cpp keeps no HF architecture, so this goes by the model's name (as transformers' GGUF loader does) or a
    sliding window, which only the Mistral family of these honours.
    """
    names = " ".join(str(meta.get(k) or "") for k in ("general.name", "general.basename")).lower()
    return "mistral" in names or bool(meta.get(f"{prefix}.attention.sliding_window"))


def resolve_architecture(meta: dict[str, Any], path: Path) -> tuple[str, GgufArch]:
    """(metadata key prefix, architecture entry) of a GGUF file; CheckpointError for an unsupported one."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"{path} has GGUF architecture {arch!r}; trtbuild reads GGUF architectures "
            f"{', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, SmolLM, SmolLM3, TinyLlama, Qwen2/2.5, Qwen3, "
            "Phi-3/3.5, Phi-4, Gemma 1/2/3, Granite 3, OLMo 2/3, Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, Granite MoE, "
            "gpt-oss, ERNIE 4.5, GLM-4, EXAONE 4, Command R / Aya, Command R7B, Ministral 3, LFM2, LFM2-MoE ...). "
            "Convert the HF checkpoint instead."
        )
    if arch == "llama" and meta.get("llama.expert_count"):
        return arch, GGUF_ARCHITECTURES["mixtral"]
    if arch == "llama" and _is_mistral(meta, arch):
        return arch, GGUF_ARCHITECTURES["mistral"]
    if arch == "olmo2" and meta.get("olmo2.attention.sliding_window"):
        return arch, GGUF_ARCHITECTURES["olmo3"]
    return arch, GGUF_ARCHITECTURES[arch]


def _eos_ids(meta: dict[str, Any]) -> int | list[int] | None:
    """EOS, plus the end-of-turn / end-of-message tokens llama.cpp also stops at."""
    ids = [meta[k] for k in (f"tokenizer.ggml.{t}_token_id" for t in ("eos", "eot", "eom")) if k in meta]
    ids = list(dict.fromkeys(int(i) for i in ids))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def hf_config(
    meta: dict[str, Any],
    prefix: str,
    arch: GgufArch,
    shapes: dict[str, tuple[int, ...]],
    rope_tensors: dict[str, np.ndarray],
) -> dict[str, Any]:
    """The Hugging Face config.json dict of a GGUF whose metadata keys start with `prefix`; `rope_tensors` are the
    file's RoPE factor tensors (ROPE_TENSORS) by name."""

    def need(key: str) -> Any:
        if f"{prefix}.{key}" not in meta:
            raise CheckpointError(f"GGUF metadata lacks {prefix}.{key}; the file is incomplete. Re-export it.")
        return meta[f"{prefix}.{key}"]

    def first(value: Any) -> int:  # llama.cpp may store per-layer lists (all equal for these architectures)
        return int(value[0] if isinstance(value, list) else value)

    # NOTE: a file without attention (mamba2) has 0 heads
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count")) or 1
    rope_dim = meta.get(f"{prefix}.rope.dimension_count")
    kv_per_layer = meta.get(f"{prefix}.attention.head_count_kv", heads)  # LFM2: 0 for its convolution layers
    kv_heads = int(max(kv_per_layer) if isinstance(kv_per_layer, list) else kv_per_layer)
    q_rows = shapes["blk.0.attn_q.weight"][0] // heads if "blk.0.attn_q.weight" in shapes else None
    if "blk.0.attn_qkv.weight" in shapes:  # fused: q, k and v heads
        q_rows = shapes["blk.0.attn_qkv.weight"][0] // (heads + 2 * kv_heads)
    head_dim = int(meta.get(f"{prefix}.attention.key_length") or q_rows or rope_dim or hidden // heads)
    partial = rope_dim is not None and int(rope_dim) != head_dim
    if partial and arch.permute_qk:
        raise CheckpointError(
            f"GGUF rotates {rope_dim} of {head_dim} head dimensions ({prefix}.rope.dimension_count); partial rotary "
            f"embeddings are supported for NeoX-style architectures (phi3), not {arch.model_type}."
        )
    vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else None
    vocab = vocab or meta.get(f"{prefix}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    window = meta.get(f"{prefix}.attention.sliding_window")
    experts_features = meta.get(f"{prefix}.expert_feed_forward_length")
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        # NOTE: a Qwen3-MoE file may give only its experts' size
        "intermediate_size": first(meta.get(f"{prefix}.feed_forward_length") or experts_features
                                   or need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta.get(f"{prefix}.context_length", 2048)),
        "rms_norm_eps": f32(meta.get(f"{prefix}.attention.layer_norm_rms_epsilon")
                             or meta.get(f"{prefix}.attention.layer_norm_epsilon") or 1e-5),
        "rope_theta": f32(meta.get(f"{prefix}.rope.freq_base", 10000.0)),
        "hidden_act": arch.hidden_act,
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": False,
        "sliding_window": int(window) if window else None,  # only the mistral and phi3 families use it
        "torch_dtype": "float32",
    }
    for ours, theirs in (("bos", "bos"), ("pad", "padding")):
        if f"tokenizer.ggml.{theirs}_token_id" in meta:
            cfg[f"{ours}_token_id"] = int(meta[f"tokenizer.ggml.{theirs}_token_id"])
    if (eos := _eos_ids(meta)) is not None:
        cfg["eos_token_id"] = eos
    if arch.no_rope_interval:
        cfg["no_rope_layers"] = [int((i + 1) % arch.no_rope_interval != 0) for i in range(cfg["num_hidden_layers"])]
    if partial:  # Phi-4-mini
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim
    if (scaling := rope_scaling(meta, prefix, rope_tensors, cfg)) is not None:
        cfg["rope_scaling"] = scaling
    if arch.model_type.startswith("gemma"):
        cfg.update(_gemma_config(meta, prefix, cfg))
    if arch.moe_normalize is not None:
        shared = int(meta.get(f"{prefix}.expert_shared_feed_forward_length") or 0)
        cfg.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(experts_features or cfg["intermediate_size"]),
                   norm_topk_prob=arch.moe_normalize, shared_expert_intermediate_size=shared,
                   shared_expert_gated=not (shared and arch.model_type == "granitemoe"))  # Granite 4.0's: ungated
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern")
    if arch.model_type in ("olmo3", "exaone4") and isinstance(pattern, list):
        cfg["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    if beta := meta.get(f"{prefix}.attention.temperature_scale"):  # Ministral 3, over YaRN's original context
        if (cfg.get("rope_scaling") or {}).get("rope_type") != "yarn":
            raise CheckpointError(f"This GGUF scales its attention's temperature ({prefix}.attention.temperature_scale)"
                                  " but its RoPE is not YaRN, whose original context that scaling steps over; the "
                                  "file is incomplete: re-export it.")
        cfg["rope_scaling"]["llama_4_scaling_beta"] = f32(beta)
    if arch.model_type in LFM2_FAMILIES:  # its feed_forward_length is the MLP's features already
        cfg.update(layer_types=["conv" if n == 0 else "full_attention" for n in kv_per_layer]
                   if isinstance(kv_per_layer, list) else None, conv_L_cache=int(need("shortconv.l_cache")),
                   block_auto_adjust_ff_dim=False, norm_eps=cfg["rms_norm_eps"])
    if arch.model_type == "lfm2_moe":
        dense = int(meta.get(f"{prefix}.leading_dense_block_count") or 0)
        cfg.update(num_dense_layers=dense, use_expert_bias=f"blk.{dense}.exp_probs_b.bias" in shapes,
                   routed_scaling_factor=f32(meta.get(f"{prefix}.expert_weights_scale") or 1.0))
    if arch.model_type == "afmoe":  # AfmoeModel; llama.cpp scales the embeddings by sqrt(hidden) always (muP)
        pattern = meta.get(f"{prefix}.attention.sliding_window_pattern")
        every = 4  # llama.cpp's default: three sliding layers, then a full one
        cfg.update(num_dense_layers=int(meta.get(f"{prefix}.leading_dense_block_count") or 0),
                   num_shared_experts=int(meta.get(f"{prefix}.expert_shared_count") or 0),
                   route_scale=f32(meta.get(f"{prefix}.expert_weights_scale") or 1.0), mup_enabled=True,
                   sliding_window=meta.get(f"{prefix}.attention.sliding_window"),
                   layer_types=[("sliding_attention" if (pattern[i] if isinstance(pattern, list) else (i + 1) % every)
                                 else "full_attention") for i in range(cfg["num_hidden_layers"])])
    if arch.model_type == "granitemoehybrid":
        cfg.update(gguf_granite_hybrid.granite_hybrid_config(meta, prefix, shapes))
    if arch.model_type == "nemotron_h":
        cfg.update(gguf_granite_hybrid.nemotron_h_config(meta, prefix, shapes))
    if arch.model_type == "mamba2":
        cfg.update(gguf_granite_hybrid.mamba2_config(meta, prefix, shapes))
    if arch.model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        cfg.update(gguf_qwen35.qwen35_config(meta, prefix))
    if arch.model_type == "starcoder2":  # LayerNorms
        cfg["norm_epsilon"] = cfg["rms_norm_eps"]
    if arch.model_type in COHERE_FAMILIES:  # LayerNorms, and the logits' multiplier
        cfg.update(layer_norm_eps=cfg["rms_norm_eps"], logit_scale=f32(need("logit_scale")))
    if arch.model_type in ("granite", "granitemoe", "granitemoehybrid"):  # llama.cpp's names for its multipliers
        for theirs, ours in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                             ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            if (value := meta.get(f"{prefix}.{theirs}")) is not None:
                cfg[ours] = f32(value)
    return cfg


def _gemma_config(meta: dict[str, Any], prefix: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma's HF config fields, with the values llama.cpp runs the file with (its defaults where keys are absent:
    Gemma 2's window 4096 and soft-caps 50 / 30, every second layer sliding; Gemma 3's every sixth layer full and
    its sliding layers' unscaled RoPE base 10000)."""
    family, layers = prefix, cfg["num_hidden_layers"]  # the GGUF architecture
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "embedding_multiplier": float(np.sqrt(np.float32(cfg["hidden_size"]))),  # llama.cpp: sqrtf(n_embd)
    }
    if family == "gemma":
        return out
    big = layers == _GEMMA_27B_LAYERS[family]
    out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
    final_cap = meta.get(f"{prefix}.final_logit_softcapping", 30.0 if family == "gemma2" else None)
    out["final_logit_softcapping"] = f32(final_cap) if final_cap else None
    if family == "gemma2":
        out["attn_logit_softcapping"] = f32(meta.get(f"{prefix}.attn_logit_softcapping", 50.0))
        out["sliding_window"] = int(meta.get(f"{prefix}.attention.sliding_window", 4096))
    if not out.get("sliding_window", cfg["sliding_window"]):
        return out
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern", 2 if family == "gemma2" else 6)
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if swa else "full_attention" for swa in pattern[:layers]]
    else:  # llama.cpp: layer i slides unless i % pattern == pattern - 1 (0: every layer slides)
        out["layer_types"] = ["sliding_attention" if not pattern or i % pattern < pattern - 1 else "full_attention"
                              for i in range(layers)]
    local_base = meta.get(f"{prefix}.rope.freq_base_swa")
    if family == "gemma3":
        out["rope_local_base_freq"] = f32(local_base) if local_base else 10000.0
    elif local_base and f32(local_base) != cfg["rope_theta"]:
        raise CheckpointError(f"this Gemma 2 GGUF gives its sliding layers their own RoPE base ({local_base}), "
                              "which trtbuild does not apply to Gemma 2.")
    return out
