"""Which pre-quantized Hugging Face checkpoints trtbuild reads, from their config's `quantization_config`.

Read as they are: gpt-oss's MXFP4 experts (builder/convert/mxfp4.py). Read dequantized: FP8 weights (e4m3) with
their scales, in the four forms releases use (builder/convert/fp8_weights.py multiplies each weight by its scale):

  quant_method        scale tensor            scale granularity            who ships it
  fp8                 <weight>_scale_inv      tensor or weight_block_size  Qwen3 / DeepSeek / Mistral FP8 releases
  compressed-tensors  <weight>_scale          tensor, channel or block     LLM Compressor ("FP8-dynamic", "FP8")
  modelopt (FP8)      <weight>_scale          tensor                       NVIDIA ModelOpt's exports
  fbgemm_fp8          <weight>_scale          channel                      Meta's Llama 3.1 405B FP8

Their activation and KV-cache scales are dropped: the engine computes activations in its own dtype (quantize the
result again with `trtbuild quantize` for an FP8 engine). Anything else (int4 / int8 packings, NVFP4, GPTQ, AWQ,
bitsandbytes) is refused with what to use instead: read as plain weights it would be a wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from trtbuild.errors import CheckpointError

_INSTEAD = ("trtbuild converts full-precision Hugging Face weights and FP8 releases: use the model's BF16 / FP16 "
            "release, or a GGUF file of it (then `trtbuild quantize` for FP8 / INT4-AWQ / INT8-SmoothQuant).")


@dataclass(frozen=True)
class Fp8Weights:
    """How an FP8 checkpoint stores its weights: `<weight name><scale_suffix>` holds each weight's scale, a weight =
    e4m3 value * scale; `block` is the (rows, columns) a 2-D scale covers when the config names it (None: taken
    from the scale's shape)."""

    method: str
    scale_suffix: str
    block: tuple[int, int] | None = None


def prequantized_weights(hf: dict[str, Any]) -> Fp8Weights | None:
    """The FP8 form of an HF config's weights; None for float weights and for the formats read as they are
    (MXFP4). Raises CheckpointError, saying what to use instead, for a quantization trtbuild does not read."""
    q = hf.get("quantization_config") if isinstance(hf, dict) else None  # a non-object config fails later
    if not q:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"the config's quantization_config is {type(q).__name__}, not an object.")
    method = q.get("quant_method")
    if method == "mxfp4":
        return None
    if method == "fp8":
        if q.get("expert_dtype", "fp8") != "fp8":
            _refuse(f"fp8 with {q['expert_dtype']!r} experts")
        return Fp8Weights("fp8", "_scale_inv", _block(q.get("weight_block_size"), "weight_block_size"))
    if method == "fbgemm_fp8":
        return Fp8Weights("fbgemm_fp8", "_scale")
    if method == "modelopt":
        algo = q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo")
        if algo != "FP8":
            _refuse(f"modelopt {algo!r}")
        return Fp8Weights("modelopt", "_scale")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    _refuse(repr(method))


def _compressed_tensors(q: dict[str, Any]) -> Fp8Weights:
    """LLM Compressor's configs: every group's weights must be 8-bit floats (format float-quantized)."""
    fmt = q.get("format")
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    if fmt not in ("float-quantized", "naive-quantized") or not weights or any(
            w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        kinds = sorted({f"{w.get('type')}{w.get('num_bits')}" for w in weights})
        _refuse(f"compressed-tensors {fmt!r} with {', '.join(kinds) or 'no'} weights")
    blocks = {_block(w.get("block_structure"), "block_structure") for w in weights if w.get("strategy") == "block"}
    if len(blocks) > 1:
        raise CheckpointError(f"the compressed-tensors config names several block structures {sorted(blocks)}; "
                              "trtbuild reads one per checkpoint.")
    return Fp8Weights("compressed-tensors", "_scale", blocks.pop() if blocks else None)


def _block(value: Any, key: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise CheckpointError(f"the quantization_config's {key} is {value!r}, not two positive integers.")
    return int(value[0]), int(value[1])


def _refuse(what: str) -> NoReturn:
    raise CheckpointError(f"this checkpoint is pre-quantized ({what} weights), which trtbuild does not read; "
                          + _INSTEAD)
