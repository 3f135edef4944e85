"""Fixtures of the `trtbuild quantize` tests (a pytest plugin: conftest's pytest_plugins).

`runs` and `unquantized` hold torch models and tensors, so they stay per module; `tiny` is a folder read only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import STORIES260K, make_random_hf_model, require_shared_models

CALIB = dict(calib_size=8, calib_max_seq_len=64)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """A random 2-layer llama (hidden 64, GQA) with stories260K's tokenizer (vocab 512)."""
    require_shared_models()
    hf = make_random_hf_model("llama", tmp_path_factory.mktemp("tiny") / "hf", overrides={"vocab_size": 512})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, hf / name)
    return hf


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """factory(qformat, kv, model=tiny, **options) -> (QuantizeResult, checkpoint dir), cached."""
    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    cache: dict = {}

    def get(qformat: str, kv: str | None = None, model: Path | None = None, **options):
        model = model or tiny
        if qformat == "int4_awq":
            options.setdefault("awq_block_size", 32)
        key = (qformat, kv, str(model), json.dumps(options, sort_keys=True, default=str))
        if key not in cache:
            out = tmp_path_factory.mktemp("q") / "ckpt"
            cache[key] = (quantize(QuantizeOptions(model, out, qformat, kv_cache_qformat=kv, **CALIB, **options)), out)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def unquantized(tiny, tmp_path_factory):
    """`tiny` converted without quantization: its checkpoint tensors (name -> torch.Tensor)."""
    from trtbuild.builder.convert.checkpoint import load_checkpoint
    from trtbuild.builder.convert.convert import convert

    out = tmp_path_factory.mktemp("conv") / "ckpt"
    convert(tiny, out)
    return load_checkpoint(out)[1]
