"""Read a llama-architecture GGUF file into Hugging Face form: an HF config dict and an HF-named float32 state dict.

The rest of the converter only deals with HF names. Tensors are dequantized with ``gguf.quants.dequantize``; the q/k
projections that llama.cpp's converter permuted for its RoPE layout are permuted back.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild.errors import CheckpointError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    **{f"attn_{p}.{w}": f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_REQUIRED_LAYER = [f"{n}.weight" for n in ("attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "attn_output")]
_REQUIRED_LAYER += [f"attn_{p}.weight" for p in "qkv"]


def _open(path: Path) -> Any:
    """Open ``path`` with gguf.GGUFReader, turning every failure into a CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}. Check the path (it must be a single .gguf file).")
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/IndexError/etc. on bad magic, truncation, unknown types
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}). It may be truncated or corrupt, or "
            "not GGUF at all; re-download or re-export it (e.g. with llama.cpp's convert_hf_to_gguf.py)."
        ) from None


def _fields(reader: Any) -> dict[str, Any]:
    """Metadata as plain Python values (strings decoded, arrays as lists, scalars unwrapped)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or key.startswith("GGUF."):
            continue
        vals = [
            bytes(field.parts[i]).decode("utf-8", errors="replace")
            if field.types[-1] == GGUFValueType.STRING
            else field.parts[i].tolist()[0]
            for i in field.data
        ]
        out[key] = vals if field.types[0] == GGUFValueType.ARRAY else (vals[0] if vals else None)
    return out


def _f32(x: float) -> float:
    """Shortest decimal that round-trips a float32 metadata value (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in rope_freqs.weight for rope_type llama3."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, out))


def _rope_scaling(meta: dict[str, Any], rope_freqs: np.ndarray | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    kind = str(meta.get("llama.rope.scaling.type", "none")).lower()
    factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear"))
    orig = meta.get("llama.rope.scaling.original_context_length")
    if rope_freqs is not None:  # llama 3.1+ : llama.cpp stores the llama3 frequency factors as a tensor
        rf = rope_freqs.astype(np.float64).ravel()
        scaling = {
            "rope_type": "llama3",
            "factor": _f32(rf.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(orig or 8192),
        }
        args = (scaling["factor"], 1.0, 4.0, scaling["original_max_position_embeddings"])
        if len(rf) * 2 == cfg["head_dim"] and np.allclose(
            _llama3_factors(cfg["rope_theta"], cfg["head_dim"], *args), rf, rtol=1e-4, atol=1e-4
        ):
            return scaling
        raise CheckpointError(
            "This GGUF has a rope_freqs.weight tensor that does not match llama3 RoPE scaling "
            "(low/high freq factor 1/4); such per-frequency RoPE factors are not supported."
        )
    if kind == "none" and factor and factor != 1.0:  # old files: llama.rope.scale_linear only
        kind = "linear"
    if kind in ("none", ""):
        return None
    if kind not in ("linear", "yarn") or not factor:
        raise CheckpointError(f"GGUF RoPE scaling type {kind!r} is not supported (only linear, yarn and llama3).")
    scaling = {"rope_type": kind, "factor": _f32(factor)}
    if orig:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


def _config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise CheckpointError(f"GGUF metadata lacks llama.{key}; the file is incomplete. Re-export it.")
        return meta[f"llama.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    head_dim = meta.get("llama.attention.key_length", meta.get("llama.rope.dimension_count", hidden // heads))
    vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else None
    vocab = vocab or meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads),
        "head_dim": int(head_dim),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for ours, theirs in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{theirs}_token_id" in meta:
            cfg[f"{ours}_token_id"] = int(meta[f"tokenizer.ggml.{theirs}_token_id"])
    if (scaling := _rope_scaling(meta, rope_freqs, cfg)) is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permute (reshape(n_head, 2, d/2, ...).swapaxes(1, 2)) back to HF's rotate_half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(path: Path, t: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    if t.tensor_type in (Q.F32, Q.F16, Q.F64):
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{path}: tensor {t.name} uses GGML type {t.tensor_type.name}, which this gguf package cannot "
                "dequantize. Use a GGUF quantized as F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K, or upgrade gguf."
            ) from None
        except ValueError as exc:
            raise CheckpointError(f"{path}: tensor {t.name} is corrupt ({exc}). Re-download the file.") from None
    arr = np.array(arr, dtype=np.float32, copy=True)  # own the memory: the reader's memmap is closed afterwards
    if not np.isfinite(arr).all():
        raise CheckpointError(f"{path}: tensor {t.name} contains NaN/Inf values; the file is corrupt. Re-download it.")
    return arr


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Return (hf_config_dict, hf_state_dict) for a llama-architecture GGUF, tensors dequantized to float32.

    Names follow transformers' LlamaForCausalLM (model.layers.{i}.self_attn.q_proj.weight, ...); Linear weights are
    [out, in]; lm_head.weight is absent when the embeddings are tied. Raises CheckpointError on any bad input.
    """
    path = Path(path)
    reader = _open(path)
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{path} has GGUF architecture {arch!r}; only llama-architecture GGUF files are supported "
            "(Llama, Mistral-style, SmolLM, TinyLlama ...). Convert the HF checkpoint instead."
        )
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope_freqs = None
    if "rope_freqs.weight" in shapes:
        rope_freqs = _dequantize(path, next(t for t in reader.tensors if t.name == "rope_freqs.weight"))
    cfg = _config(meta, shapes, rope_freqs)
    n_layers = cfg["num_hidden_layers"]
    missing = [n for n in ("token_embd.weight", "output_norm.weight") if n not in shapes]
    missing += [n for i in range(n_layers) for s in _REQUIRED_LAYER if (n := f"blk.{i}.{s}") not in shapes]
    if missing:
        raise CheckpointError(
            f"{path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}; it is "
            "incomplete or not a llama model. Re-export it."
        )
    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        m = _BLOCK_RE.fullmatch(t.name)
        if t.name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[t.name]
        elif m and m.group(2) in _LAYER_NAMES and int(m.group(1)) < n_layers:
            hf = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        else:
            raise CheckpointError(
                f"{path}: unexpected tensor {t.name!r} for a llama model; this GGUF variant is not supported."
            )
        arr = _dequantize(path, t)
        if m and m.group(2).startswith(("attn_q.", "attn_k.")):
            n_head = cfg["num_attention_heads"] if m.group(2).startswith("attn_q.") else cfg["num_key_value_heads"]
            arr = _unpermute(arr, n_head)
        state[hf] = arr
    del reader
    return cfg, state
