"""`trtbuild build`: checkpoint -> network -> fusion passes -> target lowering -> engine directory."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
from tqdm import tqdm

from trtbuild.builder.autotune import Timer
from trtbuild.builder.buildable import check_buildable
from trtbuild.builder.convert.checkpoint import (
    CONFIG_FILE,
    copy_tokenizer_files,
    open_checkpoint,
    prepare_output_dir,
    remove_partial_output,
)
from trtbuild.builder.engine_dir import (
    cpu_features,
    cpu_fingerprint,
    cpu_rank_files,
    write_engine_config,
)
from trtbuild.builder.lora import read_adapters
from trtbuild.builder.lora_slots import read_slot_tables
from trtbuild.builder.network import build_network, engine_inputs, engine_outputs
from trtbuild.builder.weight_file import StagingWeights, save_engine_files
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.quantization import KVPoolDtype

if TYPE_CHECKING:
    from trtbuild.builder.dense_linears import DenseLinears

log = logging.getLogger(__name__)


def default_build_config(config: ModelConfig, **overrides) -> BuildConfig:
    """Build limits with the model's context length (at most 4096) as max_seq_len, and `default_kv_pool_dtype`,
    unless given. NOTE: the tensorrt target's default stays within a sliding window, which its plugins do not apply
    (a max_seq_len asked for past it is refused there)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    limits = [config.max_position_embeddings, 4096]
    if config.sliding_window and overrides.get("target") == "tensorrt":
        limits.append(config.sliding_window)
    overrides.setdefault("max_seq_len", min(limits))
    if "kv_pool_dtype" not in overrides:
        overrides["kv_pool_dtype"] = default_kv_pool_dtype(config, overrides.get("target", "cpu"))
    return BuildConfig(**overrides)


def default_kv_pool_dtype(config: ModelConfig, target: str) -> str:
    """float16 (as llama.cpp's default KV cache, and vLLM's for a 16-bit model) where the weights are 16-bit or
    quantized, the KV cache is not, and the native attention reads a float16 pool on this machine (without it, the
    standard-op lowering would cast every row it gathers); float32 otherwise, and always on the GPU targets, whose
    pool has the compute dtype."""
    from trtbuild import cpu_ops
    from trtbuild.builder.lower_cpu import float16_pool_unreadable

    q = config.quantization
    if target != "cpu" or q.kv_cache_quant_algo or (config.dtype == "float32" and not q.quant_algo):
        return KVPoolDtype.FLOAT32.value
    why_not = float16_pool_unreadable({config.head_size}) or cpu_ops.unavailable_reason()
    if why_not is not None:
        log.info("kv_pool_dtype: float32 (%s)", why_not)
        return KVPoolDtype.FLOAT32.value
    log.info("kv_pool_dtype: float16 (%s weights; --kv-pool-dtype float32 keeps the KV cache exact)",
             q.quant_algo or config.dtype)
    return KVPoolDtype.FLOAT16.value


def lower_for_target(model: onnx.ModelProto, build: BuildConfig) -> list[str]:
    """Fusion passes (unless disabled), the quantized linears' lowering, the accept op's and new_kv's float16 cast
    (builder/new_kv_dtype.py), in place; returns the passes applied. The attention and the native linears are
    lowered last (TacticLowering), as the tactics say."""
    from trtbuild.builder.lower_accept import lower_speculative_accept
    from trtbuild.builder.new_kv_dtype import new_kv_in_pool_dtype
    from trtbuild.builder.passes import run_passes
    from trtbuild.builder.passes.lora import hoist_lora_adds
    from trtbuild.builder.passes.lower_quant_cpu import lower_quantized_linears, u8s8_exact

    applied = []
    if build.fuse:
        counts = run_passes(model, build.target)
        applied = [f"{name}:{n}" for name, n in counts.items()]
    # always: the engine must run low-bit kernels, not dequantized copies
    quantized = lower_quantized_linears(model, build.int4_accuracy_level, u8s8_exact(cpu_features()))
    if quantized:
        applied.append(f"lower_quantized_linears:{quantized}")
    if hoisted := hoist_lora_adds(model):  # the quantized siblings' Splits that lower_quantized_linears made
        applied.append(f"hoist_lora_adds:{hoisted}")
    accept = lower_speculative_accept(model)
    if accept:
        applied.append(f"lower_speculative_accept:{accept}")
    if casts := new_kv_in_pool_dtype(model):
        applied.append(f"new_kv_float16:{casts}")
    return applied


class TacticLowering:
    """The last CPU lowering, as a build's tactics say: its attention variant, then its quantized linears (native:
    builder/native_linears.py) and its unquantized ones (native: builder/dense_linears.py, with the LoRA branches:
    builder/native_lora.py; either takes its bias add in: builder/linear_bias.py), and, with any native tactic, the
    MLP's SwiGLU (builder/native_swiglu.py). Each weight is packed once however many candidate graphs the autotuner
    lowers."""

    def __init__(self) -> None:
        from trtbuild import cpu_ops
        from trtbuild.builder.dense_linears import DenseLinears
        from trtbuild.builder.native_linears import NativeLinears
        from trtbuild.builder.passes.lower_quant_cpu import FloatZeroPoints

        self.native_linears = NativeLinears(cpu_ops.high_bits_layout())
        self.float_zero_points = FloatZeroPoints()
        # NOTE: DenseMatMul's AVX2 tiles beat MLAS's SGEMM only where they read 16-bit weights (dense_linears.py);
        # LoraAdd runs on AVX-512 or AVX2, whichever linears its branches sit beside
        self.dense_linears = DenseLinears(sixteen_bit_only=not cpu_ops.has_avx512())
        self.lora_add = cpu_ops.runs_dense()

    def __call__(self, model: onnx.ModelProto, build: BuildConfig) -> list[str]:
        """Lower `model` in place; returns the native lowerings applied, as "name:count"."""
        from trtbuild.builder.linear_bias import fold_linear_biases
        from trtbuild.builder.lower_cpu import lower_paged_attention
        from trtbuild.builder.native_lora import lower_lora
        from trtbuild.builder.native_swiglu import lower_swiglu

        lower_paged_attention(model, build.attention)
        counts = {"native_linears": self.native_linears.lower(model) if build.quant_linears == "native" else 0}
        # what the native linears did not take; NOTE: before the dense linears, which then take the correction GEMMs
        counts["float_zero_points"] = self.float_zero_points.expand(model)
        # NOTE: before the dense linears, which would take the LoRA branches' MatMuls
        native_lora = build.float_linears == "native" and self.lora_add
        counts["native_lora"] = lower_lora(model) if native_lora else 0
        counts["dense_linears"] = self.dense_linears.lower(model) if build.float_linears == "native" else 0
        if counts["native_linears"] or counts["dense_linears"]:
            counts["linear_biases"] = fold_linear_biases(model)
        # NOTE: an engine with any native tactic loads the library (runtime/engine.py); one with none must not need it
        if "native" in (build.attention, build.quant_linears, build.float_linears):
            counts["native_swiglu"] = lower_swiglu(model)
        return [f"{name}:{n}" for name, n in counts.items() if n]


def attention_candidates(model: onnx.ModelProto, build: BuildConfig) -> tuple[str, ...]:
    """How this engine's attention may be computed, preferred first: the one asked for, or (auto) the native op
    where it runs here, then the standard-op lowerings. The autotuner times them all; without it the first wins."""
    from trtbuild.builder.lower_cpu import ATTENTION_VARIANTS, NATIVE, native_unavailable

    if build.attention != "auto":
        return (build.attention,)
    reason = native_unavailable(model)
    if reason is not None:
        log.info("attention: the standard-op lowering (native op unavailable: %s)", reason)
        return ATTENTION_VARIANTS
    return (NATIVE, *ATTENTION_VARIANTS)


def _native_then_ort(family: str, mode: str, problem: str | None, fallback: str) -> tuple[str, ...]:
    """The candidates of a native-or-ort tactic family whose native kernel has `problem` here (None: none)."""
    if problem is None:
        return ("native",) if mode == "native" else ("native", "ort")
    if mode == "native":
        raise ConfigError(family, f"native cannot be used: {problem}. Use --{family.replace('_', '-')} ort.")
    log.info("%s: %s (%s)", family, fallback, problem)
    return ("ort",)


def quant_linear_candidates(model: onnx.ModelProto, build: BuildConfig) -> tuple[str, ...]:
    """How this engine's 4/8-bit linears may be computed, preferred first (builder/native_linears.py): the one asked
    for, or (auto) native where it applies and runs here, then MatMulNBits. The autotuner times them all."""
    from trtbuild.builder.native_linears import count_eligible, count_native, native_problem

    if build.quant_linears == "ort":
        return ("ort",)
    problem = ("no linear has 4/8-bit blocks of 16 or 32 (of 32 with zero points)" if not count_eligible(model)
               and not count_native(model) else native_problem(build.int4_accuracy_level))
    return _native_then_ort("quant_linears", build.quant_linears, problem, "MatMulNBits")


def float_linear_candidates(model: onnx.ModelProto, build: BuildConfig, dense: DenseLinears) -> tuple[str, ...]:
    """How this engine's unquantized linears may be computed, preferred first (builder/dense_linears.py): the one
    asked for, or (auto) native where it applies and runs here, then MatMul on float32 weights. The autotuner times
    them all."""
    from trtbuild import cpu_ops

    if build.float_linears == "ort":
        return ("ort",)
    nothing = ("no linear or embedding has 16-bit weights, the only ones this CPU's DenseMatMul (AVX2) takes"
               if dense.sixteen_bit_only else "no linear or embedding has unquantized weights")
    problem = ("this CPU has neither AVX-512 nor AVX2 with FMA and F16C" if not cpu_ops.runs_dense() else
               cpu_ops.unavailable_reason() or (nothing if not dense.count(model) else None))
    return _native_then_ort("float_linears", build.float_linears, problem, "MatMul on float32 weights")


def io_spec(model: onnx.ModelProto) -> dict:
    def describe(v: onnx.ValueInfoProto) -> dict:
        dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                "shape": dims}

    return {"inputs": [describe(v) for v in model.graph.input], "outputs": [describe(v) for v in model.graph.output]}


def build_engine(checkpoint: Path, output: Path, build: BuildConfig | None = None, timer: Timer | None = None,
                 timing_cache: Path | None = None, **build_overrides) -> Path:
    """Build an engine directory at `output` from the checkpoint at `checkpoint`. With `build.autotune` on, `timer`
    times candidate graphs (bench/autotune.py: time_graph) and `timing_cache` keeps what it measured."""
    from trtbuild.builder.autotune import TimingCache, tune

    checkpoint, output = Path(checkpoint), Path(output)
    config = ModelConfig.load(checkpoint / CONFIG_FILE) if checkpoint.is_dir() else None
    if config is None:
        raise TrtbuildError(f"checkpoint folder {checkpoint} does not exist; create it with `trtbuild convert`.")
    build = build or default_build_config(config, **build_overrides)
    check_buildable(config, build)
    if build.target == "cpu":
        from trtbuild.builder.moe_experts import resolve_expert_tactic

        build = resolve_expert_tactic(config, build)
    if build.autotune != "off" and timer is None and build.target == "cpu":
        raise ConfigError("autotune", f"{build.autotune} needs a timer to run candidate graphs with "
                                      "(trtbuild.bench.autotune.time_graph)")
    # unreadable: refused before any work. NOTE: a tensorrt build's cache is TensorRT's own binary file
    cache = TimingCache(timing_cache if build.target != "tensorrt" else None)
    lora = read_adapters(build.lora_adapters, config)  # checked against the model before any work
    prepare_output_dir(output)
    ranks = config.mapping.world_size
    steps = tqdm(total=5 * ranks, desc="building engine", unit="step", leave=False)
    try:
        weight_files: dict[str, int] = {}
        for rank in range(ranks):  # NOTE: one rank's network at a time: the build holds one rank's weights
            graph_file, weights_file = cpu_rank_files(rank)
            _, tensors = open_checkpoint(checkpoint, rank=rank)
            steps.set_postfix_str(f"network (rank {rank})" if ranks > 1 else "network"), steps.update()
            staging = StagingWeights(output / (weights_file + ".staging"))
            model = build_network(config, tensors, build, staging, lora, rank=rank)
            steps.set_postfix_str("passes + lowering"), steps.update()
            if build.target in ("cuda", "tensorrt"):
                finish = _finish_cuda if build.target == "cuda" else _finish_tensorrt
                finish(checkpoint, output, config, build, model, timing_cache)
                steps.update(3)
                return output
            applied = lower_for_target(model, build)
            steps.set_postfix_str("autotuning"), steps.update()
            lowering = TacticLowering()  # NOTE: per rank: it keeps what it packed, in this rank's weight file
            if rank == 0:  # NOTE: every rank's graph has the same nodes: rank 0's tactics are all ranks'
                candidates = {"attention": attention_candidates(model, build),
                              "quant_linears": quant_linear_candidates(model, build),
                              "float_linears": float_linear_candidates(model, build, lowering.dense_linears)}
                tactics = {}
                if build.autotune != "off":
                    tactics = tune(model, config, build, output, lowering, candidates, timer, cache)
                build = dataclasses.replace(build, **{family: tactics[family]["chosen"] if tactics else options[0]
                                                      for family, options in candidates.items()})
            applied += lowering(model, build)
            if build.quant_linears == "native":
                from trtbuild.builder.native_linears import describe_tables

                log.info("packed linears and tables: %s", describe_tables(model) or "none")
            steps.set_postfix_str("saving"), steps.update()
            weight_files[weights_file] = save_engine_files(model, output / graph_file, output / weights_file)
            onnx.checker.check_model(str(output / graph_file))  # by path: it reads the graph file, not the weights
            steps.update()
            if rank == 0:
                io = io_spec(model)
        copy_tokenizer_files(checkpoint, output)
        tables = {name for t in read_slot_tables(model) for name in (t.a, t.b)}  # LoRA slots' (builder/lora_slots.py)
        assert [i["name"] for i in io["inputs"] if i["name"] not in tables] == list(engine_inputs(config, build))
        assert [o["name"] for o in io["outputs"]] == list(engine_outputs(build))
        write_engine_config(output, config, build, cpu_fingerprint(), io, applied, weight_files, tactics)
    except BaseException:
        remove_partial_output(output)
        raise
    finally:
        steps.close()
    log.info("built %s with passes %s", output, applied)
    return output


def _finish_cuda(checkpoint: Path, output: Path, config: ModelConfig, build: BuildConfig, model: onnx.ModelProto,
                 timing_cache: Path | None) -> None:
    """The cuda target after the network: the fusion passes, then the plan instead of the CPU lowering."""
    import os

    from trtbuild.builder.build_cuda import build_cuda_files, cuda_fingerprint
    from trtbuild.builder.passes import run_passes

    applied = [f"{name}:{n}" for name, n in run_passes(model, "cuda").items()] if build.fuse else []
    plan, weight_files, tactics = build_cuda_files(model, config, build, output, timing_cache)
    staging = StagingWeights.of(model)
    if staging is not None and staging.path.exists():
        os.unlink(staging.path)
    copy_tokenizer_files(checkpoint, output)
    io = io_spec(model)
    io["inputs"] = [i for i in io["inputs"] if i["name"] in plan.inputs or i["name"] == "kv_cache"]
    io["outputs"] = [o for o in io["outputs"] if o["name"] in plan.outputs]
    for spec in io["inputs"]:  # the pool holds the compute dtype
        if spec["name"] == "kv_cache":
            spec["dtype"] = build.dtype
    write_engine_config(output, config, build, cuda_fingerprint(), io, applied, weight_files, tactics)
    log.info("built %s (cuda plan) with passes %s", output, applied)


def _finish_tensorrt(checkpoint: Path, output: Path, config: ModelConfig, build: BuildConfig, model: onnx.ModelProto,
                     timing_cache: Path | None) -> None:
    """The tensorrt target after the network: the fusion passes, then the plugin rewrite and TensorRT's builder
    (builder/tensorrt/build.py). The engine's I/O is the CPU engine's: the runtime writes new_kv into its pool."""
    import os

    from trtbuild.builder.passes import run_passes
    from trtbuild.builder.tensorrt.build import build_tensorrt_files, tensorrt_fingerprint

    applied = [f"{name}:{n}" for name, n in run_passes(model, "tensorrt").items()] if build.fuse else []
    io = io_spec(model)
    plugins, engine_files, profiles = build_tensorrt_files(model, config, build, output, timing_cache)
    staging = StagingWeights.of(model)
    if staging is not None and staging.path.exists():
        os.unlink(staging.path)
    copy_tokenizer_files(checkpoint, output)
    tactics = {"plugins": sorted({p.plugin for p in plugins}),
               "profiles": [{"name": p.name, "shapes": p.shapes} for p in profiles],
               "timing_cache": str(timing_cache) if timing_cache else None}
    write_engine_config(output, config, build, tensorrt_fingerprint(), io, applied, engine_files, tactics)
    log.info("built %s (tensorrt) with passes %s", output, applied)
