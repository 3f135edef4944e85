"""Fixtures of the `trtbuild convert` and engine directory tests (a pytest plugin: conftest's pytest_plugins).

Both are caching factories of folders nobody writes into (tests copy them before editing), so one per session.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_random_hf_model


@pytest.fixture(scope="session")
def hf_dir(random_hf_model, tmp_path_factory):
    """name -> HF model folder (RANDOM_CONFIGS families plus `odd_vocab`)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name != "odd_vocab":
            return random_hf_model(name)
        if name not in cache:
            cache[name] = make_random_hf_model("llama3_rope", tmp_path_factory.mktemp("hf_odd_vocab"), seed=1,
                                               overrides={"vocab_size": 321, "num_hidden_layers": 3})
        return cache[name]

    return get


@pytest.fixture(scope="session")
def converted(hf_dir, tmp_path_factory):
    """(name, tp, pp, dtype) -> checkpoint folder, converted once per session."""
    from trtbuild.builder.convert.convert import convert

    cache: dict[tuple, Path] = {}

    def get(name: str, tp: int = 1, pp: int = 1, dtype: str = "auto") -> Path:
        key = (name, tp, pp, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{name}_tp{tp}_pp{pp}_{dtype}") / "ckpt"
            convert(hf_dir(name), out, dtype=dtype, tp_size=tp, pp_size=pp)
            cache[key] = out
        return cache[key]

    return get
