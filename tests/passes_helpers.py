"""Shared by the fusion-pass tests: the random models' size, the build they are lowered for, a lowered-graph check."""

from __future__ import annotations

import onnx
from helpers import RANDOM_CONFIGS

from trtbuild.configs import BuildConfig
from trtbuild.plugins import paged_attention as pa

LAYERS = RANDOM_CONFIGS["llama"][1]["num_hidden_layers"]  # the same for every family
VOCAB = RANDOM_CONFIGS["llama"][1]["vocab_size"]
ENGINE_OPTIONS = dict(max_seq_len=128, tokens_per_block=8, max_batch_size=4, max_num_tokens=64)
BUILD = BuildConfig(**ENGINE_OPTIONS)


def check_lowered(model: onnx.ModelProto) -> None:
    assert not any(n.domain == pa.DOMAIN for n in model.graph.node)
    onnx.checker.check_model(model, full_check=True)
