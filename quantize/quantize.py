"""`trtbuild quantize`: HF folder / GGUF / checkpoint -> calibrated with nvidia-modelopt -> quantized checkpoint."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
from trtbuild.configs.model_config import (
    KV_CACHE_QUANT_ALGOS,
    LM_HEAD_QUANT_ALGOS,
    QUANT_ALGOS,
    model_config_from_hf,
)
from trtbuild.errors import TrtbuildError

log = logging.getLogger(__name__)
CALIB_TOKENS_PER_BATCH = 4096
# SmoothQuant migration strength for int8_sq when --smoothquant-alpha is not given, by per-token activations or not:
# the most accurate of those measured on SmolLM2-135M (docs/quantization-results.md). Static per-tensor activation
# scales need the outliers moved into the weights; per-token scales absorb them and keep the weights easy.
DEFAULT_SMOOTHQUANT_ALPHA = {False: 0.7, True: 0.5}


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
        return (f"{q.quant_algo}{group}{alpha}, {'shared' if q.shared_input_scales else 'per-linear'} input scales, "
                f"KV cache {q.kv_cache_quant_algo or dtype}, {len(self.quantized)} linears quantized, {kept} kept in "
                f"{dtype}{head}, calibrated on {self.calib_shape[0]} x {self.calib_shape[1]} tokens in "
                f"{self.seconds['calibrate']:.1f} s, {self.config.mapping.world_size} rank(s)")


def quant_config(qformat: str, kv_cache_dtype: str | None, awq_block_size: int | None, exclude: Sequence[str],
                 shared_input_scales: bool = False, smoothquant_alpha: float | None = None,
                 per_token_activations: bool = False, lm_head_qformat: str | None = None) -> QuantConfig:
    if qformat not in QUANT_ALGOS:
        raise TrtbuildError(f"--qformat {qformat!r} is not one of {', '.join(QUANT_ALGOS)}.")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_QUANT_ALGOS:
        raise TrtbuildError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_QUANT_ALGOS)}.")
    if qformat == "int4_awq" and awq_block_size is not None and (
            not 16 <= awq_block_size <= 256 or awq_block_size & (awq_block_size - 1)):
        raise TrtbuildError(f"--awq-block-size {awq_block_size} must be a power of two from 16 to 256 (what ONNX "
                            "Runtime's MatMulNBits runs), e.g. 64 or 128.")
    if lm_head_qformat is not None:
        if lm_head_qformat not in LM_HEAD_QUANT_ALGOS:
            raise TrtbuildError(f"--lm-head-qformat {lm_head_qformat!r} is not one of "
                                f"{', '.join(LM_HEAD_QUANT_ALGOS)}.")
        if not any(fnmatch.fnmatchcase("lm_head", p) for p in exclude):
            raise TrtbuildError(f"--lm-head-qformat {lm_head_qformat} gives lm_head its own format, but --exclude "
                                f"{' '.join(exclude) or '(none)'} leaves lm_head to --qformat {qformat}; add "
                                "--exclude lm_head.")
    if per_token_activations and qformat != "int8_sq":
        raise TrtbuildError(f"--per-token-activations applies to --qformat int8_sq only, not {qformat}.")
    if smoothquant_alpha is not None:
        if qformat != "int8_sq":
            raise TrtbuildError(f"--smoothquant-alpha applies to --qformat int8_sq only, not {qformat}.")
        if not 0.0 <= smoothquant_alpha <= 1.0:  # also refuses nan
            raise TrtbuildError(f"--smoothquant-alpha {smoothquant_alpha} must be in [0, 1] (0: no migration to "
                                "the weights, 1: all of it).")
    elif qformat == "int8_sq":
        smoothquant_alpha = DEFAULT_SMOOTHQUANT_ALPHA[bool(per_token_activations)]
    return QuantConfig(quant_algo=qformat, kv_cache_quant_algo=kv_cache_dtype,
                       group_size=awq_block_size if qformat == "int4_awq" else None,
                       pre_quant_scale=qformat in ("int4_awq", "int8_sq"), exclude_modules=tuple(exclude),
                       shared_input_scales=bool(shared_input_scales),
                       smoothquant_alpha=None if smoothquant_alpha is None else float(smoothquant_alpha),
                       per_token_activations=bool(per_token_activations), lm_head_quant_algo=lm_head_qformat)


def split_linears(config: ModelConfig) -> tuple[list[str], list[str]]:
    """(quantized, excluded) linear prefixes; warns about each exclude pattern that matches nothing."""
    prefixes = linear_prefixes(range(config.num_hidden_layers), last_stage=True)
    q = config.quantization
    for pattern in q.exclude_modules:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            log.warning("--exclude %r matches no linear (they are named like lm_head, transformer.layers.0.attention."
                        "q, transformer.layers.0.mlp.proj); nothing is excluded by it", pattern)
    return [p for p in prefixes if not q.is_excluded(p)], [p for p in prefixes if q.is_excluded(p)]


def in_features_of(config: ModelConfig, prefix: str) -> int:
    if prefix.endswith("attention.dense"):
        return config.q_size
    return config.intermediate_size if prefix.endswith("mlp.proj") else config.hidden_size


def _with_default_group_size(config: ModelConfig, quantized: Sequence[str]) -> ModelConfig:
    """int4_awq without --awq-block-size: the largest of 128/64/32 that divides every quantized linear."""
    from trtbuild.quantize.weight_only import default_group_size

    features = {in_features_of(config, p) for p in quantized}
    group = default_group_size(features)
    if group is None:
        raise TrtbuildError(f"no AWQ block size of 128, 64 or 32 divides the input features {sorted(features)} of "
                            "the quantized linears; pass --awq-block-size 16, or exclude those linears.")
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
        fix = f"use --awq-block-size {hint}" if hint >= 16 else "no block size from 16 to 256 fits them all"
        raise TrtbuildError(f"--awq-block-size {group} does not divide the {n} input features of {prefix}; {fix}, "
                            "or exclude those linears with --exclude.")


def quantize(model: Path, output: Path, qformat: str, kv_cache_dtype: str | None = None,
             calib_dataset: Path | None = None, calib_size: int = 512, calib_max_seq_len: int = 512,
             awq_block_size: int | None = None, exclude: Sequence[str] = ("lm_head",), dtype: str = "auto",
             tp_size: int = 1, pp_size: int = 1, shared_input_scales: bool = False,
             smoothquant_alpha: float | None = None, per_token_activations: bool = False,
             lm_head_qformat: str | None = None, awq_grid: int | None = None) -> QuantizeResult:
    """Quantize `model` into a checkpoint at `output` (config.json written last; nothing is left on failure).

    `shared_input_scales`: q/k/v and gate/up of each layer share their input (and fp8 weight) scales, so engines may
    fuse them (costs accuracy); otherwise each linear keeps its own. `smoothquant_alpha` (int8_sq only, in [0, 1]):
    SmoothQuant's migration strength, DEFAULT_SMOOTHQUANT_ALPHA when None. `per_token_activations` (int8_sq only):
    quantize activations per token with a dynamic scale instead of a static calibrated one. `lm_head_qformat`
    (int8_wo): lm_head, excluded from `qformat`, gets int8 weights with per-output-channel scales. `awq_grid`
    (int4_awq only): alphas searched per linear, DEFAULT_GRID_POINTS (modelopt's awq_lite grid) when None."""
    from trtbuild.quantize.calib import read_calibration_texts

    model, output = Path(model), Path(output)
    qconfig = quant_config(qformat, kv_cache_dtype, awq_block_size, exclude, shared_input_scales, smoothquant_alpha,
                           per_token_activations, lm_head_qformat)
    if calib_size < 1 or calib_max_seq_len < 1:
        raise TrtbuildError("--calib-size and --calib-max-seq-len must be at least 1.")
    if awq_grid is not None and qformat != "int4_awq":
        raise TrtbuildError(f"--awq-grid applies to --qformat int4_awq only, not {qformat}.")
    if awq_grid is not None and awq_grid < 2:
        raise TrtbuildError(f"--awq-grid {awq_grid} must be at least 2 (alpha 0 and 1).")
    texts = read_calibration_texts(calib_dataset)  # a bad dataset fails before anything slow
    if not model.exists():
        raise TrtbuildError(f"--model {model} does not exist.")
    prepare_output_dir(output)
    try:
        return _quantize(model, output, qconfig, texts, calib_size, calib_max_seq_len, dtype, tp_size, pp_size,
                         awq_grid)
    except BaseException:
        remove_partial_output(output)
        raise


def _quantize(model_path: Path, output: Path, qconfig: QuantConfig, texts: list[str], calib_size: int,
              calib_max_seq_len: int, dtype: str, tp_size: int, pp_size: int, awq_grid: int | None
              ) -> QuantizeResult:
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
    from trtbuild.quantize.source import build_torch_model, read_source

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    source = read_source(model_path)
    config = model_config_from_hf(source.hf_config, dtype)
    config = dataclasses.replace(config, mapping=Mapping(tp_size=tp_size, pp_size=pp_size), quantization=qconfig)
    quantized, excluded = split_linears(config)
    if not quantized:
        raise TrtbuildError(f"--exclude {' '.join(qconfig.exclude_modules)} matches every linear: nothing to quantize.")
    if qconfig.quant_algo == "int4_awq" and qconfig.group_size is None:
        config = _with_default_group_size(config, quantized)
        qconfig = config.quantization
    check_group_size(config, quantized)
    check_mapping(config, config.mapping)
    if qconfig.per_token_activations and tp_size > 1:
        raise TrtbuildError("--per-token-activations needs --tp-size 1: a token's scale is the max over all input "
                            "features, which a row-parallel rank does not hold.")
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
                                  calib_size, calib_max_seq_len)
    torch_model = build_torch_model(source, untie="lm_head" in quantized or own_head)
    del source
    seconds["load"] = time.perf_counter() - start

    start = time.perf_counter()
    modules = linear_modules(torch_model)
    hf_quantized = {p: modules[p] for p in quantized}
    mcfg = mtq_config(qconfig.quant_algo or "", qconfig.kv_cache_quant_algo, qconfig.weight_group_size,
                      [modules[p] for p in excluded], quantize_lm_head="lm_head" in hf_quantized,
                      smoothquant_alpha=qconfig.smoothquant_alpha)
    batch = max(1, CALIB_TOKENS_PER_BATCH // samples.shape[1])
    torch_model = calibrate(torch_model, mcfg, samples, batch, call_lm_head="lm_head" in hf_quantized,
                            awq_grid=awq_grid or DEFAULT_GRID_POINTS)
    check_calibrated(torch_model, hf_quantized, qconfig.kv_cache_quant_algo is not None)
    if qconfig.shared_input_scales:
        unify_shared_inputs(torch_model, set(hf_quantized.values()))
    if qconfig.per_token_activations:
        per_token_inputs(torch_model, hf_quantized.values())
    seconds["calibrate"] = time.perf_counter() - start

    start = time.perf_counter()
    tensors.update(export_quantized(torch_model, qconfig.quant_algo or "", hf_quantized, qconfig.weight_group_size,
                                    qconfig.kv_cache_quant_algo, qconfig.per_token_activations))
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
