"""Nemotron-H's tensors (`backbone.layers.{j}.mixer.*`, one block a layer) under the names of trtbuild's layers, a mixer
then its MLP (configs/nemotron_h.py): HF layer j's mixer and norm become layer i's attention (`self_attn.*`) or
Mamba2 (`mamba.*`) and its input_layernorm, the MLP after it layer i's `mlp.*` and post_attention_layernorm."""

from __future__ import annotations

import re

from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.configs import ModelConfig
from trtbuild.errors import CheckpointError

_GLOBAL = {"backbone.embeddings.weight": "model.embed_tokens.weight", "backbone.norm_f.weight": "model.norm.weight"}
# NOTE: a GGUF's come as model.layers.{j}.* (builder/convert/gguf_granite_hybrid.py)
_LAYER = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(norm\.weight|mixer\.(.+))$")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def hf_layer_of(config: ModelConfig) -> dict[int, tuple[int, str]]:
    """HF layer index -> (trtbuild layer, "mixer" | "mlp")."""
    out, j = {}, 0
    for i in range(config.num_hidden_layers):
        out[j] = (i, "mixer")
        j += 1
        if config.has_mlp(i):
            out[j] = (i, "mlp")
            j += 1
    return out


def as_layer_pairs(sources: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """`sources` renamed (see the module's docstring); other families' as they are."""
    if config.family != "nemotron_h":
        return sources
    layers, out = hf_layer_of(config), {}
    for name, src in sources.items():
        if name in _GLOBAL or name == "lm_head.weight":
            out[_GLOBAL.get(name, name)] = src
            continue
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) not in layers:
            out[name] = src  # NOTE: not a tensor of the model's layers: checkpoint_plan drops it
            continue
        i, block = layers[int(m.group(1))]
        part = m.group(3)
        if part is None:
            ours = "input_layernorm.weight" if block == "mixer" else "post_attention_layernorm.weight"
        elif block == "mlp":
            ours = f"mlp.{part}"
        elif config.is_mamba(i):
            ours = f"mamba.{part}"
        elif part.split(".")[0] in _ATTENTION:
            ours = f"self_attn.{part}"
        else:
            raise CheckpointError(f"{name}: a Nemotron-H attention layer has no {part!r}; the weights do not fit the "
                                  "config's layer pattern.")
        out[f"model.layers.{i}.{ours}"] = src
    return out
