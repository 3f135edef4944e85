"""Calibrated modelopt model -> quantized checkpoint tensors (format: docs/quantization.md).

The tensors are computed from each quantizer's own state (amax, pre_quant_scale) with modelopt's rounding, and each
dequantized weight is checked against the quantizer's fake-quantized weight, so the checkpoint is the simulated
model, not an approximation of it.
"""

from __future__ import annotations

import torch

from trtbuild.errors import TrtbuildError
from trtbuild.quantization import FP8_E4M3_MAX, INT4_MAX, INT8_MAX, QuantAlgo, pack_int4_torch
from trtbuild.quantize.formats import dequantize_weight, kv_max

_EPS = 1.0 / (1 << 24)  # modelopt treats smaller amaxes as zero


def _amax(quantizer: torch.nn.Module) -> torch.Tensor:
    return quantizer.amax.detach().float()


def _per_tensor_scale(amax: torch.Tensor, bound: float) -> torch.Tensor:
    """amax / bound as a float32 scalar, computed as modelopt's fake quantization descales (1 / (bound / amax))."""
    amax = amax.reshape(())
    safe = torch.where(amax <= _EPS, torch.ones_like(amax), amax)
    return (1.0 / (bound / safe)).float()


def _quantize_weight(algo: str, w: torch.Tensor, amax: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored weight, weights_scaling_factor) of fp32 weight `w` [out, in] under the quantizer's amax."""
    out_features, in_features = w.shape
    if algo == QuantAlgo.FP8:  # modelopt: cast(clamp(w * (448 / amax))) * (1 / (448 / amax))
        amax = amax.reshape(())
        q_scale = FP8_E4M3_MAX / torch.where(amax <= _EPS, torch.ones_like(amax), amax)
        q = (w * q_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q, _per_tensor_scale(amax, FP8_E4M3_MAX)
    if algo == QuantAlgo.INT8_SQ:
        amax = amax.reshape(out_features, 1)
        bound = INT8_MAX
    else:
        amax = amax.reshape(out_features, in_features // group, 1)
        w = w.reshape(out_features, in_features // group, group)
        bound = INT4_MAX
    # a true division, as modelopt's `max_bound / amax` (a python `bound / amax` multiplies by a reciprocal)
    q_scale = torch.where(amax <= _EPS, torch.zeros_like(amax), torch.full_like(amax, bound) / amax)
    q = torch.clamp((w * q_scale).round(), -bound - 1, bound)
    scale = (amax / bound).float()
    if algo == QuantAlgo.INT8_SQ:
        return q.to(torch.int8), scale.reshape(out_features)
    return pack_int4_torch(q.reshape(out_features, in_features)), scale.reshape(out_features, in_features // group)


def export_linear(algo: str, prefix: str, module: torch.nn.Module, group: int, per_token: bool = False
                  ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear (weight, scales), verified against modelopt's simulation.
    With `per_token` (int8_sq) the activation scale is dynamic: there is no activation_scaling_factor."""
    w = module.weight.detach().float()
    weight, w_scale = _quantize_weight(algo, w, _amax(module.weight_quantizer), group)
    out = {f"{prefix}.weight": weight, f"{prefix}.weights_scaling_factor": w_scale.contiguous()}
    inq = module.input_quantizer
    if algo in (QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ):
        pre = getattr(inq, "pre_quant_scale", None)
        pre = torch.ones(w.shape[1]) if pre is None else pre.detach().float().reshape(w.shape[1])
        out[f"{prefix}.prequant_scaling_factor"] = pre.contiguous()
    if algo == QuantAlgo.FP8 or (algo == QuantAlgo.INT8_SQ and not per_token):
        out[f"{prefix}.activation_scaling_factor"] = _per_tensor_scale(
            _amax(inq), FP8_E4M3_MAX if algo == QuantAlgo.FP8 else INT8_MAX)
    with torch.no_grad():
        simulated = module.weight_quantizer(module.weight).detach().float()
    ours = dequantize_weight(algo, weight, w_scale, group)
    if not torch.allclose(ours, simulated, rtol=1e-5, atol=1e-7):
        err = (ours - simulated).abs().max().item()
        raise TrtbuildError(f"internal error: the exported {prefix} differs from modelopt's simulated weight by "
                            f"{err:.3g}; this modelopt version quantizes differently than trtbuild expects.")
    return out


def export_weight_only_int8(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """int8_wo (`--lm-head-qformat`): int8 weights, one scale per output channel = max |row| / 127 (max calibration
    needs no data), rounded as modelopt rounds int8 weights. The module's weight becomes the dequantized one in place,
    so the simulated model stays exactly what the checkpoint holds."""
    w = module.weight.detach().float()
    weight, scale = _quantize_weight(QuantAlgo.INT8_SQ, w, w.abs().amax(dim=1), group=0)
    with torch.no_grad():
        module.weight.copy_(dequantize_weight(QuantAlgo.INT8_WO, weight, scale).to(module.weight.dtype))
    return {f"{prefix}.weight": weight, f"{prefix}.weights_scaling_factor": scale.contiguous()}


def export_kv_scales(model: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """transformer.layers.{i}.attention.kv_cache_scaling_factor = [k scale, v scale] (amax / 448 or / 127)."""
    out = {}
    for i, block in enumerate(model.get_submodule("model.layers")):
        attn = block.self_attn
        scales = [_per_tensor_scale(_amax(getattr(attn, q)), kv_max(kind)) for q in ("k_bmm_quantizer",
                                                                                    "v_bmm_quantizer")]
        out[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.stack(scales)
    return out


def export_quantized(model: torch.nn.Module, algo: str, quantized: dict[str, str], group: int,
                     kv_cache_qformat: str | None, per_token: bool = False) -> dict[str, torch.Tensor]:
    """All quantized tensors of the checkpoint: every quantized linear's weight and scales, and the KV scales."""
    out: dict[str, torch.Tensor] = {}
    for prefix, name in quantized.items():
        out.update(export_linear(algo, prefix, model.get_submodule(name), group, per_token))
    if kv_cache_qformat is not None:
        out.update(export_kv_scales(model, kv_cache_qformat))
    return out
