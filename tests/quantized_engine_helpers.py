"""Shared by the quantized engine and network tests: build options, calibration prompts, an op count, an error."""

from __future__ import annotations

import collections

import numpy as np
import onnx

# int4 in fp32 compute: these tests check the engine against the format to RTOL (level 4 is tested on its own)
# NOTE: a float32 KV pool (the default is float16 for quantized weights): the formats' arithmetic is compared
# exactly, against float32 references
OPTIONS = dict(max_seq_len=128, tokens_per_block=8, max_batch_size=4, max_num_tokens=64, int4_accuracy_level=1,
               kv_pool_dtype="float32")
LAYERS, VOCAB = 2, 320


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


A, B, C = ids(13, 1), ids(16, 2), ids(6, 3)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)
