"""Read a GGUF file (of an architecture in gguf_config.GGUF_ARCHITECTURES) into Hugging Face form: an HF config
dict and an HF-named float32 state dict.

The rest of the converter only deals with HF names. This module opens the file, reads its metadata and maps tensors to
HF names; `gguf_config.py` turns the metadata into the HF config and `gguf_tokenizer.py` rebuilds the tokenizer.
Tensors are read lazily: quantized blocks with an exact low-bit engine form become NBitsWeight
(`gguf_quants.py`), the rest are dequantized with ``gguf.quants.dequantize``; the q/k projections that llama.cpp's
converter permuted for its RoPE layout (llama, mistral) are permuted back.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, ROPE_TENSORS, hf_config, resolve_architecture
from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs.model_config import XIELU_PARAMETERS
from trtbuild.errors import CheckpointError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # StarCoder 2's LayerNorm and MLP biases
    "attn_norm.bias": "input_layernorm.bias",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    **{f"ffn_{p}.bias": f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")},
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    **{f"attn_{p}.{w}": f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")},
    **{f"attn_{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"},
    # a mixture of experts' router, and its experts stacked as builder/convert/experts.py names them
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{p}_exps.weight": f"mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    # gpt-oss: the router's and experts' biases, the attention sinks, and its pre-MLP norm's name
    "ffn_gate_inp.bias": "mlp.gate.bias",
    **{f"ffn_{p}_exps.bias": f"mlp.experts.{p}_proj.bias" for p in ("gate", "up", "down")},
    "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    # Qwen2-MoE's shared expert and its gate
    **{f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma 2 / 3's four norms (OLMo 2 has the two after attention and MLP)
_OUTPUT_NORM_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm.weight": "post_attention_layernorm.weight",
                            "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                            "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_FUSED_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                      "ffn_up.weight": "mlp.gate_up_proj.weight"}  # Phi-3 (builder/convert/fused.py splits them)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
log = logging.getLogger(__name__)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


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
            from trtbuild.builder.convert.gguf_quants import EXACT_NBITS

            types = "/".join(["F32", "F16", "BF16", *(q.name for q in EXACT_NBITS)])
            raise CheckpointError(
                f"{path}: tensor {t.name} uses GGML type {t.tensor_type.name}, which this gguf package cannot "
                f"dequantize. Use a GGUF quantized as {types}, or upgrade gguf."
            ) from None
        except ValueError as exc:
            raise CheckpointError(f"{path}: tensor {t.name} is corrupt ({exc}). Re-download the file.") from None
    arr = np.array(arr, dtype=np.float32, copy=True)  # own the memory: the reader's memmap is closed afterwards
    if not np.isfinite(arr).all():
        raise CheckpointError(f"{path}: tensor {t.name} contains NaN/Inf values; the file is corrupt. Re-download it.")
    return arr


def _load(path: Path, t: Any, shape: tuple[int, ...], n_head: int | None, quantized: bool) -> Any:
    """One tensor as float32 (or, when `quantized`, as the NBitsWeight of its blocks), q/k rows un-permuted."""
    if quantized:
        from trtbuild.builder.convert.gguf_quants import gguf_to_nbits

        w = gguf_to_nbits(np.asarray(t.data), t.tensor_type, shape)
        if n_head is None:
            return w
        return dataclasses.replace(w, codes=_unpermute(w.codes, n_head), scales=_unpermute(w.scales, n_head),
                                   zero_points=None if w.zero_points is None else _unpermute(w.zero_points, n_head))
    arr = _dequantize(path, t)
    return arr if n_head is None else _unpermute(arr, n_head)


def _nbits_form(t: Any, shape: tuple[int, ...]) -> tuple[int, int, bool] | None:
    """(bits, group size, has zero point) when the tensor's GGML type has an exact low-bit engine form."""
    from trtbuild.builder.convert.gguf_quants import EXACT_NBITS, has_zero_point

    if len(shape) != 2 or t.tensor_type not in EXACT_NBITS:
        return None
    bits, group = EXACT_NBITS[t.tensor_type]
    return bits, group, has_zero_point(t.tensor_type)


def _storage_dtype(path: Path, reader: Any) -> str:
    """float16 or bfloat16 when every matrix of the file is F16 (or every one BF16) and every F32 tensor (llama.cpp
    keeps norms and biases in F32) is exact in that type: the checkpoint then holds the file's values at half
    float32's size. float32 otherwise (and for any file with quantized tensors)."""
    import ml_dtypes
    from gguf import GGMLQuantizationType as Q

    narrow = {Q.F16: "float16", Q.BF16: "bfloat16"}
    types = {t.tensor_type for t in reader.tensors}
    matrices = {t.tensor_type for t in reader.tensors if len(t.shape) == 2}
    if not types <= {Q.F32, *narrow} or len(matrices) != 1 or (kind := next(iter(matrices))) not in narrow:
        return "float32"
    np_type = np.float16 if kind == Q.F16 else ml_dtypes.bfloat16
    for t in reader.tensors:
        if t.tensor_type == Q.F32 and t.name not in ROPE_TENSORS:  # they go into the config, not here
            values = _dequantize(path, t)
            if not np.array_equal(values.astype(np_type).astype(np.float32), values):
                return "float32"
    return narrow[kind]


def open_gguf(path: Path, keep_quantization: bool = True) -> tuple[dict[str, Any], dict[str, SourceTensor]]:
    """(hf_config_dict, HF name -> SourceTensor) of a GGUF of GGUF_ARCHITECTURES; a tensor is decoded when loaded.
    Names follow transformers' *ForCausalLM (model.layers.{i}.self_attn.q_proj.weight, ...; Phi-3's fused qkv_proj
    and gate_up_proj); Linear weights are [out, in]; lm_head.weight is absent when the embeddings are tied. With
    `keep_quantization`, 2-D tensors whose GGML type has an exact low-bit form (gguf_quants.EXACT_NBITS) load as
    NBitsWeight, the rest as float32. The config's torch_dtype is the file's 16-bit type where that holds every value
    exactly (`_storage_dtype`).
    Raises CheckpointError on any bad input.
    """
    path = Path(path)
    reader = _open(path)
    meta = _fields(reader)
    prefix, arch = resolve_architecture(meta, path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rope_tensors = {t.name: _dequantize(path, t) for t in reader.tensors if t.name in ROPE_TENSORS}
    cfg = hf_config(meta, prefix, arch, shapes, rope_tensors)
    cfg["torch_dtype"] = _storage_dtype(path, reader)
    n_layers = cfg["num_hidden_layers"]
    required = arch.layer_tensors
    layer_names = _FUSED_LAYER_NAMES if arch.fused else _OUTPUT_NORM_LAYER_NAMES if arch.output_norms else _LAYER_NAMES
    layer_names = {**layer_names, **dict(arch.renames)}
    allowed = {*required, *arch.optional_layer_tensors}
    permuted = ("attn_q.", "attn_k.") if arch.permute_qk else ()
    global_names = {**_GLOBAL_NAMES, arch.final_norm: "model.norm.weight"}
    missing = [n for n in ("token_embd.weight", arch.final_norm) if n not in shapes]
    missing += [n for i in range(n_layers) for s in required if (n := f"blk.{i}.{s}") not in shapes]
    if missing:
        raise CheckpointError(
            f"{path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}; it is "
            f"incomplete or not a {arch.model_type} model. Re-export it."
        )
    sources: dict[str, SourceTensor] = {}
    forms: dict[str, list[str]] = {}  # GGML type name -> what its tensors become, for the per-type report
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue
        m = _BLOCK_RE.fullmatch(t.name)
        if m and int(m.group(1)) >= n_layers and meta.get(f"{prefix}.nextn_predict_layers"):
            continue  # NOTE: a multi-token-prediction block after the model's layers (Qwen3.5), which is not used
        if t.name in global_names:
            hf = global_names[t.name]
        elif m and m.group(2) in allowed and int(m.group(1)) < n_layers:
            hf = f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}"
        else:
            raise CheckpointError(
                f"{path}: unexpected tensor {t.name!r} for a {arch.model_type} model; this GGUF variant is not "
                "supported."
            )
        n_head = None
        if m and m.group(2).startswith(permuted):
            n_head = cfg["num_attention_heads"] if m.group(2).startswith("attn_q.") else cfg["num_key_value_heads"]
        shape = shapes[t.name]
        # NOTE: stacked experts [experts, out, in] load as the weight-only linear [experts * out, in] of their rows
        rows = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) == 3 and "_exps." in t.name else shape
        nbits = _nbits_form(t, rows) if keep_quantization else None
        sources[hf] = SourceTensor(shape, lambda t=t, s=rows, h=n_head, q=nbits is not None: _load(path, t, s, h, q),
                                   nbits)
        forms.setdefault(t.tensor_type.name, []).append(hf)
    if arch.hidden_act == "xielu":
        sources.update(_xielu_scalars(meta, n_layers, path))
    if keep_quantization:
        _report_forms(forms, sources)
    return cfg, sources


def _xielu_scalars(meta: dict[str, Any], n_layers: int, path: Path) -> dict[str, SourceTensor]:
    """Apertus's xIELU scalars, which llama.cpp writes as metadata (xielu.alpha_p, ...: one value per layer, or one
    for all), as the HF model's per-layer `mlp.act_fn.*` tensors."""
    out = {}
    for name in XIELU_PARAMETERS:
        values = meta.get(f"xielu.{name}")
        values = [values] * n_layers if isinstance(values, int | float) else values
        if not isinstance(values, list) or len(values) != n_layers:
            raise CheckpointError(f"{path} lacks xielu.{name} (a value per layer) for its xIELU activation; the file "
                                  "is incomplete: re-export it.")
        for i, v in enumerate(values):
            out[f"model.layers.{i}.mlp.act_fn.{name}"] = SourceTensor((1,), lambda v=v: np.array([v], np.float32))
    return out


def _report_forms(forms: dict[str, list[str]], sources: dict[str, SourceTensor]) -> None:
    """Say, per GGML type, whether its tensors keep their quantization exactly or become float."""
    from trtbuild.builder.convert.gguf_quants import EXACT_NBITS

    exact = {t.name for t in EXACT_NBITS}
    for qtype, names in sorted(forms.items()):
        quantized = [n for n in names if sources[n].nbits]
        if quantized:
            bits, group, zp = sources[quantized[0]].nbits
            log.info("GGUF %s: %d tensors kept exactly as %d-bit weights in groups of %d%s", qtype, len(quantized),
                     bits, group, " with float zero points" if zp else "")
        elif qtype not in exact and qtype not in ("F32", "F16", "BF16"):
            log.warning("GGUF %s: %d tensors have no exact low-bit form in trtbuild (builder/convert/gguf_quants.py "
                        "lists the types that have one); they are dequantized to float32, the nearest larger form",
                        qtype, len(names))


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(hf_config_dict, hf_state_dict) of a GGUF, every tensor dequantized to float32 (see `open_gguf`)."""
    cfg, sources = open_gguf(path, keep_quantization=False)
    return cfg, {name: s.load() for name, s in sources.items()}


_LORA_RE = re.compile(r"blk\.(\d+)\.(.+\.weight)\.lora_([ab])")


def read_gguf_lora(path: Path, num_heads: int, num_kv_heads: int
                   ) -> tuple[float, dict[tuple[int, str], dict[str, np.ndarray]]]:
    """(alpha, (layer, HF module such as "self_attn.q_proj") -> {"A": [r, in], "B": [out, r]} float32) of a LoRA
    adapter written by llama.cpp's convert_lora_to_gguf.py. B's q / k rows are permuted back where the converter
    permuted them with the base model's (its `num_heads` / `num_kv_heads` heads). Raises CheckpointError."""
    path = Path(path)
    reader = _open(path)
    meta = _fields(reader)
    kind = (meta.get("general.type"), meta.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise CheckpointError(f"{path} is not a LoRA adapter GGUF (general.type {kind[0]!r}, adapter.type "
                              f"{kind[1]!r}); write one from a PEFT adapter with llama.cpp's convert_lora_to_gguf.py.")
    arch = GGUF_ARCHITECTURES.get(meta.get("general.architecture"))
    if arch is None:
        raise CheckpointError(f"{path}: an adapter of architecture {meta.get('general.architecture')!r}; trtbuild "
                              f"reads {', '.join(GGUF_ARCHITECTURES)}.")
    names = {**(_FUSED_LAYER_NAMES if arch.fused else _LAYER_NAMES), **dict(arch.renames)}  # the HF modules'
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        m = _LORA_RE.fullmatch(t.name)
        if m is None or m.group(2) not in names:
            raise CheckpointError(f"{path}: tensor {t.name!r} is not the LoRA A or B of a layer's linear (adapters "
                                  "that also hold norms or embeddings are not supported).")
        w = _dequantize(path, t).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        if m.group(3) == "b" and arch.permute_qk and m.group(2) in ("attn_q.weight", "attn_k.weight"):
            w = _unpermute(w, num_heads if m.group(2) == "attn_q.weight" else num_kv_heads)
        module = names[m.group(2)].removesuffix(".weight")
        pairs.setdefault((int(m.group(1)), module), {})[m.group(3).upper()] = w
    return float(meta.get("adapter.lora.alpha") or 0.0), pairs
