"""Fixtures of the fusion-pass tests (a pytest plugin: conftest's pytest_plugins)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoint(random_hf_model, tmp_path_factory):
    """family -> (ModelConfig, checkpoint tensors), converted once per module."""
    from trtbuild.builder.convert.checkpoint import load_checkpoint
    from trtbuild.builder.convert.convert import convert

    cache = {}

    def get(family: str):
        if family not in cache:
            out = tmp_path_factory.mktemp(f"passes_{family}") / "ckpt"
            convert(random_hf_model(family), out)
            cache[family] = load_checkpoint(out)
        return cache[family]

    return get


@pytest.fixture
def network(checkpoint):
    """family -> (config, tensors, a fresh unfused network)."""
    from passes_helpers import BUILD

    from trtbuild.builder.network import build_network

    def get(family: str):
        config, tensors = checkpoint(family)
        return config, tensors, build_network(config, tensors, BUILD)

    return get
