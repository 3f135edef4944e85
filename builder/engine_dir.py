"""The self-describing engine directory: config.json (version, model, build, target fingerprint, I/O, weight files)
+ rank0.onnx (the graph) + rank0.weights (its initializers, as ONNX external data).

Compatibility is checked from config.json alone, before any engine file is opened, so a wrong engine fails fast
with a message that says what to rebuild and how.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild import ENGINE_FORMAT_VERSION, __version__
from trtbuild.configs import BuildConfig, KVCacheGroup, ModelConfig, group_input, kv_cache_groups, slots_per_block
from trtbuild.errors import EngineCompatibilityError, TrtbuildError

ENGINE_CONFIG = "config.json"
CPU_ENGINE_FILE = "rank0.onnx"
CPU_WEIGHTS_FILE = "rank0.weights"


def cpu_rank_files(rank: int) -> tuple[str, str]:
    """The graph and weight files of one rank of a cpu engine (a tensor-parallel engine has one pair per rank)."""
    return f"rank{rank}.onnx", f"rank{rank}.weights"

CUDA_PLAN_FILE = "rank0.plan.json"  # the cuda target's files (builder/build_cuda.py)
TENSORRT_ENGINE_FILE = "rank0.engine"  # the tensorrt target's serialized engine (builder/tensorrt/build.py)
_CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
              "asimd", "sve")


def cpu_features() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
            break
    return sorted(f for f in _CPU_FLAGS if f in flags)


def cpu_fingerprint() -> dict[str, Any]:
    import onnxruntime

    return {"name": "cpu", "machine": platform.machine(), "cpu_features": cpu_features(),
            "onnxruntime_version": onnxruntime.__version__}


@dataclass(frozen=True)
class EngineInfo:
    """What config.json of an engine directory says."""

    path: Path
    model: ModelConfig
    build: BuildConfig
    target: dict[str, Any]
    io: dict[str, Any]
    passes: tuple[str, ...]
    trtbuild_version: str
    weight_files: dict[str, int]  # file name in the engine dir -> size in bytes
    tactics: dict[str, Any] = dataclasses.field(default_factory=dict)  # what autotuning chose (builder/autotune.py)

    @property
    def tuned_threads(self) -> int | None:
        """The thread count autotuning chose, if it tuned on a machine with as many cores as this one."""
        threads = self.tactics.get("num_threads", {})
        return int(threads["chosen"]) if threads and threads.get("cores") == os.cpu_count() else None

    @property
    def kv_cache_input(self) -> dict[str, Any]:
        """The engine's `kv_cache` input: {"name", "dtype", "shape": [num_blocks, slots, 2, kv_heads,
        tokens_per_block, head_size]} (checked when config.json is read)."""
        return next(i for i in self.io["inputs"] if i["name"] == "kv_cache")

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """Which layers each of the pool's blocks holds (configs/kv_groups.py; checked against the I/O on reading)."""
        return kv_cache_groups(self.model, self.build)

    @property
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one paged-KV block over all tensor-parallel ranks (each pool holds its ranks' KV heads), from the
        I/O spec: what sizes the pool before it is allocated."""
        spec = self.kv_cache_input
        return math.prod(spec["shape"][1:]) * np.dtype(spec["dtype"]).itemsize * self.model.mapping.tp_size

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_files.values())

    @property
    def graph_file(self) -> Path:
        """The engine's graph: the ONNX file (cpu), the execution plan (cuda, builder/build_cuda.py) or the
        serialized TensorRT engine (tensorrt, which is also its only weight file)."""
        files = {"cuda": CUDA_PLAN_FILE, "tensorrt": TENSORRT_ENGINE_FILE}
        return self.path / files.get(self.target.get("name"), CPU_ENGINE_FILE)

    @property
    def engine_bytes(self) -> int:
        """What the engine occupies on disk: its graph file and its weight files."""
        graph = 0 if self.graph_file.name in self.weight_files else self.graph_file.stat().st_size
        return graph + self.weight_bytes


def write_engine_config(out_dir: Path, model: ModelConfig, build: BuildConfig, target: dict, io: dict,
                        passes: list[str], weight_files: dict[str, int], tactics: dict | None = None) -> None:
    doc = {
        "trtbuild_version": __version__,
        "engine_format_version": ENGINE_FORMAT_VERSION,
        "target": target,
        "model_config": model.to_dict(),
        "build_config": build.to_dict(),
        "passes": passes,
        "io": io,
        "weight_files": weight_files,
        "tactics": tactics or {},
    }
    (out_dir / ENGINE_CONFIG).write_text(json.dumps(doc, indent=2) + "\n")


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())


def build_command(*flags: str) -> str:
    """The command that rebuilds an engine from its checkpoint, in backquotes, with `flags` after the paths."""
    return "`" + " ".join(("trtbuild build --checkpoint <checkpoint dir> --output <new engine dir>",) + flags) + "`"


REBUILD = f"rebuild it from its checkpoint: {build_command()}"


def read_engine_config(engine_dir: Path, expect_target: str = "cpu") -> EngineInfo:
    """Parse and check an engine directory for this machine; raises EngineCompatibilityError before any work.

    Whatever is wrong with config.json (missing, not UTF-8 or JSON, another format version, a field of the wrong
    type or an invalid value) is this one error, naming the file and the rebuild command."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_CONFIG
    if not path.is_file():
        raise EngineCompatibilityError(
            f"{engine_dir} is not an engine directory (no {ENGINE_CONFIG}); build one with `trtbuild build`.")
    try:
        doc = json.loads(path.read_bytes())  # NOTE: bytes: a non-UTF-8 file is a ValueError here, like bad JSON
    except (OSError, ValueError) as e:
        raise EngineCompatibilityError(f"{path} is corrupt ({e}); {REBUILD}.") from None
    if not isinstance(doc, dict) or "engine_format_version" not in doc:
        raise EngineCompatibilityError(
            f"{engine_dir} is not an engine directory ({ENGINE_CONFIG} has no engine_format_version); "
            "build one with `trtbuild build --checkpoint <checkpoint dir> --output <engine dir>`.")
    version = doc.get("engine_format_version")
    built_by = doc.get("trtbuild_version", "unknown")
    if version != ENGINE_FORMAT_VERSION:  # NOTE: repr: a string "4" must not read as the format 4 it is not
        raise EngineCompatibilityError(
            f"{engine_dir} was built by trtbuild {built_by} (engine format {version!r}); this trtbuild {__version__} "
            f"reads format {ENGINE_FORMAT_VERSION}. Rebuild it from its checkpoint with this version: "
            f"{build_command()}.")
    try:
        info = _engine_info(engine_dir, doc)
    except EngineCompatibilityError:
        raise
    except (TrtbuildError, KeyError, TypeError, ValueError, AttributeError) as e:
        problem = e.format_message() if isinstance(e, TrtbuildError) else f"{type(e).__name__}: {e}"
        raise EngineCompatibilityError(f"{path} is incomplete or corrupt ({problem}); {REBUILD}.") from None
    if info.target.get("name") != expect_target:
        raise EngineCompatibilityError(
            f"{engine_dir} was built for target {info.target.get('name')!r}, but this runtime runs {expect_target!r} "
            f"engines; rebuild it: {build_command('--target', expect_target)}.")
    if expect_target == "cpu":
        _check_cpu_target(engine_dir, info.target)
    elif expect_target == "cuda":
        _check_cuda_target(engine_dir, info)
    elif expect_target == "tensorrt":
        _check_tensorrt_target(engine_dir, info)
    _check_weight_files(engine_dir, info.weight_files)
    return info


def _engine_info(engine_dir: Path, doc: dict[str, Any]) -> EngineInfo:
    """config.json's fields, type-checked (raises KeyError, TypeError, ValueError or a config's own error)."""
    target, io = doc["target"], doc.get("io", {})
    if not isinstance(target, dict) or not isinstance(io, dict):
        raise TypeError("target and io must be JSON objects")
    if not all(isinstance(f, str) for f in target.get("cpu_features", [])):
        raise TypeError("target.cpu_features must be a list of strings")
    kv = [i for i in io.get("inputs", []) if isinstance(i, dict) and i.get("name") == "kv_cache"]
    if len(kv) != 1 or not all(isinstance(d, int) and d > 0 for d in kv[0].get("shape", [0])[1:]):
        raise ValueError("io.inputs has no kv_cache input [num_blocks, layers, 2, kv_heads, tokens_per_block, "
                         "head_size] with fixed dimensions after the first")
    if not isinstance(kv[0].get("dtype"), str):
        raise TypeError("io.inputs kv_cache has no dtype")
    if kv[0]["dtype"] == "bfloat16":
        # NOTE: a cuda engine's bfloat16 pool, a name ml_dtypes registers with numpy. Imported only then: the Triton
        # stub's numpy 1.x environment cannot import ml_dtypes
        import ml_dtypes  # noqa: F401
    np.dtype(kv[0]["dtype"])  # TypeError for a dtype numpy does not know
    info = EngineInfo(
        path=engine_dir,
        model=ModelConfig.from_dict(doc["model_config"]),
        build=BuildConfig.from_dict(doc["build_config"]),
        target=target,
        io=io,
        passes=tuple(str(p) for p in doc.get("passes", ())),
        trtbuild_version=str(doc.get("trtbuild_version", "unknown")),
        weight_files={str(k): int(v) for k, v in doc["weight_files"].items()},
        tactics=_tactics(doc.get("tactics", {})),
    )
    _check_kv_groups(info)
    return info


def _check_kv_groups(info: EngineInfo) -> None:
    """The pool's block layout and block table inputs are those of the model's KV cache groups (kv_groups.py)."""
    groups = info.kv_cache_groups
    names = {i.get("name") for i in info.io.get("inputs", []) if isinstance(i, dict)}
    tables = [group_input("block_tables", g) for g in range(1, len(groups))]
    if info.kv_cache_input["shape"][1] != slots_per_block(groups) or not names.issuperset(tables):
        raise ValueError(f"its KV pool holds {info.kv_cache_input['shape'][1]} layers per block, where the model's "
                         f"{len(groups)} KV cache group(s) need {slots_per_block(groups)} and block table inputs "
                         f"{', '.join(tables) or 'none'} beside block_tables")


def _tactics(tactics: Any) -> dict[str, Any]:
    if not isinstance(tactics, dict):
        raise TypeError("tactics must be a JSON object")
    threads = tactics.get("num_threads")
    if threads is not None and not (isinstance(threads, dict) and isinstance(threads.get("chosen"), int)):
        raise TypeError("tactics.num_threads.chosen must be an integer")
    return tactics


def _check_weight_files(engine_dir: Path, weight_files: dict[str, int]) -> None:
    """Every weight file config.json names is there with its recorded size: a missing or truncated copy fails here,
    not halfway through loading."""
    for name, size in weight_files.items():
        f = engine_dir / name
        if not f.is_file():
            raise EngineCompatibilityError(f"{f} is missing ({size} bytes expected); copy the whole engine directory "
                                           "or rebuild it with `trtbuild build`.")
        if f.stat().st_size != size:
            raise EngineCompatibilityError(f"{f} has {f.stat().st_size} bytes but the engine was built with {size}: "
                                           "it is truncated or from another engine; copy the whole engine directory "
                                           "again or rebuild it with `trtbuild build`.")


def _check_cpu_target(engine_dir: Path, target: dict) -> None:
    here = cpu_fingerprint()
    hint = f"rebuild it on this machine: {build_command()}."
    if target.get("machine") != here["machine"]:
        raise EngineCompatibilityError(
            f"{engine_dir} was built on a {target.get('machine')} CPU and this one is {here['machine']}; {hint}")
    missing = sorted(set(target.get("cpu_features", [])) - set(here["cpu_features"]))
    if missing:
        raise EngineCompatibilityError(
            f"{engine_dir} was built for a CPU with {', '.join(missing)}, which this CPU lacks; {hint}")
    built_ort = target.get("onnxruntime_version", "0")
    if _version_tuple(here["onnxruntime_version"]) < _version_tuple(built_ort):
        raise EngineCompatibilityError(
            f"{engine_dir} was built with onnxruntime {built_ort}, newer than the installed "
            f"{here['onnxruntime_version']}; upgrade onnxruntime (`pip install -U onnxruntime`) or {hint}")


def engine_target(engine_dir: Path) -> str:
    """The runtime target (cpu, cuda or tensorrt) an engine directory says it was built for; `cpu` when config.json
    cannot tell or names a target no runtime here runs (reading it then fails with the full message)."""
    try:
        target = json.loads((Path(engine_dir) / ENGINE_CONFIG).read_bytes())["target"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return "cpu"
    return target if target in ("cpu", "cuda", "tensorrt") else "cpu"


def _check_cuda_target(engine_dir: Path, info: EngineInfo) -> None:
    """A CUDA engine runs only on the GPU and stack it was built (and tuned) for; refused before any work."""
    from trtbuild.builder.build_cuda import cuda_fingerprint, fingerprint_mismatch

    mismatch = fingerprint_mismatch(info.target, cuda_fingerprint())
    if mismatch:
        raise EngineCompatibilityError(
            f"{engine_dir} was built for another GPU or software stack ({mismatch}); rebuild it here: "
            f"{build_command('--target', 'cuda', '--dtype', info.build.dtype)}.")


def _check_tensorrt_target(engine_dir: Path, info: EngineInfo) -> None:
    """A serialized TensorRT engine loads only with TensorRT, on the GPU and TensorRT version that built it: said
    here, before deserializing, instead of TensorRT's own opaque errors."""
    import importlib.util

    hint = f"rebuild it here: {build_command('--target', 'tensorrt')}, or build it for --target cuda or cpu"
    if importlib.util.find_spec("tensorrt") is None:
        raise EngineCompatibilityError(f"{engine_dir} is a TensorRT engine, and NVIDIA TensorRT's Python package is "
                                       f"not installed here; `pip install tensorrt` or {hint}.")
    from trtbuild.builder.build_cuda import fingerprint_mismatch
    from trtbuild.builder.tensorrt.build import FINGERPRINT_FIELDS, tensorrt_fingerprint

    mismatch = fingerprint_mismatch(info.target, tensorrt_fingerprint(), FINGERPRINT_FIELDS)
    if mismatch:
        raise EngineCompatibilityError(f"{engine_dir} was built for another GPU or TensorRT ({mismatch}); {hint}.")
