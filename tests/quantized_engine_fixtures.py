"""Fixtures of the quantized engine and network tests (a pytest plugin: conftest's pytest_plugins)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def base(random_hf_model, tmp_path_factory):
    """family -> (full-precision checkpoint dir, calibration amax), once per module."""
    from quant_helpers import calibrate
    from quantized_engine_helpers import A, B, C, ids

    from trtbuild.builder.convert.convert import convert

    cache = {}

    def get(family: str):
        if family not in cache:
            hf = random_hf_model(family)
            out = tmp_path_factory.mktemp(f"q_{family}") / "ckpt"
            convert(hf, out)
            cache[family] = out, calibrate(hf, ids(48, 7) + A + B + C)
        return cache[family]

    return get
