"""What a build refuses before any work: a model, checkpoint or set of build options the chosen target cannot build,
each with what to do instead (the cuda and tensorrt targets' own refusals: builder/build_cuda.py,
builder/tensorrt/plan.py)."""

from __future__ import annotations

from trtbuild.builder.quantized import check_quantization
from trtbuild.builder.tensorrt.plan import check_tensorrt_buildable
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import ConfigError, TrtbuildError


def check_recurrent_buildable(config: ModelConfig, build: BuildConfig) -> None:
    """Refuse what a model with recurrent layers (linear attention, Mamba2: a state per sequence) cannot be built
    with."""
    name = f"{config.architecture}'s recurrent layers (linear attention, Mamba2)"
    if build.target == "tensorrt":
        raise TrtbuildError(f"{name} have no tensorrt kernel yet; build it with --target cpu or cuda.")
    if config.quantization.kv_cache_quant_algo:
        raise TrtbuildError(f"{name} keep their convolution rows in the KV pool, which a quantized KV cache has no "
                            "scales for: quantize without --kv-cache-qformat.")
    from trtbuild import cpu_ops

    if build.target == "cpu" and (reason := cpu_ops.unavailable_reason()) is not None:
        raise TrtbuildError(f"{name} run only as trtbuild's CPU ops (GatedDeltaNet, Mamba2Scan), and {reason}.")


def check_buildable(config: ModelConfig, build: BuildConfig) -> None:
    """Refuse, before any work, what the chosen target cannot build."""
    if not config.has_lm_head and build.task != "embed":
        raise TrtbuildError("the checkpoint has no LM head (converted from a base model saved without one, as "
                            "embedding models are): build it with --task embed.")
    if config.is_moe and build.target == "tensorrt":
        raise TrtbuildError(f"{config.architecture} is a mixture of experts, which the tensorrt target has no "
                            "kernel for yet; build it with --target cpu or cuda.")
    if "conv" in config.layer_types and build.target == "tensorrt":
        raise TrtbuildError(f"{config.architecture}'s short convolution layers have no tensorrt kernel yet; build it "
                            "with --target cpu or cuda.")
    if config.recurrent_layers:
        check_recurrent_buildable(config, build)
    if "conv" in config.layer_types and config.quantization.kv_cache_quant_algo:
        raise TrtbuildError(f"{config.architecture}'s convolution layers keep their state in the KV pool, which a "
                            "quantized KV cache has no scales for: quantize without --kv-cache-qformat.")
    if build.target in ("cuda", "tensorrt"):  # NOTE: imported here: they bring torch, which a cpu build never needs
        from trtbuild.builder.build_cuda import check_cuda_buildable, check_tensorrt_available

        if build.target == "tensorrt":
            check_tensorrt_available()
            check_tensorrt_buildable(config, build)
        else:
            check_cuda_buildable(config, build)
    if config.mapping.world_size > 1:
        check_parallel_buildable(config, build)
    check_quantization(config, build)
    if build.max_seq_len > config.max_position_embeddings:
        raise ConfigError("max_seq_len", f"{build.max_seq_len} exceeds the model's max_position_embeddings "
                                         f"({config.max_position_embeddings}); pass {config.max_position_embeddings} "
                                         "or less.")
    if build.max_num_tokens < build.max_batch_size:
        raise ConfigError("max_num_tokens", f"{build.max_num_tokens} is below max_batch_size {build.max_batch_size}: "
                                            "a decode step of a full batch would not fit.")


def check_parallel_buildable(config: ModelConfig, build: BuildConfig) -> None:
    """A checkpoint of several ranks builds for the cpu target, as tensor-parallel ranks (builder/tensor_parallel.py)
    that meet in the native library's collectives."""
    mapping = config.mapping
    again = "re-run `trtbuild convert` with --tp-size 1 --pp-size 1"
    if mapping.pp_size > 1 or build.target != "cpu":
        where = "pipeline-parallel ranks" if mapping.pp_size > 1 else f"ranks for the {build.target} target"
        raise TrtbuildError(f"this checkpoint has {mapping.world_size} ranks (tp={mapping.tp_size}, "
                            f"pp={mapping.pp_size}); trtbuild builds no {where} yet: {again}, or build a "
                            "tensor-parallel one (--tp-size only) for --target cpu.")
    if build.lora_adapters or build.max_loras:
        raise TrtbuildError(f"LoRA adapters are not split over tensor-parallel ranks: {again} to build with LoRA.")
    if build.autotune != "off":
        raise ConfigError("autotune", "times one rank's graph alone, but a tensor-parallel rank waits on the others "
                                      "at every collective: build with --autotune off.")
    from trtbuild import cpu_ops

    if build.target == "cpu" and (reason := cpu_ops.unavailable_reason()) is not None:
        raise TrtbuildError(f"tensor-parallel ranks meet in the native CPU library's collectives, which cannot be "
                            f"built here ({reason}); {again}.")
