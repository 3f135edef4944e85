"""`trtbuild build --target cuda`: the fused graph -> an execution plan of Triton and torch kernels (cuda_plan.py),
its weights pre-packed as safetensors, the kernels' tactics, and the GPU/stack fingerprint the engine is checked
against when it is loaded.

Engine directory: config.json (target {"name": "cuda", ...fingerprint}) + rank0.plan.json + rank0.safetensors.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import onnx
import torch

from trtbuild.builder.cuda_plan import TORCH_DTYPES, Plan, emit_plan
from trtbuild.builder.engine_dir import CUDA_PLAN_FILE
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import ConfigError, TrtbuildError

log = logging.getLogger(__name__)
CUDA_WEIGHTS_FILE = "rank0.safetensors"
INTERPRETER_DEVICE = "cpu (Triton interpreter)"
# Tile sizes the kernels use when nothing was timed (no GPU at build time): the launchers' own defaults
DEFAULT_TACTICS = {"paged_attention": {"block_m": 16, "block_n": 64, "num_splits": 1},
                   "weight_only_gemm": {"block_m": 16, "block_n": 64, "block_k": 64},
                   "fused_moe": {"block_m": 16, "block_n": 64, "block_k": 32}}


def cuda_fingerprint() -> dict[str, Any]:
    """What a CUDA engine is only valid for: the GPU (name, compute capability) and the stack (CUDA, torch, Triton).
    Without a GPU the kernels run in Triton's interpreter on CPU tensors, and the device says so."""
    from importlib.metadata import version

    gpu = torch.cuda.is_available()
    return {"name": "cuda",
            "device": torch.cuda.get_device_name(0) if gpu else INTERPRETER_DEVICE,
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,
            "cuda_version": torch.version.cuda if gpu else None,
            "torch_version": torch.__version__.split("+")[0],
            # NOTE: the version from its metadata, not `import triton`: the kernels must be the first to import it
            # (gpu_kernels/load.py), so that without a GPU triton's library is decorated for its interpreter
            "triton_version": version("triton")}


FINGERPRINT_FIELDS = ("device", "compute_capability", "cuda_version", "torch_version", "triton_version")


def fingerprint_mismatch(built: dict[str, Any], here: dict[str, Any],
                         fields: tuple[str, ...] = FINGERPRINT_FIELDS) -> str | None:
    """'device X here but Y in the engine; ...' for every one of `fields` that differs, or None."""
    diffs = [f"{f} {here.get(f)!r} here but {built.get(f)!r} in the engine" for f in fields
             if built.get(f) != here.get(f)]
    return "; ".join(diffs) or None


def check_cuda_buildable(config: ModelConfig, build: BuildConfig) -> None:
    """What the cuda target refuses before any work (the rest of check_buildable applies too)."""
    if importlib.util.find_spec("triton") is None:
        raise TrtbuildError("the cuda target needs Triton: `pip install triton` (the kernels are Triton kernels).")
    if config.quantization.kv_cache_quant_algo not in (None, "int8"):
        raise ConfigError("target", f"cuda runs an int8 KV cache, not {config.quantization.kv_cache_quant_algo} "
                                    "yet (its attention kernel reads float and int8 pools): quantize with "
                                    "--kv-cache-qformat int8, or build it for cpu.")
    if config.qk_norm_after_rope:
        raise ConfigError("target", "cuda does not run q / k norms after RoPE (Hunyuan) yet: its attention kernel "
                                    "rotates q and k itself; build it for cpu.")
    if build.kv_pool_dtype != "float32":
        raise ConfigError("kv_pool_dtype", "the cuda target's KV pool has the compute dtype (--dtype); leave "
                                           "--kv-pool-dtype at float32.")
    if build.dtype == "bfloat16" and not torch.cuda.is_available():
        raise ConfigError("dtype", "bfloat16 needs a GPU: Triton's interpreter computes bfloat16 wrongly; build "
                                   "float32 or float16 here.")


def check_tensorrt_available() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        raise ConfigError("target", "tensorrt needs NVIDIA TensorRT's Python package, which is not installed: "
                                    "`pip install tensorrt` on a machine with an NVIDIA GPU and driver, or build for "
                                    "--target cuda or cpu.")


def tactics(config: ModelConfig, build: BuildConfig, timing_cache: Path | None) -> dict[str, Any]:
    """The kernels' tile sizes as the engine's tactics. NOTE: real autotuning times candidates on the GPU it builds
    for (gpu_kernels/autotune.py); without one the launchers' defaults are recorded and the reason with them."""
    defaults = {name: t for name, t in DEFAULT_TACTICS.items() if name != "fused_moe" or config.is_moe}
    if build.autotune == "off":
        return {name: {"chosen": dict(t), "source": "default"} for name, t in defaults.items()}
    if not torch.cuda.is_available():
        return {name: {"chosen": dict(t), "source": "default: autotuning needs a GPU, none here"}
                for name, t in defaults.items()}
    from trtbuild.gpu_kernels.autotune import tune_cuda
    from trtbuild.gpu_kernels.load import load_kernels

    tuned = tune_cuda(config, build, cuda_fingerprint(), timing_cache, load_kernels(interpret=False))
    return {**{name: {"chosen": dict(t), "source": "default"} for name, t in defaults.items()}, **tuned}


def build_cuda_files(model: onnx.ModelProto, config: ModelConfig, build: BuildConfig, output: Path,
                     timing_cache: Path | None) -> tuple[Plan, dict[str, int], dict[str, Any]]:
    """Write rank0.plan.json and rank0.safetensors; returns the plan, {weight file: bytes} and the tactics."""
    from safetensors.torch import save_file

    from trtbuild.builder.moe_experts import expert_parameters, quantized_experts

    if quantized_experts(config):
        size = expert_parameters(config) * TORCH_DTYPES[build.dtype].itemsize
        log.warning("experts: weight-only in the checkpoint, dequantized to %s for the fused MoE kernel, %.1f GB of "
                    "them (the cuda target has no weight-only grouped GEMM yet)", build.dtype, size / 1e9)
    plan, weights = emit_plan(model, build.dtype)
    (output / CUDA_PLAN_FILE).write_text(plan.to_json())
    save_file(weights, str(output / CUDA_WEIGHTS_FILE), metadata={"plan": CUDA_PLAN_FILE})
    return plan, {CUDA_WEIGHTS_FILE: (output / CUDA_WEIGHTS_FILE).stat().st_size}, tactics(config, build, timing_cache)
