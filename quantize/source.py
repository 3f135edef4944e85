"""What `trtbuild quantize` reads: an HF folder, a GGUF file or a trtbuild checkpoint, as HF-named tensors, and the
fp32 transformers model built from them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtbuild.configs.model_config import COHERE_FAMILIES, GEMMA_FAMILIES, ModelConfig
from trtbuild.errors import CheckpointError, ConfigError


@dataclass
class Source:
    kind: str  # "hf" | "gguf" | "checkpoint"
    path: Path
    hf_config: dict[str, Any]
    hf_tensors: dict[str, torch.Tensor]

    def write_tokenizer(self, out_dir: Path) -> None:
        """Put the source's tokenizer files into `out_dir` (GGUF: exported from the file's metadata)."""
        from trtbuild.builder.convert.checkpoint import copy_tokenizer_files

        if self.kind == "gguf":
            from trtbuild.builder.convert.gguf_tokenizer import export_gguf_tokenizer

            export_gguf_tokenizer(self.path, out_dir)
        else:
            copy_tokenizer_files(self.path, out_dir)


def read_source(model: Path) -> Source:
    """Read `model`: a .gguf file, a trtbuild checkpoint folder (config.json with format_version) or an HF folder."""
    model = Path(model)
    if not model.exists():
        raise ConfigError("model", f"{model} does not exist.")
    if model.is_file():
        if model.suffix.lower() != ".gguf":
            raise ConfigError("model", f"{model} is a file but not a .gguf; pass a GGUF file, an HF model folder or a "
                                       "trtbuild checkpoint folder.")
        from trtbuild.builder.convert.gguf_reader import read_gguf

        cfg, arrays = read_gguf(model)
        from trtbuild.configs.from_hf import model_config_from_hf

        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        return Source("gguf", model, cfg, hf_norm_weights(tensors, model_config_from_hf(cfg).family))
    if _is_trtbuild_checkpoint(model):
        return _read_checkpoint(model)
    from trtbuild.builder.convert.hf_reader import read_hf

    cfg, tensors = read_hf(model)
    return Source("hf", model, cfg, tensors)


def _is_trtbuild_checkpoint(folder: Path) -> bool:
    try:
        return "format_version" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _read_checkpoint(folder: Path) -> Source:
    from trtbuild.builder.convert.checkpoint import load_checkpoint
    from trtbuild.builder.convert.sharding import merge_shards

    config, first = load_checkpoint(folder, 0)
    q = config.quantization
    if quantized := q.quant_algo or q.kv_cache_quant_algo or q.lm_head_quant_algo:
        raise CheckpointError(f"{folder} is already quantized ({quantized}); quantize "
                              "the original model or its unquantized `trtbuild convert` checkpoint.")
    shards = [first] + [load_checkpoint(folder, r)[1] for r in range(1, config.mapping.world_size)]
    return Source("checkpoint", folder, hf_config_from_model_config(config),
                  hf_tensors_of_checkpoint(merge_shards(shards, config, config.mapping), config))


def hf_tensors_of_checkpoint(tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under their HF names, with HF's values (Gemma's norms as the w of its 1 + w)."""
    from trtbuild.builder.convert.names import checkpoint_to_hf_name

    hf = {h: t for name, t in tensors.items() if (h := checkpoint_to_hf_name(name, config)) is not None}
    return hf_norm_weights(hf, config.family)


def hf_norm_weights(tensors: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """HF-named tensors holding RMSNorm multipliers (a GGUF's, a checkpoint's) with Gemma's norms as transformers
    holds them: w where its RMSNorm multiplies by 1 + w (the inverse of convert.py's norm_multipliers)."""
    if family not in GEMMA_FAMILIES:
        return tensors
    return {n: t.float() - 1.0 if n.endswith("norm.weight") else t for n, t in tensors.items()}


def hf_config_from_model_config(c: Any) -> dict[str, Any]:
    """A Hugging Face config dict that `model_config_from_hf` maps back to the same model (mapping aside)."""
    cfg: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": _MODEL_TYPES.get(c.family, c.family),
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_size,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_epsilon,
        "rope_theta": c.rotary_base,
        "hidden_act": c.hidden_act,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None),
        "torch_dtype": c.dtype,
        "sliding_window": c.sliding_window,
        "use_sliding_window": c.sliding_window is not None,
    }
    if c.family == "llama":
        cfg["attention_bias"] = c.qkv_bias
    if c.rotary_scaling:
        cfg["rope_scaling"] = dict(c.rotary_scaling)
    if c.attn_temperature_scale is not None:  # Ministral 3: over YaRN's original context
        cfg["rope_scaling"]["llama_4_scaling_beta"] = c.attn_temperature_scale
    if c.rotary_dim is not None:
        cfg["partial_rotary_factor"] = c.rotary_dim / c.head_size
    if c.family == "glm4":  # NOTE: Glm4Config's default pad token (151329) may lie past a smaller vocabulary
        cfg.update(attention_bias=c.qkv_bias, partial_rotary_factor=(c.rotary_dim or c.head_size) / c.head_size,
                   pad_token_id=None)
    if c.family == "ernie4_5":
        cfg["use_bias"] = False
    if c.family == "llama":
        cfg["mlp_bias"] = c.mlp_bias
    if c.family == "starcoder2":
        cfg.update(norm_epsilon=c.norm_epsilon, use_bias=c.mlp_bias)
    if c.family == "smollm3":
        cfg["no_rope_layers"] = [int(i not in c.no_rope_layers) for i in range(c.num_hidden_layers)]
    if c.family in GEMMA_FAMILIES:
        cfg.update(hidden_activation=c.hidden_act, embedding_multiplier=c.embedding_multiplier)
    if c.family in COHERE_FAMILIES:
        cfg.update(layer_norm_eps=c.norm_epsilon, logit_scale=1.0 / c.logits_scaling, attention_bias=c.qkv_bias)
    # NOTE: Exaone4Config cannot derive them without a window
    if c.family in ("gemma2", "gemma3", "olmo3", "exaone4", "cohere2"):
        cfg["layer_types"] = list(c.layer_types)
    if c.family in ("gemma2", "gemma3"):
        scalar = round(c.score_scale**-2, 6)  # transformers wants an int where it is one
        cfg.update(query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                   attn_logit_softcapping=c.attn_logit_softcapping, final_logit_softcapping=c.final_logit_softcapping)
    if c.local_rotary_base is not None:
        cfg["rope_local_base_freq"] = c.local_rotary_base
    if c.family == "granite":
        cfg.update(embedding_multiplier=c.embedding_multiplier, attention_multiplier=c.score_scale,
                   residual_multiplier=c.residual_multiplier, logits_scaling=c.logits_scaling,
                   attention_bias=c.qkv_bias)
    return cfg


# transformers' model_type where it is not the family's name
_MODEL_TYPES = {"gemma3": "gemma3_text", "hunyuan_dense": "hunyuan_v1_dense"}


# Families whose transformers model fuses q/k/v and gate/up: their torch model is the Mistral model (Llama with a
# sliding window) of the same weights, whose separate linears the quantizer calibrates and exports one by one as the
# checkpoint holds them.
FUSED_AS_MISTRAL = ("Phi3ForCausalLM",)


def _as_mistral(hf_config: dict[str, Any], tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Mistral config and HF tensors computing what a Phi-3 model computes: the same RoPE (LongRoPE included)
    and sliding window."""
    from trtbuild.builder.convert.fused import split_fused_tensors
    from trtbuild.configs.from_hf import model_config_from_hf

    config = model_config_from_hf(hf_config)
    mistral = {k: v for k, v in hf_config.items() if k not in ("rope_scaling", "rope_parameters",
                                                               "partial_rotary_factor")}
    mistral.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=config.sliding_window)
    # NOTE: a partial rotary model's RoPE is the engine's (build_torch_model swaps it in): its own is never used
    mistral["rope_parameters"] = {"rope_type": "default", **({} if config.rotary_dim else config.rotary_scaling or {}),
                                  "rope_theta": config.rotary_base}
    split = split_fused_tensors(tensors, config)
    return mistral, _in_engine_row_order(split, config) if config.rotary_dim else split


def _in_engine_row_order(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors with q / k rows in the engine's order (builder/rope.py), for a Mistral model on whole-head RoPE."""
    from trtbuild.builder.rope import EngineRotaryRows

    names = {n: re.sub(r"^model\.layers\.(\d+)\.self_attn\.([qk])_proj\.weight$",
                       r"transformer.layers.\1.attention.\2.weight", n) for n in tensors}
    rows = EngineRotaryRows({names[n]: t for n, t in tensors.items()}, config)
    return {n: rows[names[n]] for n in tensors}


# Families whose transformers MLP fuses gate and up (GLM-4's Phi3MLP) but not q/k/v: their MLPs are swapped for
# SeparateGateUpMLP, so that the quantizer calibrates and exports gate and up one by one, as the checkpoint holds them.
SEPARATE_GATE_UP = ("Glm4ForCausalLM",)


class SeparateGateUpMLP(torch.nn.Module):
    """A fused gate_up_proj MLP as separate gate_proj / up_proj / down_proj linears computing the same thing."""

    def __init__(self, fused: torch.nn.Module) -> None:
        super().__init__()
        hidden, features = fused.gate_up_proj.in_features, fused.down_proj.in_features
        self.gate_proj = torch.nn.Linear(hidden, features, bias=False)
        self.up_proj = torch.nn.Linear(hidden, features, bias=False)
        self.down_proj, self.act_fn = fused.down_proj, fused.activation_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _with_separate_gate_up(model: torch.nn.Module, tensors: dict[str, torch.Tensor], hf_config: dict[str, Any]
                           ) -> dict[str, torch.Tensor]:
    """Swap `model`'s MLPs for SeparateGateUpMLP; `tensors` with any fused gate_up_proj split to match."""
    from trtbuild.builder.convert.fused import split_fused_tensors
    from trtbuild.configs.from_hf import model_config_from_hf

    for layer in model.model.layers:
        layer.mlp = SeparateGateUpMLP(layer.mlp)
    return split_fused_tensors(tensors, model_config_from_hf(hf_config))


class EngineRotaryEmbedding(torch.nn.Module):
    """The engine's RoPE (builder/rope.py: whole-head pairs, cos 1 / sin 0 past the rotated ones) as a transformers
    rotary module: a model on rows in the engine's order computes the partial rotary model's attention. As HF's
    LongRoPE, the longest position of the forward picks the factors."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from trtbuild.builder.rope import rope_tables

        cos, sin = (torch.from_numpy(t) for t in rope_tables(self.config, int(position_ids.max()) + 1))
        cos, sin = (torch.cat([t, t], dim=-1)[position_ids] for t in (cos, sin))
        return cos.to(x.dtype), sin.to(x.dtype)


def build_torch_model(source: Source, untie: bool = False) -> torch.nn.Module:
    """The fp32 transformers model of `source`, in eval mode (transformers' own GGUF loading needs accelerate).
    Consumes `source.hf_tensors`: each tensor leaves the dict once copied into the model, so that memory holds the
    source and the fp32 model together only as long as needed.

    `untie` gives lm_head its own copy of tied embeddings: calibrating a quantized lm_head (AWQ, SmoothQuant)
    rescales its weight in place, which must not change the embedding.
    """
    import transformers
    from transformers.initialization import no_init_weights

    from trtbuild.configs.from_hf import TEXT_MODELS_OF, model_config_from_hf
    from trtbuild.configs.granite4 import GRANITE4_ARCHITECTURES, granite4_as_granite

    config_dict = source.hf_config
    if (arch := (config_dict.get("architectures") or [None])[0]) in TEXT_MODELS_OF:
        raise CheckpointError(f"`trtbuild quantize` reads the text decoder of a {arch} from its trtbuild checkpoint: "
                              f"run `trtbuild convert --model {source.path} --output CKPT` first, then quantize CKPT.")
    if arch in FUSED_AS_MISTRAL:
        config_dict, source.hf_tensors = _as_mistral(config_dict, source.hf_tensors)
    if arch in GRANITE4_ARCHITECTURES:  # calibrated as the Granite model it computes (its shared MLP split)
        from trtbuild.builder.convert.fused import split_fused_tensors

        config_dict = granite4_as_granite(config_dict)
        source.hf_tensors = split_fused_tensors(source.hf_tensors, model_config_from_hf(config_dict))
    if source.kind == "hf" and config_dict is source.hf_config:
        hf_cfg = transformers.AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    else:
        kwargs = {k: v for k, v in config_dict.items() if k not in ("model_type", "torch_dtype")}
        hf_cfg = transformers.AutoConfig.for_model(config_dict["model_type"], **kwargs)
    with no_init_weights():  # every weight is loaded below (a random init of 1.5B parameters takes ~18 s)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    model.tie_weights()  # which no_init_weights skips
    if arch in FUSED_AS_MISTRAL and (partial := model_config_from_hf(source.hf_config)).rotary_dim:
        model.model.rotary_emb = EngineRotaryEmbedding(partial)  # on _as_mistral's reordered q / k rows
    embedding_scale = getattr(model.get_input_embeddings(), "embed_scale", None)
    if embedding_scale is not None:  # Gemma: the checkpoint's multiplier (transformers' sqrt(hidden) in the
        embedding_scale.fill_(model_config_from_hf(config_dict).embedding_multiplier)  # source dtype), not fp32's
    if arch in SEPARATE_GATE_UP:
        source.hf_tensors = _with_separate_gate_up(model, source.hf_tensors, config_dict)
    embedding, head = "model.embed_tokens.weight", "lm_head.weight"
    state = source.hf_tensors
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    if tied:
        if head not in state and embedding in state:
            state[head] = state[embedding]
        if embedding not in state and head in state:
            state[embedding] = state[head]
        if untie:
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        else:
            state.pop(head, None)
    own = model.state_dict()
    missing = sorted(m for m in set(own) - set(state) if not m.endswith("inv_freq") and not (tied and m == head))
    if missing:
        raise CheckpointError(f"{source.path} lacks {len(missing)} tensors the model needs (first: {missing[0]}).")
    with torch.no_grad():
        for name in [n for n in state if n in own]:
            tensor = state.pop(name)
            if tensor.numel() == own[name].numel() == 1:  # NOTE: a checkpoint's [1] scalar for a 0-d buffer (xIELU's)
                tensor = tensor.reshape(own[name].shape)
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise CheckpointError(f"{source.path}: the weights do not fit the model's config ({name} has shape "
                                      f"{tuple(tensor.shape)}, the model {tuple(own[name].shape)}).")
            own[name].copy_(tensor)
            del tensor
    return model.eval()
