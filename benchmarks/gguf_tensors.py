"""How benchmarks/make_real_size_model.py writes a model's tensors into a GGUF as llama.cpp's converter does: q / k
rows permuted for llama.cpp's RoPE, llama 3's rope_freqs, and each tensor's GGML type and encoding."""

from __future__ import annotations

import numpy as np
from real_shapes import Shape


def llama_permute(x: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows in the order llama.cpp's convert_hf_to_gguf.py writes them (the two rotary halves interleaved)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def llama3_rope_freqs(shape: Shape) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for rope_type llama3: each frequency's divisor."""
    rs, dim = shape.rope_scaling, shape.head_dim
    wavelen = 2 * np.pi * shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    low_wavelen = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    high_wavelen = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
        rs["high_freq_factor"] - rs["low_freq_factor"])
    mid = 1 / ((1 - smooth) / rs["factor"] + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, rs["factor"], mid)).astype(np.float32)


def gguf_type(name: str, cols: int, form: str):
    """Q6_K for output, attn_v and ffn_down, Q5_K for a fused attn_qkv, Q4_K elsewhere (llama.cpp's Q4_K_M gives its
    most sensitive tensors more bits; Q8_0 where rows are not a multiple of 256, as it falls back too); None: float32.
    `form` f32 / f16: every matrix in that type, for llama.cpp's own `llama-quantize` to make the others from."""
    from gguf import GGMLQuantizationType as Q

    if form == "f32" or name.endswith(("norm.weight", ".bias", "shortconv.conv.weight", "ssm_conv1d.weight")) or \
            not name.endswith(".weight"):  # NOTE: ggml's ssm_conv reads float32 taps only; llama.cpp's converter
        return None  # writes them so, and any tensor not named .weight (Qwen3.5's ssm_a)
    if form == "f16":
        return Q.F16
    if name.endswith("attn_qkv.weight"):
        return Q.Q5_K
    if cols % 256:
        return Q.Q8_0
    return Q.Q6_K if name.split(".")[-2] in ("output", "attn_v", "ffn_down") else Q.Q4_K


def encode(x: np.ndarray, qtype) -> np.ndarray:
    import gguf
    from gguf_kquants import encode_q4_k, encode_q5_k, encode_q6_k

    if qtype is None:
        return x
    if x.ndim == 3 and qtype != gguf.GGMLQuantizationType.F16:  # stacked experts: their rows one after the other
        return encode(x.reshape(-1, x.shape[-1]), qtype)
    if qtype == gguf.GGMLQuantizationType.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q5_K:
        return encode_q5_k(x)
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        return gguf.quants.quantize(x, qtype)
    return (encode_q6_k if qtype == gguf.GGMLQuantizationType.Q6_K else encode_q4_k)(x)
