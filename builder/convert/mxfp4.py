"""Hugging Face MXFP4 tensors (gpt-oss's released expert weights) -> the weight-only form GGUF's MXFP4 tensors take.

The checkpoint stores a weight [experts, out, in] as `_blocks` uint8 [experts, out, in / 32, 16] (two e2m1 codes a
byte, element 2j in the low nibble of byte j, 2j + 1 in the high one) and `_scales` uint8 [experts, out, in / 32]
(an E8M0 exponent per 32: value = e2m1 * 2^(scale - 127)). ggml's MXFP4 block is the same exponent byte then the
same codes with element j in the low nibble of byte j and j + 16 in the high one, and values doubled under a scale
halved (2^(e - 128)): the same numbers. So the blocks are re-laid out byte for byte and decoded as a GGUF tensor
(builder/convert/gguf_quants.py), exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.errors import CheckpointError

BLOCK = 32


def ggml_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF `_blocks` [..., n, 16] and `_scales` [..., n] -> ggml MXFP4 blocks uint8 [..., n * 17]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], BLOCK)  # element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(*scales.shape[:-1], -1)


def mxfp4_experts(blocks: SourceTensor, scales: SourceTensor, index: int, step: int, shape: tuple[int, int, int],
                  where: str) -> SourceTensor:
    """The stacked experts [experts, rows, in] that are rows index, index + step, ... of each expert's MXFP4
    weight (`step` 2: gpt-oss's interleaved gate and up), loading as the NBitsWeight [experts * rows, in]."""
    from gguf import GGMLQuantizationType

    from trtbuild.builder.convert.gguf_quants import EXACT_NBITS, gguf_to_nbits

    experts, rows, columns = shape
    want_blocks = (experts, rows * step, columns // BLOCK, BLOCK // 2)
    if columns % BLOCK or tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_blocks[:3]:
        raise CheckpointError(f"{where}_blocks / _scales have shapes {list(blocks.shape)} / {list(scales.shape)}, "
                              f"not {list(want_blocks)} / {list(want_blocks[:3])}; the weights do not fit the config.")
    qtype = GGMLQuantizationType.MXFP4

    def load() -> object:
        b = torch.as_tensor(blocks.load())[:, index::step].numpy()
        s = torch.as_tensor(scales.load())[:, index::step].numpy()
        if b.dtype != np.uint8 or s.dtype != np.uint8:
            raise CheckpointError(f"{where}_blocks / _scales must be uint8, got {b.dtype} / {s.dtype}.")
        return gguf_to_nbits(ggml_blocks(b, s).reshape(experts * rows, -1), qtype, (experts * rows, columns))

    bits, group = EXACT_NBITS[qtype]
    return SourceTensor(shape, load, (bits, group, False))
