"""LoRA adapters built into an engine beside the base weights and chosen per request (multi-LoRA, as vLLM's
`--lora-modules` and TensorRT-LLM's LoRA plugin serve them).

An adapted linear y = x W^T becomes y = x W^T + scale * (x A^T) B^T under the request's adapter (A [r, in],
B [out, r]; scale = alpha / r, or alpha / sqrt(r) with rsLoRA). The engine holds all of its adapters side by side:
per adapted linear, `P.lora_a` [R, in] stacks the adapters' A rows (R: the sum of their ranks) and `P.lora_b`
[out, R] their B columns times their scale, zero where an adapter leaves that linear alone. The network computes

    y += ((x @ lora_a^T) * mask) @ lora_b^T,        mask = lora_table[lora_ids]   [tokens, R]

with `lora_ids` [tokens] an engine input naming each packed token's adapter (0: the base model, i: the i-th) and
row i of `lora_table` one over adapter i's columns: one step may mix adapters, each token computing its own
adapter's delta exactly, at R x (in + out) extra multiply-adds per adapted linear. The CPU target's native float
linears replace each such branch by one op that reads only the token's adapter (builder/native_lora.py).

Adapters are read as PEFT saves them (`adapter_config.json` + `adapter_model.safetensors`) or as llama.cpp's
convert_lora_to_gguf.py writes them (a .gguf; builder/convert/gguf_reader.py), onto the checkpoint's names
(builder/convert/names.py), before any row reordering the network applies to the base weights (a partial-rotary
model's q / k rows: builder/rope.py reorders `lora_b` with them).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.configs.model_config import LFM2_FAMILIES
from trtbuild.errors import TrtbuildError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# A PEFT target module (the HF linear's name inside its layer) -> the checkpoint linears it adapts; a fused source
# projection (Phi-3's) adapts several, its B rows split among them in order
_TARGETS: dict[str, tuple[str, ...]] = {
    "self_attn.q_proj": ("attention.q",),
    "self_attn.k_proj": ("attention.k",),
    "self_attn.v_proj": ("attention.v",),
    "self_attn.o_proj": ("attention.dense",),
    "mlp.gate_proj": ("mlp.gate",),
    "mlp.up_proj": ("mlp.fc",),
    "mlp.down_proj": ("mlp.proj",),
    "self_attn.qkv_proj": ("attention.q", "attention.k", "attention.v"),
    "mlp.gate_up_proj": ("mlp.gate", "mlp.fc"),
    "mlp.c_fc": ("mlp.fc",),  # StarCoder 2's MLP
    "mlp.c_proj": ("mlp.proj",),
}
# LFM2's names, and its convolution layers' projections
_LFM2_TARGETS: dict[str, tuple[str, ...]] = {
    **{k: v for k, v in _TARGETS.items() if k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
    "self_attn.out_proj": ("attention.dense",),
    "feed_forward.w1": ("mlp.gate",),
    "feed_forward.w3": ("mlp.fc",),
    "feed_forward.w2": ("mlp.proj",),
    "conv.in_proj": ("conv.in_proj",),
    "conv.out_proj": ("conv.out_proj",),
}


def _targets(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """HF module (`self_attn.q_proj`) -> the checkpoint linears it adapts, in `config`'s family's names."""
    return _LFM2_TARGETS if config.family in LFM2_FAMILIES else _TARGETS


_SIBLINGS = (("attention.q", "attention.k", "attention.v"), ("mlp.gate", "mlp.fc"))
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(.+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


class LoraError(TrtbuildError):
    pass


def check_adapter_name(name: str) -> None:
    if not _NAME.match(name):
        raise LoraError(f"LoRA adapter name {name!r}: use 1-64 letters, digits, '_', '.', ':' or '-', starting with "
                        "a letter or digit (clients ask for the adapter by this name).")


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear of a layer that an adapter may adapt (the dense MLP's only for a dense model)."""
    q, kv, h = config.num_attention_heads * config.head_size, config.num_key_value_heads * config.head_size, \
        config.hidden_size
    shapes = {"attention.q": (q, h), "attention.k": (kv, h), "attention.v": (kv, h), "attention.dense": (h, q)}
    if not config.is_moe:
        i = config.intermediate_size
        shapes.update({"mlp.gate": (i, h), "mlp.fc": (i, h), "mlp.proj": (h, i)})
    if "conv" in config.layer_types:
        shapes.update({"conv.in_proj": (3 * h, h), "conv.out_proj": (h, h)})
    return shapes


def layer_has(config: ModelConfig, layer: int, linear: str) -> bool:
    """Whether layer `layer` has the linear `linear` (a `linear_shapes` key): LFM2's convolution layers have their
    in / out projections in place of the attention's."""
    return linear.startswith("conv.") == config.is_conv(layer) or linear.startswith("mlp.")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter on the checkpoint's names: linear prefix (`transformer.layers.{i}.attention.q`) -> (A [r, in],
    B [out, r] already multiplied by its scale), float32."""

    name: str
    rank: int  # the largest of its linears' ranks: the columns it takes in the engine's tables
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def _alpha(cfg: dict[str, Any], module: str) -> float:
    """lora_alpha, or the `alpha_pattern` entry whose key matches the module's name (PEFT's suffix match)."""
    for key, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(cfg["lora_alpha"])


def _read_config(path: Path) -> dict[str, Any]:
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise LoraError(f"{path} is not a PEFT LoRA adapter folder (no {ADAPTER_CONFIG}); pass the folder that "
                        "`model.save_pretrained()` of a peft model wrote.")
    try:
        cfg = json.loads(file.read_bytes())
    except ValueError as e:
        raise LoraError(f"{file} is not valid JSON ({e}).") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{file}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r}; trtbuild "
                        "builds LoRA adapters only.")
    unsupported = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained extra modules)",
                   "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoraError(f"{file}: {what} is not supported; train the adapter without it or merge it into the "
                            "base model before converting.")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{file}: bias {cfg['bias']!r} trains the base model's biases too; only bias \"none\" "
                        "adapters are supported.")
    if not isinstance(cfg.get("lora_alpha"), int | float) or isinstance(cfg.get("lora_alpha"), bool):
        raise LoraError(f"{file}: lora_alpha must be a number, got {cfg.get('lora_alpha')!r}.")
    return cfg


# (layer, HF module) -> {"A": [r, in], "B": [out, r]}, and what multiplies B: f(HF module, rank)
Pairs = dict[tuple[int, str], dict[str, np.ndarray]]
ScaleOf = Callable[[str, int], float]


def _peft_pairs(path: Path) -> tuple[Pairs, ScaleOf]:
    from trtbuild.builder.convert.safetensors_io import SafetensorsError, SafetensorsFile

    cfg = _read_config(path)
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        bin_file = path / "adapter_model.bin"
        hint = " (it has adapter_model.bin: save it with safe_serialization=True)" if bin_file.exists() else ""
        raise LoraError(f"{path} has no {ADAPTER_WEIGHTS}{hint}.")
    try:
        tensors = SafetensorsFile(file)
    except (SafetensorsError, OSError) as e:
        raise LoraError(f"{file} is not a readable safetensors file ({e}).") from None
    pairs: Pairs = {}
    for key in tensors:
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"{file}: tensor {key!r} is not a LoRA A / B weight of a decoder layer; trtbuild adapts "
                            f"only the layers' linears ({', '.join(_TARGETS)}).")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensors[key].to(torch.float32).numpy()
    return pairs, lambda module, r: _alpha(cfg, module) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _gguf_pairs(path: Path, config: ModelConfig) -> tuple[Pairs, ScaleOf]:
    """llama.cpp's adapter file, scaled as llama.cpp scales it: alpha / rank, or 1 where alpha is 0."""
    from trtbuild.builder.convert.gguf_reader import read_gguf_lora
    from trtbuild.errors import CheckpointError

    try:
        alpha, pairs = read_gguf_lora(path, config.num_attention_heads, config.num_key_value_heads)
    except CheckpointError as e:
        raise LoraError(e.message) from None
    return pairs, lambda module, r: alpha / r if alpha else 1.0


def read_adapter(name: str, path: Path, config: ModelConfig) -> LoraAdapter:
    """The adapter at `path` (a PEFT adapter folder, or llama.cpp's LoRA .gguf), checked against the base model
    `config` before it is built in."""
    check_adapter_name(name)
    path = Path(path)
    if not path.exists():
        raise LoraError(f"LoRA adapter {name!r}: {path} does not exist (an engine's adapters are read from their "
                        "paths when it is built, and again by `trtbuild verify`).")
    if path.is_file():
        pairs, scale_of = _gguf_pairs(path, config)
    else:
        pairs, scale_of = _peft_pairs(path)
    shapes, weights, targets = linear_shapes(config), {}, _targets(config)
    for (layer, module), ab in sorted(pairs.items()):
        where = f"{path}: layer {layer} {module}"
        if module not in targets or any(t not in shapes for t in targets[module]):
            kind = "a mixture of experts' MLP" if config.is_moe and module.startswith("mlp.") else "this module"
            allowed = [m.split(".")[-1] for m, t in targets.items() if len(t) == 1 and t[0] in shapes]
            raise LoraError(f"{where}: trtbuild does not adapt {kind}; train the adapter with target_modules among "
                            f"{', '.join(allowed)}.")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where} has lora_{'A' if 'A' not in ab else 'B'} missing; the file is incomplete.")
        if not 0 <= layer < config.num_hidden_layers:
            raise LoraError(f"{where}: the base model has {config.num_hidden_layers} layers; is this adapter for "
                            "another model?")
        if not all(layer_has(config, layer, t) for t in targets[module]):
            raise LoraError(f"{where}: the base model's layer {layer} is a {config.layer_types[layer]} layer, which "
                            "has no such linear; is this adapter for another model?")
        a, b = ab["A"], ab["B"]
        outs, fan_in = [shapes[t][0] for t in targets[module]], shapes[targets[module][0]][1]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape != (sum(outs), r) or a.shape[1] != fan_in or r < 1:
            raise LoraError(f"{where}: A {list(a.shape)} and B {list(b.shape)} do not fit the base model's "
                            f"[{sum(outs)}, {fan_in}] linear; is this adapter for another model?")
        scaled = b * np.float32(scale_of(module, r))
        for target, rows in zip(targets[module], np.split(scaled, np.cumsum(outs)[:-1]), strict=True):
            weights[f"transformer.layers.{layer}.{target}"] = (a, np.ascontiguousarray(rows))
    if not weights:
        raise LoraError(f"{path} holds no LoRA weights.")
    return LoraAdapter(name, max(a.shape[0] for a, _ in weights.values()), weights)


class LoraTables(Mapping):
    """Every adapter of an engine as the network reads them: `P.lora_a` [R, in] and `P.lora_b` [out, R] for each
    linear prefix P that any adapter adapts, and the mask table [1 + adapters, R]. Adapter i (1-based, as in
    `lora_ids`) owns columns offsets[i - 1] .. + its rank."""

    runtime = False  # the tables are engine inputs that the runtime fills (builder/lora_slots.py), not weights

    def __init__(self, adapters: list[LoraAdapter], shapes: dict[str, tuple[int, int]]) -> None:
        """`shapes`: linear_shapes of the base model."""
        self.adapters, self.shapes = adapters, shapes
        self.offsets = np.cumsum([0] + [a.rank for a in adapters])
        self.columns = int(self.offsets[-1])
        adapted = {p for a in adapters for p in a.weights}
        # NOTE: q / k / v, and gate / up, all or none: their deltas join before the fused GEMM's Split
        # (builder/passes/lora.py), where a zero table costs less than a Split that no longer fuses
        for prefix in list(adapted):
            layer, _, linear = prefix.rpartition(".layers.")[2].partition(".")
            for siblings in _SIBLINGS:
                if linear in siblings:
                    adapted.update(f"transformer.layers.{layer}.{s}" for s in siblings if s in shapes)
        self.prefixes = sorted(adapted)
        self._prefix_set = adapted

    def mask_table(self) -> np.ndarray:
        table = np.zeros((1 + len(self.adapters), self.columns), dtype=np.float32)
        for i in range(len(self.adapters)):
            table[1 + i, self.offsets[i] : self.offsets[i + 1]] = 1
        return table

    def shape(self, prefix: str) -> tuple[int, int]:
        """[out, in] of the linear at checkpoint prefix `prefix` (`transformer.layers.0.attention.q`)."""
        return self.shapes[prefix.rpartition(".layers.")[2].partition(".")[2]]

    def _stacked(self, prefix: str, which: int) -> np.ndarray:
        size = self.shape(prefix)[1 - which]  # in (of A), out (of B)
        out = np.zeros((self.columns, size) if which == 0 else (size, self.columns), dtype=np.float32)
        for i, adapter in enumerate(self.adapters):
            if prefix in adapter.weights:
                w = adapter.weights[prefix][which]
                cols = slice(self.offsets[i], self.offsets[i] + w.shape[which])  # its rank
                if which == 0:
                    out[cols] = w
                else:
                    out[:, cols] = w
        return out

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        prefix, _, kind = name.rpartition(".")
        return prefix in self._prefix_set and kind in ("lora_a", "lora_b")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        prefix, _, kind = name.rpartition(".")
        return torch.from_numpy(self._stacked(prefix, 0 if kind == "lora_a" else 1))

    def __iter__(self) -> Iterator[str]:
        return (f"{p}.{kind}" for p in self.prefixes for kind in ("lora_a", "lora_b"))

    def __len__(self) -> int:
        return 2 * len(self.prefixes)


class SlotTables(LoraTables):
    """The network's view of an engine's slots: `max_loras` empty adapters of rank `max_lora_rank` over every
    linear that an adapter may adapt, whose tables the network takes as engine inputs (`runtime`)."""

    runtime = True

    def __init__(self, config: ModelConfig, build: BuildConfig) -> None:
        shapes = linear_shapes(config)
        super().__init__([LoraAdapter(f"slot{s}", build.max_lora_rank, {}) for s in range(build.max_loras)], shapes)
        layers = range(config.num_hidden_layers)
        self.prefixes = [f"transformer.layers.{i}.{linear}" for i in layers for linear in shapes
                         if layer_has(config, i, linear)]
        self._prefix_set = set(self.prefixes)


class WithLora(Mapping):
    """A checkpoint's tensors with the LoRA tables beside them (lazy, as the checkpoint's)."""

    def __init__(self, tensors: Mapping[str, Any], lora: LoraTables) -> None:
        self.tensors, self.lora = tensors, lora

    def __getitem__(self, name: str) -> Any:
        return self.lora[name] if name in self.lora else self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        yield from self.lora

    def __len__(self) -> int:
        return len(self.tensors) + len(self.lora)

    def __contains__(self, name: object) -> bool:
        return name in self.lora or name in self.tensors

    def __getattr__(self, attr: str) -> Any:  # a lazy file's header lookups (dtype, shape)
        if attr in ("tensors", "lora"):
            raise AttributeError(attr)
        return getattr(self.tensors, attr)


def read_adapters(sources: tuple[tuple[str, str], ...], config: ModelConfig) -> LoraTables | None:
    """The engine's adapters from BuildConfig.lora_adapters ((name, path), ...); None without any."""
    if not sources:
        return None
    return LoraTables([read_adapter(name, Path(path), config) for name, path in sources], linear_shapes(config))
