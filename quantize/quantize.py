"""`trtbuild quantize`: HF folder / GGUF / checkpoint -> calibrated with nvidia-modelopt -> quantized checkpoint."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from trtbuild.builder.convert.checkpoint import (
    CONFIG_FILE,
    expected_tensors,
    prepare_output_dir,
    remove_partial_output,
    save_rank,
)
from trtbuild.builder.convert.convert import to_checkpoint_tensors
from trtbuild.builder.convert.names import linear_prefixes
from trtbuild.builder.convert.sharding import check_mapping, shard_for_rank
from trtbuild.configs import Mapping, ModelConfig, QuantConfig
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.quantization import QuantAlgo
from trtbuild.quantize.options import QuantizeOptions

log = logging.getLogger(__name__)
CALIB_TOKENS_PER_BATCH = 4096


@dataclass
class QuantizeResult:
    config: ModelConfig  # what config.json says
    model: torch.nn.Module  # modelopt's simulated-quantization model the checkpoint was exported from
    quantized: list[str]  # checkpoint prefixes of the quantized linears
    excluded: list[str]  # checkpoint prefixes kept in the checkpoint dtype
    calib_shape: tuple[int, int]  # (samples, tokens per sample)
    seconds: dict[str, float]

    def summary(self) -> str:
        """One line: the formats, the scales, what was quantized and the calibration."""
        q, dtype = self.config.quantization, self.config.dtype
        group = f" (group {q.group_size})" if q.group_size else ""
        alpha = (f" (alpha {q.smoothquant_alpha}{', per-token activations' if q.per_token_activations else ''})"
                 if q.smoothquant_alpha is not None else "")
        head = f", lm_head {q.lm_head_quant_algo}" if q.lm_head_quant_algo else ""
        kept = sum(q.algo_of(p) is None for p in self.excluded)
        weights = f"{q.quant_algo}{group}{alpha}, {'shared' if q.shared_input_scales else 'per-linear'} input " \
            f"scales" if q.quant_algo else "weights as they are"
        return (f"{weights}, KV cache {q.kv_cache_quant_algo or dtype}, {len(self.quantized)} linears quantized, "
                f"{kept} kept in {dtype}{head}, calibrated on {self.calib_shape[0]} x {self.calib_shape[1]} tokens in "
                f"{self.seconds['calibrate']:.1f} s, {self.config.mapping.world_size} rank(s)")


def split_linears(config: ModelConfig) -> tuple[list[str], list[str]]:
    """(quantized, excluded) linear prefixes; warns about each exclude pattern that matches nothing."""
    prefixes = linear_prefixes(range(config.num_hidden_layers), last_stage=True, gated=config.gated_mlp)
    q = config.quantization
    for pattern in q.exclude_modules:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            log.warning("--exclude %r matches no linear (they are named like lm_head, transformer.layers.0.attention."
                        "q, transformer.layers.0.mlp.proj); nothing is excluded by it", pattern)
    if q.quant_algo is None:  # --qformat full_prec: the KV cache only
        return [], prefixes
    return [p for p in prefixes if not q.is_excluded(p)], [p for p in prefixes if q.is_excluded(p)]


def in_features_of(config: ModelConfig, prefix: str) -> int:
    if prefix.endswith("attention.dense"):
        return config.q_size
    return config.intermediate_size if prefix.endswith("mlp.proj") else config.hidden_size


def _with_default_group_size(config: ModelConfig, quantized: Sequence[str]) -> ModelConfig:
    """int4_awq without awq_block_size: the largest of 128/64/32 that divides every quantized linear."""
    from trtbuild.builder.convert.weight_only import default_group_size

    features = {in_features_of(config, p) for p in quantized}
    group = default_group_size(features)
    if group is None:
        raise ConfigError("awq_block_size", f"is not given, and no AWQ block size of 128, 64 or 32 divides the input "
                                            f"features {sorted(features)} of the quantized linears; pass 16, or "
                                            "exclude those linears.")
    log.warning("int4_awq block size %d: the largest of 128/64/32 dividing the input features of every quantized "
                "linear (%s); --awq-block-size sets another", group, ", ".join(map(str, sorted(features))))
    return dataclasses.replace(config, quantization=dataclasses.replace(config.quantization, group_size=group))


def check_group_size(config: ModelConfig, quantized: Sequence[str]) -> None:
    """int4: the group size must divide the input features of every quantized linear."""
    group = config.quantization.group_size
    if group is None or not quantized:
        return
    sizes = {in_features_of(config, p): p for p in reversed(quantized)}
    bad = [(n, p) for n, p in sizes.items() if n % group]
    if bad:
        n, prefix = bad[-1]
        common = math.gcd(*sizes)
        hint = common & -common  # the largest power of two dividing every quantized linear's input features
        hint = min(hint, 256)
        fix = f"use {hint}" if hint >= 16 else "no block size from 16 to 256 fits them all"
        raise ConfigError("awq_block_size", f"{group} does not divide the {n} input features of {prefix}; {fix}, or "
                                            "exclude those linears.")


def quantize(options: QuantizeOptions) -> QuantizeResult:
    """Quantize `options.model` into a checkpoint at `options.output` (config.json written last; nothing is left on
    failure)."""
    from trtbuild.quantize.calib import read_calibration_texts

    qconfig = options.quant_config()
    texts = read_calibration_texts(options.calib_dataset)  # a bad dataset fails before anything slow
    if not options.model.exists():
        raise ConfigError("model", f"{options.model} does not exist.")
    prepare_output_dir(options.output)
    try:
        return _quantize(options, qconfig, texts)
    except BaseException:
        remove_partial_output(options.output)
        raise


def _quantize(options: QuantizeOptions, qconfig: QuantConfig, texts: list[str]) -> QuantizeResult:
    from trtbuild.builder.rope import EngineRotaryRows
    from trtbuild.quantize.awq import DEFAULT_GRID_POINTS
    from trtbuild.quantize.calib import calibration_samples
    from trtbuild.quantize.calibrate import (
        calibrate,
        check_calibrated,
        linear_modules,
        mtq_config,
        per_token_inputs,
        unify_shared_inputs,
    )
    from trtbuild.quantize.export import export_quantized, export_weight_only_int8
    from trtbuild.quantize.source import EngineRotaryEmbedding, build_torch_model, read_source

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    output = options.output
    source = read_source(options.model)
    config = model_config_from_hf(source.hf_config, options.dtype)
    if config.is_moe:
        raise ConfigError("model", f"{config.architecture} is a mixture of experts, which `trtbuild quantize` does "
                                   "not calibrate yet; build it with `trtbuild convert` (a GGUF file keeps its "
                                   "attention's quantization).")
    if config.recurrent_layers:
        raise ConfigError("model", f"{config.architecture}'s recurrent layers are not calibrated by `trtbuild "
                                   "quantize` yet; convert it with `trtbuild convert` (--weight-only int8|int4, or "
                                   "a quantized GGUF file kept as it is).")
    config = dataclasses.replace(config, mapping=Mapping(tp_size=options.tp_size, pp_size=options.pp_size),
                                 quantization=qconfig)
    quantized, excluded = split_linears(config)
    if not quantized and qconfig.quant_algo:
        raise ConfigError("exclude", f"{' '.join(qconfig.exclude_modules)} matches every linear: nothing to quantize.")
    if qconfig.quant_algo == QuantAlgo.INT4_AWQ and qconfig.group_size is None:
        config = _with_default_group_size(config, quantized)
        qconfig = config.quantization
    check_group_size(config, quantized)
    check_mapping(config, config.mapping)
    # The unquantized tensors, exactly what `trtbuild convert` writes; quantized linears are replaced below.
    tensors = to_checkpoint_tensors(source.hf_tensors, dataclasses.replace(config, quantization=QuantConfig()))
    own_head = qconfig.lm_head_quant_algo is not None
    for prefix in [*quantized, *(["lm_head"] if own_head else [])]:
        tensors.pop(f"{prefix}.weight", None)  # replaced at export; the source copy is freed once loaded
    # Calibrate the model the checkpoint describes: weights rounded to its dtype (computed in fp32).
    ckpt_dtype = getattr(torch, config.dtype)
    source.hf_tensors = {n: t.to(ckpt_dtype) if t.is_floating_point() else t for n, t in source.hf_tensors.items()}
    source.write_tokenizer(output)
    samples = calibration_samples(texts, output if source.kind == "gguf" else source.path, config.vocab_size,
                                  options.calib_size, options.calib_max_seq_len)
    torch_model = build_torch_model(source, untie="lm_head" in quantized or own_head)
    del source
    seconds["load"] = time.perf_counter() - start

    start = time.perf_counter()
    modules = linear_modules(torch_model, config)
    hf_quantized = {p: modules[p] for p in quantized}
    mcfg = mtq_config(qconfig.quant_algo or "", qconfig.kv_cache_quant_algo, qconfig.weight_group_size,
                      [modules[p] for p in excluded], quantize_lm_head="lm_head" in hf_quantized,
                      smoothquant_alpha=qconfig.smoothquant_alpha)
    batch = max(1, CALIB_TOKENS_PER_BATCH // samples.shape[1])
    torch_model = calibrate(torch_model, mcfg, samples, batch, call_lm_head="lm_head" in hf_quantized,
                            awq_grid=options.awq_grid or DEFAULT_GRID_POINTS)
    check_calibrated(torch_model, hf_quantized, qconfig.kv_cache_quant_algo is not None)
    if qconfig.shared_input_scales:
        unify_shared_inputs(torch_model, set(hf_quantized.values()))
    if qconfig.per_token_activations:
        per_token_inputs(torch_model, hf_quantized.values())
    seconds["calibrate"] = time.perf_counter() - start

    start = time.perf_counter()
    exported = export_quantized(torch_model, qconfig.quant_algo or "", hf_quantized, qconfig.weight_group_size,
                                qconfig.kv_cache_quant_algo, qconfig.per_token_activations)
    if isinstance(getattr(torch_model.model, "rotary_emb", None), EngineRotaryEmbedding):
        exported = dict(EngineRotaryRows(exported, config, inverse=True))  # its q / k rows were the engine's
    tensors.update(exported)
    if own_head:
        tensors.update(export_weight_only_int8("lm_head", torch_model.get_submodule(modules["lm_head"])))
    needed = expected_tensors(config, range(config.num_hidden_layers), first_stage=True, last_stage=True)
    if set(tensors) != set(needed):
        raise TrtbuildError(f"internal error: exported tensors differ from the format ({set(tensors) ^ set(needed)})")
    tensors = {n: tensors[n] for n in needed}
    for rank in tqdm(range(config.mapping.world_size), desc="writing shards", unit="rank", leave=False):
        save_rank(output, rank, shard_for_rank(tensors, config, config.mapping, rank))
    config.save(output / CONFIG_FILE)  # written last: a folder with config.json is a complete checkpoint
    seconds["export"] = time.perf_counter() - start
    return QuantizeResult(config, torch_model, quantized, excluded, tuple(samples.shape), seconds)
