"""Shared cases of the EngineCore tests: prompts around block boundaries, greedy parameters, a 1-thread config."""

from __future__ import annotations

import numpy as np

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.sampling import SamplingParams

VOCAB = 320  # helpers.RANDOM_CONFIGS["llama"]
LENGTHS = (1, 3, 7, 8, 9, 17, 30, 45)  # around block boundaries, up to several blocks
PROMPTS = [np.random.default_rng(100 + n).integers(3, VOCAB, size=n).tolist() for n in LENGTHS]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def config(**options) -> RuntimeConfig:
    return RuntimeConfig(num_threads=1, **options)
