"""Build-time limits of an engine (what TensorRT would call optimization profiles)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import TrtbuildError

TARGETS = ("cpu", "tensorrt")
# ONNX Runtime MatMulNBits accuracy levels the CPU engine offers for int4 weights: 1 = fp32 compute (bit-faithful
# to the checkpoint format), 4 = int8 compute (activations quantized per block, VNNI kernels; faster).
INT4_ACCURACY_LEVELS = (1, 4)
# element type of an unquantized paged KV pool (a quantized one is the checkpoint's kv_cache_quant_algo)
KV_CACHE_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class BuildConfig:
    target: str = "cpu"
    max_batch_size: int = 16
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_tokens: int = 2048  # tokens packed into one engine call (prefill chunks + decode tokens)
    tokens_per_block: int = 16  # paged-KV block size
    fuse: bool = True  # run the fusion passes (off only to test them)
    # INT4_ACCURACY_LEVELS: MatMulNBits' compute on the CPU target, for int4 and int8 weight-only (int8_wo) linears
    int4_accuracy_level: int = 4
    # KV_CACHE_DTYPES: float16 halves the pool's bytes (attention still computes in float32)
    kv_cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise TrtbuildError(f"unknown target {self.target!r}; choose one of {', '.join(TARGETS)}.")
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block"):
            if getattr(self, name) < 1:
                raise TrtbuildError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}.")
        if self.int4_accuracy_level not in INT4_ACCURACY_LEVELS:
            raise TrtbuildError(f"--int4-accuracy-level must be one of {INT4_ACCURACY_LEVELS}, "
                                f"got {self.int4_accuracy_level}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise TrtbuildError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                f"got {self.kv_cache_dtype!r}.")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildConfig:
        return cls(**d)
