"""Shared fixtures: tiny random HF models per family, and engines built from HF models (cached per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_random_hf_model


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
