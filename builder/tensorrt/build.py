"""`trtbuild build --target tensorrt` once the fused graph exists: our ops become plugin nodes (plan.py), the graph
goes through TensorRT's ONNX parser into a strongly typed network with the optimization profiles, and the serialized
engine is written as rank{N}.engine, with the fingerprint it is only valid for (GPU, compute capability, CUDA,
TensorRT). Written against TensorRT 10's Python API; it has never run (TensorRT cannot be installed here)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import onnx

from trtbuild.builder.tensorrt.plan import PluginNode, Profile, optimization_profiles, rewrite_for_tensorrt
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import TrtbuildError

log = logging.getLogger(__name__)
FINGERPRINT_FIELDS = ("device", "compute_capability", "cuda_version", "tensorrt_version")


def engine_file(rank: int = 0) -> str:
    return f"rank{rank}.engine"


def tensorrt_fingerprint() -> dict[str, Any]:
    """What a serialized TensorRT engine is tied to: the GPU (name, SM) and the exact TensorRT version."""
    import tensorrt as trt
    import torch

    return {"name": "tensorrt", "device": torch.cuda.get_device_name(0),
            "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "cuda_version": torch.version.cuda, "tensorrt_version": trt.__version__}


def _parse(trt: Any, builder: Any, onnx_path: Path) -> tuple[Any, Any]:
    """A strongly typed network (the graph's own dtypes, no precision flags) from the ONNX file; the parser is
    returned too because the network refers to it."""
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, _logger(trt))
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtbuildError(f"TensorRT's ONNX parser refused the network: {errors}")
    return network, parser


_LOGGER: list[Any] = []


def _logger(trt: Any) -> Any:
    if not _LOGGER:
        _LOGGER.append(trt.Logger(trt.Logger.WARNING))
    return _LOGGER[0]


def _add_profiles(builder: Any, config: Any, network: Any, profiles: list[Profile]) -> None:
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for p in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            if name in inputs:
                profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)


def _timing_cache(config: Any, path: Path | None) -> Any:
    """The builder's timing cache, seeded from `path` when it exists (a cache from another GPU or TensorRT version
    is ignored by TensorRT itself, not an error)."""
    data = path.read_bytes() if path is not None and path.is_file() else b""
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def build_tensorrt_files(model: onnx.ModelProto, config: ModelConfig, build: BuildConfig, output: Path,
                         timing_cache: Path | None) -> tuple[list[PluginNode], dict[str, int], list[Profile]]:
    """Write rank0.engine; returns the plugin nodes, {engine file: bytes} and the profiles it was built with."""
    import tensorrt as trt

    from trtbuild.builder.weight_file import save_engine_files
    from trtbuild.plugins.tensorrt import register_all

    plugins = rewrite_for_tensorrt(model)
    profiles = optimization_profiles(build, config)
    register_all()
    logger = _logger(trt)
    builder = trt.Builder(logger)
    with tempfile.TemporaryDirectory(dir=output) as tmp:
        onnx_path = Path(tmp) / "rank0.onnx"
        save_engine_files(model, onnx_path, Path(tmp) / "rank0.weights")  # the parser reads external data by path
        network, _parser = _parse(trt, builder, onnx_path)
        builder_config = builder.create_builder_config()
        _add_profiles(builder, builder_config, network, profiles)
        cache = _timing_cache(builder_config, timing_cache)
        serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise TrtbuildError("TensorRT failed to build the engine (its log above says why).")
    if timing_cache is not None:
        timing_cache.write_bytes(memoryview(cache.serialize()))
    path = output / engine_file(0)
    path.write_bytes(memoryview(serialized))
    log.info("TensorRT engine %s: %d plugin nodes, profiles %s", path, len(plugins), [p.name for p in profiles])
    return plugins, {path.name: path.stat().st_size}, profiles
