"""Shared fixtures: tiny random HF models per family, and engines built from HF models (cached per session)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from helpers import STORIES260K, make_peft_adapter, make_random_hf_model, require_shared_models

# fixtures shared by several test files, one module per theme (tests/ is on sys.path: pyproject's pythonpath)
pytest_plugins = ["convert_fixtures", "passes_fixtures", "quantize_fixtures", "quantized_engine_fixtures"]


def _import_triton_interpreted() -> None:
    """Import triton, when installed, for its interpreter (gpu_kernels/load.py sets TRITON_INTERPRET=1 only meanwhile).
    triton.jit picks interpreter or GPU compilation when it decorates, and triton's own library (tl.sum,
    tl.sigmoid, ...) is decorated when triton is imported, which other tests cause early (torch._dynamo imports triton
    whenever it is installed). The kernel tests need that library interpreted; nothing else here runs Triton code."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    if os.environ.get("TRTBUILD_KERNELS_DEVICE") == "cuda":  # scripts/gpu_check.sh: the kernels on the GPU
        return
    from trtbuild.gpu_kernels.load import load_kernels

    load_kernels(interpret=True)


_import_triton_interpreted()

RUNTIME_ENGINE_OPTIONS = dict(max_batch_size=8, max_num_tokens=128)  # max_seq_len 256, 8 tokens per block


@pytest.fixture(scope="session")
def random_hf_model(tmp_path_factory):
    """factory(family) -> path of a saved random HF model (cached per session)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = make_random_hf_model(family, tmp_path_factory.mktemp(f"hf_{family}"))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def engine_from_hf(tmp_path_factory):
    """factory(hf_dir, **build_options) -> engine dir, converted and built once per (model, options)."""
    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert

    cache: dict[tuple, Path] = {}

    def get(hf_dir: Path, **options) -> Path:
        key = (str(hf_dir), tuple(sorted(options.items())))
        if key not in cache:
            work = tmp_path_factory.mktemp("engine")
            convert(hf_dir, work / "ckpt")
            options.setdefault("max_seq_len", 256)
            options.setdefault("tokens_per_block", 8)
            cache[key] = build_engine(work / "ckpt", work / "engine", **options)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llama_engine(random_hf_model, engine_from_hf) -> Path:
    """The random Llama as an engine for runtime tests (EngineCore, speculative decoding)."""
    return engine_from_hf(random_hf_model("llama"), **RUNTIME_ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def stories_engine(engine_from_hf) -> Path:
    """stories260K (real, trained) as an engine for runtime tests."""
    require_shared_models()
    return engine_from_hf(STORIES260K, **RUNTIME_ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory) -> dict[str, Path]:
    """Two PEFT LoRA adapters of stories260K: `sql` (q and v, rank 4) and `poem` (every linear, rank 8, rsLoRA)."""
    require_shared_models()
    out = tmp_path_factory.mktemp("lora")
    return {"sql": make_peft_adapter(STORIES260K, out / "sql", seed=1, r=4, lora_alpha=8,
                                     target_modules=["q_proj", "v_proj"]),
            "poem": make_peft_adapter(STORIES260K, out / "poem", seed=2, r=8, lora_alpha=4, use_rslora=True,
                                      target_modules="all-linear")}


@pytest.fixture(scope="session")
def lora_engine(engine_from_hf, lora_adapters) -> Path:
    """stories260K as an engine with both `lora_adapters` built in (runtime and server tests)."""
    adapters = tuple((name, str(path)) for name, path in lora_adapters.items())
    return engine_from_hf(STORIES260K, lora_adapters=adapters, **RUNTIME_ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def library() -> str:
    """The native CPU custom-op library's path (cpu_ops/), built on first use."""
    from trtbuild import cpu_ops

    reason = cpu_ops.unavailable_reason()
    assert reason is None, reason  # NOTE: CI machines have g++ and reach deb.debian.org; a failure here is real
    return str(cpu_ops.library_path())
