"""trtbuild's ONNX Runtime custom-op library for the CPU target: native kernels for ops of plugins/README.md.

The library is compiled on the machine that uses it, on first use (as torch's C++ extensions and Triton compile
theirs): `g++ -O3 -march=native` against ONNX Runtime's headers (cpu_ops/ort_headers.py), cached under
`~/.cache/trtbuild/cpu_ops/<hash of sources, compiler and CPU>`. An engine whose graph keeps `trtbuild::` nodes
needs it; the builder only keeps them when the library is available (`trtbuild build --attention`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from trtbuild.cpu_ops.ort_headers import HeadersUnavailable, cache_dir, include_dir
from trtbuild.errors import TrtbuildError

log = logging.getLogger(__name__)
SOURCES = ("register.cc", "paged_attention.cc", "block_matmul.cc", "block_gather.cc", "dense_matmul.cc", "swiglu.cc",
           "moe_route.cc", "lora.cc", "collectives.cc", "short_conv.cc", "gated_delta.cc",
           "mamba2.cc")
HEADERS = ("cpu_ops.h", "packed_table.h", "quantized_x.h", "simd_math.h", "float_weights.h", "block_problem.h",
           "block_tile_avx512.h", "block_tile_avx2.h", "attention_task.h", "attend_avx512.h", "attend_avx2.h",
           "state_batch.h")
DOMAIN = "trtbuild"
WITHOUT_NATIVE_OPS = "--attention split --quant-linears ort --float-linears ort"  # the build flags that need no library
_HERE = Path(__file__).parent


class CpuOpsUnavailable(TrtbuildError):
    """The custom-op library cannot be built or loaded on this machine."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise CpuOpsUnavailable(f"no C++ compiler ({cxx}) on this machine: install g++ (Debian: `apt-get install "
                                f"g++`), or build engines with `{WITHOUT_NATIVE_OPS}`.")
    return cxx


def _flags(includes: Path) -> list[str]:
    # NOTE: no FMA contraction of plain C++ arithmetic (RoPE), so results match ONNX Runtime's kernels to the ulp
    return ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-I{includes}"]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def library_path() -> Path:
    """The compiled library, built now if this machine has none for these sources yet."""
    cxx = _compiler()
    try:
        includes = include_dir()
    except HeadersUnavailable as e:
        raise CpuOpsUnavailable(str(e)) from None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256(b"".join((_HERE / f).read_bytes() for f in SOURCES + HEADERS))
    digest.update(" ".join([*_flags(includes), *version, _cpu_flags()]).encode())
    target = cache_dir() / "cpu_ops" / digest.hexdigest()[:16] / "libtrtbuild_cpu_ops.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        staging = Path(tmp) / target.name
        command = [cxx, *_flags(includes), *(str(_HERE / f) for f in SOURCES), "-o", str(staging)]
        log.info("compiling the CPU custom-op library: %s", " ".join(command))
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise CpuOpsUnavailable(f"compiling the CPU custom-op library failed:\n{result.stderr[-3000:]}\n"
                                    f"Build engines with `{WITHOUT_NATIVE_OPS}` to do without it.")
        staging.replace(target)  # NOTE: atomic, so concurrent first uses never load a half-written library
    return target


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI's dot products (BlockQuantMatMul's fastest tiles; int8 GEMMs that sum
    exactly in ONNX Runtime)."""
    from trtbuild.builder.engine_dir import cpu_features

    return {"avx512f", "avx512bw", "avx512_vnni"} <= set(cpu_features())


def has_avx2_tiles() -> bool:
    """Whether this CPU has what the native linears' AVX2 tiles need: AVX2 with FMA and F16C."""
    from trtbuild.builder.engine_dir import cpu_features

    return {"avx2", "fma", "f16c"} <= set(cpu_features())


def runs_block_quant() -> bool:
    """Whether BlockQuantMatMul has tiles for this CPU: AVX-512 VNNI, or AVX2 (cpu_ops/quantized_x.h picks the same
    way when the library compiles)."""
    return has_vnni() or has_avx2_tiles()


def high_bits_layout() -> str:
    """How BlockQuantMatMul tables built here hold 3/5/6-bit codes' further bits (plugins/block_quant_matmul.py:
    HIGH_BITS): byte-mask planes for the AVX-512 VNNI tiles, which add a plane under a mask in one instruction;
    packed as the base codes are for the AVX2 ones, which would spend five instructions expanding a mask. Either
    tile reads either layout."""
    return "planes" if has_vnni() else "packed"


def has_avx512() -> bool:
    """Whether this CPU has AVX-512: the widest tiles of the vectorized attention, DenseMatMul and LoraAdd."""
    from trtbuild.builder.engine_dir import cpu_features

    return "avx512f" in cpu_features()


def runs_dense() -> bool:
    """Whether DenseMatMul / DenseGather and LoraAdd have tiles for this CPU: AVX-512, or AVX2 (cpu_ops/float_weights.h
    picks the same way when the library compiles)."""
    return has_avx512() or has_avx2_tiles()


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the library builds and loads here; otherwise why not (logged once)."""
    try:
        path = library_path()
        import onnxruntime as ort

        ort.SessionOptions().register_custom_ops_library(str(path))
    except (CpuOpsUnavailable, RuntimeError, OSError) as e:
        log.warning("native CPU ops unavailable: %s", e)
        return str(e)
    return None


def library_for_engine(engine: Path) -> Path:
    """The library an engine's graph needs, or an error naming the engine and how to rebuild it without."""
    from trtbuild.builder.engine_dir import build_command
    from trtbuild.errors import EngineCompatibilityError

    try:
        return library_path()
    except CpuOpsUnavailable as e:
        raise EngineCompatibilityError(f"engine {engine} runs trtbuild's native CPU ops, which cannot be built on "
                                       f"this machine: {e}\nOr rebuild the engine without them: "
                                       f"{build_command(WITHOUT_NATIVE_OPS)}") from None
