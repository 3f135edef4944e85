"""The quantization vocabulary shared by configs, builder, runtime and `trtbuild quantize`: format names, the limits
of each number format, int4 packing and the paged KV pool's element type (docs/quantization.md).

The enums are StrEnums: a member equals (and hashes as) its string, which is what config.json files store, so config
fields stay plain `str` and old checkpoints and engines load unchanged.

NOTE: cheap to import (no numpy, torch, onnx or ml_dtypes at import time; each function imports what it needs), since
the CLI builds its `--help` choices from these enums and `trtbuild --help` must not load heavy modules.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from trtbuild.configs import BuildConfig, ModelConfig


class QuantAlgo(StrEnum):
    """Formats of quantized linears (`quant_algo`, `lm_head_quant_algo` of a checkpoint)."""

    FP8 = "fp8"  # e4m3 weights and activations, per-tensor scales
    INT4_AWQ = "int4_awq"  # signed int4 weights, blockwise scales, AWQ pre-scaling of the input
    INT8_SQ = "int8_sq"  # int8 weights and activations, SmoothQuant pre-scaling of the input
    # int8 or int4 weights with blockwise scales (and optional float zero points), full-precision activations, in ONNX
    # Runtime MatMulNBits' layout; each linear's bits, group size and zero points are told by its own tensors
    # (`trtbuild convert --weight-only`, or a GGUF file's quantized tensors kept as they are)
    WEIGHT_ONLY = "weight_only"
    # int8 weights with one scale per output channel, full-precision activations (TensorRT-LLM's W8A16): lm_head only
    INT8_WO = "int8_wo"


# what a checkpoint's `quant_algo` may be, `lm_head_quant_algo` (lm_head on its own, whatever the other linears use),
# and the formats `trtbuild quantize` calibrates (`--qformat`)
QUANT_ALGOS = (QuantAlgo.FP8, QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ, QuantAlgo.WEIGHT_ONLY)
LM_HEAD_QUANT_ALGOS = (QuantAlgo.INT8_WO,)
CALIBRATED_QUANT_ALGOS = (QuantAlgo.FP8, QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ)
# `--qformat` that keeps every linear as it is and quantizes only the KV cache (TensorRT-LLM's name for it)
FULL_PRECISION = "full_prec"
QUANTIZE_FORMATS = (*(a.value for a in CALIBRATED_QUANT_ALGOS), FULL_PRECISION)  # `trtbuild quantize --qformat`


class KVCacheQuantAlgo(StrEnum):
    """A quantized KV cache (`kv_cache_quant_algo`): 1-byte values with one static scale per layer for K and for V."""

    FP8 = "fp8"
    INT8 = "int8"


class KVPoolDtype(StrEnum):
    """Element type of an unquantized paged KV pool (`BuildConfig.kv_pool_dtype`); attention computes in float32."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"


INT8_MAX = 127  # symmetric int8: [-127, 127] for weights (int8_sq) and the KV cache
INT4_MAX = 7  # signed int4: [-8, 7]; scales are amax / 7
FP8_E4M3_MAX = 448  # largest finite float8 e4m3fn value; fp8 casts saturate to +-448
PER_TOKEN_MIN_AMAX = 1e-30  # per-token int8: floor of a token's amax, so that an all-zero token has a scale
INT4_ZERO_POINT = 8  # a signed int4 value q is stored as the unsigned nibble q + 8

# NOTE: fp8 KV values travel as their uint8 bit patterns: ONNX Runtime's CPU Gather takes no float8 tensors
_KV_QUANT_STORAGE = {KVCacheQuantAlgo.INT8: "int8", KVCacheQuantAlgo.FP8: "uint8"}


def fp8_e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 float8 e4m3fn bit patterns (NaN patterns -> 0: they are never stored)."""
    import ml_dtypes
    import numpy as np

    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.nan_to_num(values, nan=0.0)


def kv_pool_dtype(model: ModelConfig, build: BuildConfig) -> np.dtype:
    """Element type of the engine's paged KV pool: int8, or uint8 bit patterns of fp8, when the checkpoint quantizes
    the KV cache; otherwise the build's `kv_pool_dtype` (float32 or float16)."""
    import numpy as np

    algo = model.quantization.kv_cache_quant_algo
    return np.dtype(_KV_QUANT_STORAGE[KVCacheQuantAlgo(algo)] if algo else KVPoolDtype(build.kv_pool_dtype).value)


def kv_pool_elem_type(model: ModelConfig, build: BuildConfig) -> int:
    """The ONNX element type (TensorProto.DataType) of the engine's `kv_cache` input: `kv_pool_dtype` in ONNX terms."""
    from onnx import helper

    return helper.np_dtype_to_tensor_dtype(kv_pool_dtype(model, build))


# ---- int4 packing: two values per byte, element 2j in the low nibble of byte j, 2j + 1 in the high nibble
# (ONNX Runtime MatMulNBits' B layout once reshaped to [out, in/group, group/2]) ---------------------------------
def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed int4 values q [..., n] in [-8, 7] -> uint8 [..., n/2] holding q + 8."""
    import numpy as np

    q = np.asarray(q)
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of values per row, got {q.shape[-1]}")
    nibbles = (q + INT4_ZERO_POINT).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> int8 [..., n] in [-8, 7] (the inverse of `pack_int4`)."""
    import numpy as np

    packed = np.asarray(packed)
    low = (packed & 0x0F).astype(np.int8) - INT4_ZERO_POINT
    high = (packed >> 4).astype(np.int8) - INT4_ZERO_POINT
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int4_torch(q: torch.Tensor) -> torch.Tensor:
    """`pack_int4` for torch tensors: signed int4 values q [..., n] in [-8, 7] -> uint8 [..., n/2] holding q + 8."""
    import torch

    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of values per row, got {q.shape[-1]}")
    u = (q.to(torch.int16) + INT4_ZERO_POINT).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4_torch(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> int8 [..., n] in [-8, 7] (the inverse of `pack_int4_torch`)."""
    import torch

    low = (packed & 0x0F).to(torch.int8) - INT4_ZERO_POINT
    high = (packed >> 4).to(torch.int8) - INT4_ZERO_POINT
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
