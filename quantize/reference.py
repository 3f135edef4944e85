"""References for engines that run quantized checkpoints.

- `simulated_model`: modelopt's fake-quantized torch model, exactly the model a `trtbuild quantize` run exports.
- `dequantize_checkpoint`: a quantized checkpoint's weights as fp32 [out, in] tensors in checkpoint names.
- `reference_model`: a transformers model that computes what the checkpoint format says (dequantized weights,
  `x * prequant`, activation and KV-cache fake quantization) from the checkpoint alone, without modelopt.
- `write_dequantized_checkpoint`: an unquantized fp32 checkpoint (prequant folded into the weights) for fp32 engines;
  exact for int4_awq (weight-only), without the activation / KV quantization of the other formats.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trtbuild.configs import Mapping, ModelConfig, QuantConfig
from trtbuild.quantize.formats import activation_kind, dequantize_weight, fake_quant, per_token_scale

_ATTENTION = "trtbuild_kv_fake_quant"
_SOFTCAP_ATTENTION = "trtbuild_kv_fake_quant_softcap"


def simulated_model(model: Path, qformat: str, **options: Any) -> torch.nn.Module:
    """modelopt's simulated-quantization model of `model`, calibrated as `trtbuild quantize` with the same options
    (fields of `trtbuild.quantize.options.QuantizeOptions`) calibrates it."""
    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    with tempfile.TemporaryDirectory() as tmp:
        return quantize(QuantizeOptions(model, Path(tmp) / "ckpt", qformat, **options)).model


def load_merged(ckpt_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """All ranks of a checkpoint merged into one rank-agnostic dict."""
    from trtbuild.builder.convert.checkpoint import load_checkpoint
    from trtbuild.builder.convert.sharding import merge_shards

    config, first = load_checkpoint(Path(ckpt_dir), 0)
    shards = [first] + [load_checkpoint(Path(ckpt_dir), r)[1] for r in range(1, config.mapping.world_size)]
    return config, merge_shards(shards, config, config.mapping)


def dequantize_checkpoint(ckpt_dir: Path, fold_prequant: bool = False) -> dict[str, torch.Tensor]:
    """fp32 tensors in checkpoint names: every `P.weight` dequantized to [out, in] (`P.weights_scaling_factor`
    consumed), everything else cast to fp32. With `fold_prequant`, `P.weight * prequant[None, :]` replaces the
    weight and `P.prequant_scaling_factor` is dropped ((x * pre) @ W^T == x @ (W * pre)^T)."""
    config, tensors = load_merged(ckpt_dir)
    q = config.quantization
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weights_scaling_factor"):
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{prefix}.weights_scaling_factor" in tensors:
            t = dequantize_weight(q.algo_of(prefix) or "", t, tensors[f"{prefix}.weights_scaling_factor"],
                                  q.group_size)
            if fold_prequant and f"{prefix}.prequant_scaling_factor" in tensors:
                t = t * tensors[f"{prefix}.prequant_scaling_factor"].float()[None, :]
        elif fold_prequant and name.endswith(".prequant_scaling_factor"):
            continue
        out[name] = t.float()
    return out


def write_dequantized_checkpoint(ckpt_dir: Path, out_dir: Path) -> ModelConfig:
    """Write an unquantized float32, single-rank checkpoint with the dequantized (prequant-folded) weights."""
    from trtbuild.builder.convert.checkpoint import CONFIG_FILE, copy_tokenizer_files, prepare_output_dir, save_rank

    config = ModelConfig.load(Path(ckpt_dir) / CONFIG_FILE)
    tensors = dequantize_checkpoint(ckpt_dir, fold_prequant=True)
    tensors = {n: t for n, t in tensors.items() if not n.endswith("_scaling_factor")}
    config = dataclasses.replace(config, dtype="float32", mapping=Mapping(), quantization=QuantConfig())
    prepare_output_dir(Path(out_dir))
    save_rank(Path(out_dir), 0, tensors)
    copy_tokenizer_files(Path(ckpt_dir), Path(out_dir))
    config.save(Path(out_dir) / CONFIG_FILE)
    return config


def reference_model(ckpt_dir: Path, activations: bool = True, kv_cache: bool = True) -> torch.nn.Module:
    """A fp32 transformers model computing the quantized checkpoint's math (see docs/quantization.md).

    `activations=False` skips the activation fake quantization (the prequant scales still apply) and
    `kv_cache=False` the KV-cache one: what `weights_only(simulated)` computes.
    """
    from trtbuild.quantize.calibrate import linear_modules
    from trtbuild.quantize.source import (
        Source,
        build_torch_model,
        hf_config_from_model_config,
        hf_tensors_of_checkpoint,
    )

    config = ModelConfig.load(Path(ckpt_dir) / "config.json")
    tensors = dequantize_checkpoint(ckpt_dir)
    source = Source("checkpoint", Path(ckpt_dir), hf_config_from_model_config(config),
                    hf_tensors_of_checkpoint(tensors, config))
    model = build_torch_model(source, untie=True)  # a quantized lm_head differs from the embedding
    kind = activation_kind(config.quantization.quant_algo or "")
    per_token = config.quantization.per_token_activations and activations
    for prefix, name in linear_modules(model, config).items():
        pre = tensors.get(f"{prefix}.prequant_scaling_factor")
        act = tensors.get(f"{prefix}.activation_scaling_factor") if activations else None
        dynamic = per_token and not config.quantization.is_excluded(prefix)
        if pre is not None or act is not None or dynamic:
            model.get_submodule(name).register_forward_pre_hook(_input_hook(pre, act, kind, dynamic))
    kv = config.quantization.kv_cache_quant_algo
    if kv is not None and kv_cache:
        scales = [tensors[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
                  for i in range(config.num_hidden_layers)]
        _register_kv_attention()
        for i, block in enumerate(model.get_submodule("model.layers")):
            block.self_attn.trtbuild_kv = (kv, scales[i])
        model.set_attn_implementation(_SOFTCAP_ATTENTION if config.attn_logit_softcapping else _ATTENTION)
    return model.eval()


@contextmanager
def weights_only(simulated: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, a modelopt model's activation and KV-cache quantizers are off (pre-quant scales stay)."""
    quantizers = [m for n, m in simulated.named_modules()
                  if n.endswith(("input_quantizer", "_bmm_quantizer")) and getattr(m, "is_enabled", False)]
    for q in quantizers:
        q.disable()
    try:
        yield simulated
    finally:
        for q in quantizers:
            q.enable()


def _input_hook(pre: torch.Tensor | None, act: torch.Tensor | None, kind: str | None, per_token: bool = False
                ) -> Any:
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        if pre is not None:
            x = x * pre.to(x.dtype)
        if per_token:
            x = fake_quant(x, per_token_scale(x), "int8")
        elif act is not None and kind is not None:
            x = fake_quant(x, act, kind)
        return (x, *args[1:])

    return hook


def _register_kv_attention() -> None:
    """Attentions that store K (after RoPE) and V through the KV cache's quantization first: sdpa's, and (for
    soft-capped scores, which sdpa does not compute: Gemma 2) Gemma 2's eager one, each with its masks (NOTE: an
    attention without a registered mask gets none: causal, past any sliding window)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    def kv_fake_quant(forward: Any) -> Any:
        def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      *args: Any, **kwargs: Any) -> Any:
            kind, scales = module.trtbuild_kv
            key = fake_quant(key, scales[0], kind, narrow=True)
            value = fake_quant(value, scales[1], kind, narrow=True)
            return forward(module, query, key, value, *args, **kwargs)

        return attention

    AttentionInterface.register(_ATTENTION, kv_fake_quant(sdpa_attention_forward))
    AttentionMaskInterface.register(_ATTENTION, sdpa_mask)
    AttentionInterface.register(_SOFTCAP_ATTENTION, kv_fake_quant(eager_attention_forward))
    AttentionMaskInterface.register(_SOFTCAP_ATTENTION, eager_mask)
