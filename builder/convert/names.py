"""Tensor names: Hugging Face -> unified checkpoint. One table serves every supported family.

Checkpoint names (linear weights are [out, in]; layer indices are global, so a pipeline rank's file says which
layers it holds):
  transformer.vocab_embedding.weight                         [vocab, hidden]          vocab-parallel
  transformer.layers.{i}.input_layernorm.weight              [hidden]                 replicated
  transformer.layers.{i}.attention.{q,k,v}.weight|bias       [heads*head_size, hidden] split by heads
  transformer.layers.{i}.attention.{q,k}_norm.weight         [head_size]              replicated (Qwen3)
  transformer.layers.{i}.attention.dense.weight              [hidden, heads*head_size] split by input columns
  transformer.layers.{i}.post_layernorm.weight               [hidden]                 replicated
  transformer.layers.{i}.mlp.{gate,fc}.weight                [inter, hidden]          split by rows
  transformer.layers.{i}.mlp.proj.weight                     [hidden, inter]          split by input columns
  transformer.ln_f.weight                                    [hidden]                 replicated
  lm_head.weight                                             [vocab, hidden]          vocab-parallel
"""

from __future__ import annotations

import re

_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_proj.weight": "attention.q.weight",
    "self_attn.k_proj.weight": "attention.k.weight",
    "self_attn.v_proj.weight": "attention.v.weight",
    "self_attn.q_proj.bias": "attention.q.bias",
    "self_attn.k_proj.bias": "attention.k.bias",
    "self_attn.v_proj.bias": "attention.v.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.o_proj.weight": "attention.dense.weight",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.fc.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
}
_GLOBAL_MAP = {
    "model.embed_tokens.weight": "transformer.vocab_embedding.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_CKPT_LAYER = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")

# How each checkpoint tensor is split over tensor-parallel ranks: axis to split, or None to replicate.
_SPLIT_AXIS = {
    "attention.q.weight": 0,
    "attention.k.weight": 0,
    "attention.v.weight": 0,
    "attention.q.bias": 0,
    "attention.k.bias": 0,
    "attention.v.bias": 0,
    "attention.dense.weight": 1,
    "mlp.gate.weight": 0,
    "mlp.fc.weight": 0,
    "mlp.proj.weight": 1,
    "transformer.vocab_embedding.weight": 0,
    "lm_head.weight": 0,
}


def hf_to_checkpoint_name(hf_name: str) -> str | None:
    """The checkpoint name of an HF tensor, or None for tensors the engine does not use (e.g. rotary inv_freq)."""
    if hf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[hf_name]
    m = _HF_LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"transformer.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def layer_of(name: str) -> int | None:
    m = _CKPT_LAYER.match(name)
    return int(m.group(1)) if m else None


def tp_split_axis(name: str) -> int | None:
    m = _CKPT_LAYER.match(name)
    return _SPLIT_AXIS.get(m.group(2) if m else name)
