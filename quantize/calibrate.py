"""Calibration with nvidia-modelopt: the mtq config of a format, the calibration loop, and the optional grouping step
that makes linears sharing an input share their input scales (so that an engine may fuse them into one GEMM)."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from trtbuild.builder.convert.names import hf_to_checkpoint_name
from trtbuild.configs import ModelConfig
from trtbuild.errors import TrtbuildError
from trtbuild.quantization import KVCacheQuantAlgo, QuantAlgo
from trtbuild.quantize.awq import DEFAULT_GRID_POINTS, AWQLayerCalibrator, alpha_grid
from trtbuild.quantize.layerwise import CalibLayer, ForwardLoop, Progress, calibrate_layerwise, decoder_layers

log = logging.getLogger(__name__)

MTQ_CONFIGS = {QuantAlgo.FP8: "FP8_DEFAULT_CFG", QuantAlgo.INT4_AWQ: "INT4_AWQ_CFG",
               QuantAlgo.INT8_SQ: "INT8_SMOOTHQUANT_CFG"}
_KV_QUANTIZERS = "*[kv]_bmm_quantizer"
# Linears of one layer that read the same tensor (HF names relative to `model.layers.{i}.`).
_SHARED_INPUT_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def import_mtq() -> Any:
    """modelopt.torch.quantization, without the warnings it prints about untested transformers versions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.quantization as mtq
    return mtq


def linear_modules(model: torch.nn.Module, config: ModelConfig) -> dict[str, str]:
    """{checkpoint prefix: HF module name} of every linear of `config`'s model the checkpoint format can quantize."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or hasattr(module, "weight_quantizer"):
            prefix = hf_to_checkpoint_name(f"{name}.weight", config)
            if prefix is not None and prefix.endswith(".weight"):
                out[prefix.removesuffix(".weight")] = name
    return out


def mtq_config(qformat: str, kv_cache_qformat: str | None, block_size: int, excluded_modules: Sequence[str],
               quantize_lm_head: bool, smoothquant_alpha: float | None = None) -> dict[str, Any]:
    """modelopt's config for `qformat`, with the AWQ block size, the SmoothQuant alpha, the KV-cache quantizers and
    the exclusions."""
    mtq = import_mtq()
    # NOTE: no weight format (--qformat full_prec): every quantizer off but the KV cache's, calibrated by max
    no_weights = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    config = copy.deepcopy(getattr(mtq, MTQ_CONFIGS[qformat]) if qformat else no_weights)
    if qformat == QuantAlgo.INT8_SQ and smoothquant_alpha is not None:
        config["algorithm"] = {"method": "smoothquant", "alpha": float(smoothquant_alpha)}
    entries: list[dict[str, Any]] = config["quant_cfg"]
    # NOTE: modelopt quantizes nn.LayerNorm's input too (StarCoder 2's norms); engines quantize linears' inputs only
    entries.append({"quantizer_name": "*", "parent_class": "nn.LayerNorm", "enable": False})
    if quantize_lm_head:
        entries[:] = [e for e in entries if e.get("quantizer_name") != "*lm_head*"]
    if qformat == QuantAlgo.INT4_AWQ:
        for e in entries:
            if e.get("quantizer_name") == "*weight_quantizer":
                e["cfg"]["block_sizes"][-1] = block_size
    if kv_cache_qformat is not None:
        kv = {"num_bits": (4, 3), "axis": None} if kv_cache_qformat == KVCacheQuantAlgo.FP8 else {
            "num_bits": 8, "axis": None, "narrow_range": True}
        entries.append({"quantizer_name": _KV_QUANTIZERS, "cfg": kv})
    for name in excluded_modules:
        entries.append({"quantizer_name": f"{name}.*", "enable": False})
    return config


def modelopt_calib_layer(algorithm: str | dict[str, Any] | None) -> CalibLayer:
    """modelopt's calibration function for `algorithm` (a config's "algorithm" entry) as a `calib_layer`, called as
    modelopt's own layerwise calibration calls it (`func(layer, forward_loop, **the algorithm's options)`)."""
    from modelopt.torch.quantization.mode import BaseCalibrateModeDescriptor, CalibrateModeRegistry

    algo = dict(algorithm) if isinstance(algorithm, dict) else {"method": algorithm}
    descriptor = CalibrateModeRegistry[BaseCalibrateModeDescriptor._get_mode_name(algo["method"], check=True)]
    kwargs = descriptor.config_class(**algo).model_dump()
    method = kwargs.pop("method")
    for key in ("layerwise", "moe_calib_experts_ratio"):
        kwargs.pop(key, None)
    if "awq" in method:
        kwargs["algorithm"] = method
    func = type(descriptor)._calib_func

    def calib_layer(module: torch.nn.Module, forward_loop: ForwardLoop) -> None:
        func(module, forward_loop=forward_loop, **kwargs)
    return calib_layer


def _activation_quantizers(model: torch.nn.Module) -> bool:
    """Whether any quantizer other than the weights' is on (e.g. the KV cache's)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    return any(isinstance(m, TensorQuantizer) and m.is_enabled and not name.endswith("weight_quantizer")
               for name, m in model.named_modules())


def calibrate(model: torch.nn.Module, config: dict[str, Any], samples: torch.Tensor, batch_size: int,
              call_lm_head: bool, awq_grid: int = DEFAULT_GRID_POINTS, progress: Progress | None = None
              ) -> torch.nn.Module:
    """Insert modelopt's quantizers per `config` and calibrate them over `samples` [n, seq] in batches, one decoder
    layer at a time (`layerwise.py`); `progress(done, total)` after each layer (default: a progress bar).

    int4 AWQ (`awq_lite`) runs our equivalent of modelopt's search (`awq.py`) with `awq_grid` alphas (modelopt's
    alpha_step 0.1 is 11); other algorithms run modelopt's own calibration function on each layer."""
    mtq = import_mtq()
    batches = list(samples.split(batch_size))
    algorithm = config.get("algorithm")
    method = algorithm.get("method") if isinstance(algorithm, dict) else algorithm
    num_layers = len(decoder_layers(model))
    bar = None
    if progress is None:
        bar = tqdm(total=num_layers, desc=f"calibrating ({method})", unit="layer", leave=False)

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

    start = time.perf_counter()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()) as chatter:
            warnings.simplefilter("ignore")
            model = mtq.quantize(model, {**config, "algorithm": None})  # quantizers only, nothing calibrated
            awq = AWQLayerCalibrator(alpha_grid(awq_grid), _activation_quantizers(model)) if method == "awq_lite" \
                else None
            calib_layer = awq or modelopt_calib_layer(algorithm)
            calibrate_layerwise(model, batches, calib_layer, calib_lm_head=call_lm_head, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    lines = chatter.getvalue().splitlines()  # per layer, so mostly the same few lines
    for line in dict.fromkeys(lines):
        count = lines.count(line)
        log.info("modelopt: %s%s", line, f" ({count} times)" if count > 1 else "")
    if awq is not None:
        total = time.perf_counter() - start
        log.info("AWQ over %d layers: %.1f s layer forwards and statistics, %.1f s scale search (%d alphas), "
                 "%.1f s other", num_layers, awq.seconds["forward"], awq.seconds["search"], awq_grid,
                 total - awq.seconds["forward"] - awq.seconds["search"])
    return model


def unify_shared_inputs(model: torch.nn.Module, quantized: set[str]) -> None:
    """Make q/k/v (and gate/up) of each layer share prequant and activation scales, and fp8 weight scales
    (`trtbuild quantize --fuse-shared-scales`; without it every linear keeps its own calibrated scales).

    This is modelopt's own export step (`preprocess_linear_fusion`: average the pre-quant scales, fold the change
    into the weights and re-calibrate them, take the max of the amaxes); the simulated model is updated in place,
    so it stays exactly what the checkpoint holds.
    """
    from modelopt.torch.export.quant_utils import preprocess_linear_fusion

    for layer, block in enumerate(model.get_submodule("model.layers")):
        for group in _SHARED_INPUT_GROUPS:
            names = [f"model.layers.{layer}.{g}" for g in group]
            modules = [block.get_submodule(g) for g, n in zip(group, names, strict=True) if n in quantized]
            if len(modules) > 1:
                with torch.no_grad():
                    preprocess_linear_fusion(modules)


PER_TOKEN_INT8 = {"num_bits": 8, "axis": None, "type": "dynamic", "block_sizes": {-1: None}}


def per_token_inputs(model: torch.nn.Module, names: Iterable[str]) -> None:
    """Switch the input quantizers of the linears `names` to modelopt's dynamic per-token int8 quantization (amax of
    each token at run time; the SmoothQuant pre-quant scale stays). The smoothing itself was calibrated with static
    scales; only how the smoothed activation is rounded changes."""
    for name in names:
        quantizer = model.get_submodule(name).input_quantizer
        quantizer.set_from_attribute_config(dict(PER_TOKEN_INT8))
        quantizer.reset_amax()


def check_calibrated(model: torch.nn.Module, quantized: dict[str, str], kv_cache: bool) -> None:
    """Every quantized linear (and KV quantizer) must have seen calibration data."""
    for prefix, name in quantized.items():
        module = model.get_submodule(name)
        if getattr(module.weight_quantizer, "amax", None) is None:
            raise TrtbuildError(f"modelopt did not calibrate {name} ({prefix}); is the model supported?")
    if kv_cache:
        for layer, block in enumerate(model.get_submodule("model.layers")):
            for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
                if getattr(getattr(block.self_attn, q, None), "amax", None) is None:
                    raise TrtbuildError(f"modelopt did not calibrate the KV cache of layer {layer}; this attention "
                                        "implementation is not supported for KV-cache quantization.")
