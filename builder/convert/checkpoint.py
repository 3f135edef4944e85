"""Reading and writing the unified checkpoint: `config.json` + `rank{N}.safetensors` + tokenizer files."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from trtbuild.builder.convert.names import (
    LINEAR_ATTENTION_TENSORS,
    MAMBA_LINEARS,
    MAMBA_TENSORS,
    model_linear_prefixes,
    tp_split_axis,
)
from trtbuild.builder.convert.safetensors_io import SafetensorsError, SafetensorsFile
from trtbuild.configs import ModelConfig
from trtbuild.configs.model_config import XIELU_PARAMETERS
from trtbuild.errors import CheckpointError
from trtbuild.quantization import QuantAlgo

CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"rank{rank}.safetensors"


def expected_tensors(config: ModelConfig, layers: Iterable[int], first_stage: bool, last_stage: bool) -> list[str]:
    """Every tensor name a rank holding `layers` must have (the contract `trtbuild build` relies on)."""
    layers = list(layers)
    names = ["transformer.vocab_embedding.weight"] if first_stage else []
    for i in layers:
        p = f"transformer.layers.{i}."
        if config.input_norms:
            names += [p + "input_layernorm.weight"]
        if config.input_norms and not config.parallel_residual and config.has_mlp(i):
            names += [p + "post_layernorm.weight"]
        if config.is_conv(i):
            names += [p + f"conv.{x}.weight" for x in ("in_proj", "kernel", "out_proj")]
            names += [p + f"conv.{x}.bias" for x in ("in_proj", "kernel", "out_proj")] if config.conv_bias else []
        elif config.is_linear_attention(i):
            names += [p + f"linear_attn.{x}" for x in LINEAR_ATTENTION_TENSORS]
        elif config.is_mamba(i):
            names += [p + f"{x}.weight" for x in MAMBA_LINEARS] + [p + f"mamba.{x}" for x in MAMBA_TENSORS]
            names += [p + "mamba.conv.bias"] if config.mamba_conv_bias else []
            names += [p + f"{x}.bias" for x in MAMBA_LINEARS] if config.mamba_proj_bias else []
        else:
            names += _attention_tensors(config, p)
        if config.output_norms:
            names += [p + "attention.output_norm.weight", p + "mlp.output_norm.weight"]
        names += _mlp_tensors(config, p, i) if config.has_mlp(i) else []  # Nemotron-H: not every layer has one
        if config.norm_bias:
            names += [p + n for n in ("input_layernorm.bias", "post_layernorm.bias")[:1 if config.parallel_residual
                                                                                        else 2]]
    if last_stage:
        names += ["transformer.ln_f.weight"] + (["transformer.ln_f.bias"] if config.norm_bias else [])
        names += ["lm_head.weight"] if config.has_lm_head else []
    q = config.quantization
    for prefix in model_linear_prefixes(config, layers, last_stage):
        names += q.scale_names(prefix)
    if q.embedding_weight_only and first_stage:
        names.append("transformer.vocab_embedding.weights_scaling_factor")
    if q.kv_cache_quant_algo is not None:
        names += [f"transformer.layers.{i}.attention.kv_cache_scaling_factor" for i in layers]
    return names


def _mlp_tensors(config: ModelConfig, p: str, i: int) -> list[str]:
    """The tensors of layer i's MLP or experts (`p`: its `transformer.layers.{i}.`)."""
    names: list[str] = []
    if config.has_experts(i):
        names += [p + "mlp.router.weight"] + [p + f"mlp.experts.{x}.weight" for x in ("gate", "fc", "proj")]
        names += [p + "mlp.router.selection_bias"] if config.moe_selection_bias else []
        if config.moe_bias:
            names += [p + "mlp.router.bias"] + [p + f"mlp.experts.{x}.bias" for x in ("gate", "fc", "proj")]
        if config.shared_expert_intermediate_size:
            names += [p + "mlp.shared_gate.weight"] if config.shared_expert_gated else []
            names += [p + f"mlp.shared.{x}.weight" for x in ("gate", "fc", "proj")]
    else:
        names += [p + f"mlp.act.{x}" for x in XIELU_PARAMETERS] if config.hidden_act == "xielu" else []
        mlp = ("gate", "fc", "proj") if config.gated_mlp else ("fc", "proj")
        names += [p + f"mlp.{x}.weight" for x in mlp] + ([p + f"mlp.{x}.bias" for x in mlp] if config.mlp_bias
                                                         else [])
    return names


def _attention_tensors(config: ModelConfig, p: str) -> list[str]:
    names = [p + "attention.dense.weight"] + [p + f"attention.{x}.weight" for x in "qkv"]
    names += [p + "attention.gate.weight"] if config.attention_output_gate else []
    if config.qkv_bias:
        names += [p + f"attention.{x}.bias" for x in "qkv"]
    if config.dense_bias:
        names += [p + "attention.dense.bias"]
    if config.attention_sinks:
        names += [p + "attention.sinks"]
    if config.qk_norm:
        names += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"]
    return names


def prepare_output_dir(out_dir: Path) -> None:
    """Create `out_dir`; refuse a non-empty one so that nothing a user made is ever overwritten."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CheckpointError(f"output folder {out_dir} exists and is not empty; choose a new folder or remove it.")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the output folder {out_dir} ({e.strerror}); choose a folder you can "
                              "write to.") from None


def remove_partial_output(out_dir: Path) -> None:
    """Remove what a failed convert / quantize / build wrote into its (freshly created) output folder."""
    shutil.rmtree(out_dir, ignore_errors=True)


def copy_tokenizer_files(src_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, out_dir / name)
            copied.append(name)
    return copied


def save_rank(ckpt_dir: Path, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(rank_file(ckpt_dir, rank)), metadata={"format": "pt"})


def expected_shape(name: str, c: ModelConfig) -> tuple[int, ...] | None:
    """The full-precision shape of checkpoint tensor `name` in a single-rank checkpoint (None: not a fixed one)."""
    suffix = name.split(".", 3)[-1] if name.startswith("transformer.layers.") else name
    return {
        "transformer.vocab_embedding.weight": (c.vocab_size, c.hidden_size),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
        "transformer.ln_f.weight": (c.hidden_size,),
        "transformer.ln_f.bias": (c.hidden_size,),
        "input_layernorm.weight": (c.hidden_size,),
        "post_layernorm.weight": (c.hidden_size,),
        "input_layernorm.bias": (c.hidden_size,),
        "post_layernorm.bias": (c.hidden_size,),
        "attention.output_norm.weight": (c.hidden_size,),
        "mlp.output_norm.weight": (c.hidden_size,),
        "attention.q.weight": (c.q_size, c.hidden_size),
        "attention.k.weight": (c.kv_size, c.hidden_size),
        "attention.v.weight": (c.kv_size, c.hidden_size),
        "attention.q.bias": (c.q_size,),
        "attention.k.bias": (c.kv_size,),
        "attention.v.bias": (c.kv_size,),
        "attention.q_norm.weight": (c.q_size if c.qk_norm_full else c.head_size,),
        "attention.k_norm.weight": (c.kv_size if c.qk_norm_full else c.head_size,),
        "attention.dense.weight": (c.hidden_size, c.q_size),
        "attention.gate.weight": (c.q_size, c.hidden_size),
        "attention.dense.bias": (c.hidden_size,),
        "attention.sinks": (c.num_attention_heads,),
        **{f"mlp.act.{x}": (1,) for x in XIELU_PARAMETERS},
        "mlp.gate.weight": (c.intermediate_size, c.hidden_size),
        "mlp.fc.weight": (c.intermediate_size, c.hidden_size),
        "mlp.proj.weight": (c.hidden_size, c.intermediate_size),
        "mlp.gate.bias": (c.intermediate_size,),
        "mlp.fc.bias": (c.intermediate_size,),
        "mlp.proj.bias": (c.hidden_size,),
        "conv.in_proj.weight": (3 * c.hidden_size, c.hidden_size),
        "conv.in_proj.bias": (3 * c.hidden_size,),
        "conv.kernel.weight": (c.hidden_size, c.conv_kernel),
        "conv.kernel.bias": (c.hidden_size,),
        "conv.out_proj.weight": (c.hidden_size, c.hidden_size),
        "conv.out_proj.bias": (c.hidden_size,),
        "linear_attn.in_proj_qkv.weight": (2 * c.linear_key_size + c.linear_value_size, c.hidden_size),
        "linear_attn.in_proj_z.weight": (c.linear_value_size, c.hidden_size),
        "linear_attn.in_proj_b.weight": (c.linear_num_value_heads, c.hidden_size),
        "linear_attn.in_proj_a.weight": (c.linear_num_value_heads, c.hidden_size),
        "linear_attn.conv.weight": (2 * c.linear_key_size + c.linear_value_size, c.conv_kernel),
        "linear_attn.A": (c.linear_num_value_heads,),
        "linear_attn.dt_bias": (c.linear_num_value_heads,),
        "linear_attn.norm.weight": (c.linear_value_head_dim,),
        "linear_attn.out_proj.weight": (c.hidden_size, c.linear_value_size),
        **_mamba_shapes(c),
        "mlp.router.weight": (c.num_experts, c.hidden_size),
        "mlp.router.bias": (c.num_experts,),
        "mlp.router.selection_bias": (c.num_experts,),
        "mlp.experts.gate.bias": (c.num_experts, c.moe_intermediate_size),
        "mlp.experts.fc.bias": (c.num_experts, c.moe_intermediate_size),
        "mlp.experts.proj.bias": (c.num_experts, c.hidden_size),
        "mlp.shared.gate.weight": (c.shared_expert_intermediate_size, c.hidden_size),
        "mlp.shared.fc.weight": (c.shared_expert_intermediate_size, c.hidden_size),
        "mlp.shared.proj.weight": (c.hidden_size, c.shared_expert_intermediate_size),
        "mlp.shared_gate.weight": (1, c.hidden_size),
        "mlp.experts.gate.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
        "mlp.experts.fc.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
        "mlp.experts.proj.weight": (c.num_experts, c.hidden_size, c.moe_intermediate_size),
    }.get(suffix)


def _mamba_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    inner, heads = c.mamba_inner_size, c.mamba_num_heads
    channels = inner + 2 * c.mamba_num_groups * c.mamba_state_size
    return {"mamba.in_proj.weight": (inner + channels + heads, c.hidden_size), "mamba.in_proj.bias": (
        inner + channels + heads,), "mamba.conv.weight": (channels, c.conv_kernel), "mamba.conv.bias": (channels,),
        **{f"mamba.{n}": (heads,) for n in ("A", "dt_bias", "D")}, "mamba.norm.weight": (inner,),
        "mamba.out_proj.weight": (c.hidden_size, inner), "mamba.out_proj.bias": (c.hidden_size,)}


def stored_shape(name: str, config: ModelConfig, quantized: bool = False) -> tuple[int, ...] | None:
    """The shape tensor `name` has in one rank of the checkpoint (None: not a fixed one, or told by other tensors).

    `quantized`: the tensor is the weight of a linear that carries scales, in `QuantConfig.algo_of`'s format: fp8
    and int8 keep [out, in], int4_awq packs two values per byte ([out, in/2]), and weight_only linears have their
    own bits (checked where they are read)."""
    want = expected_shape(name, config)
    if want is None:
        return None
    if quantized:
        algo = config.quantization.algo_of(name.removesuffix(".weight"))
        if algo == QuantAlgo.WEIGHT_ONLY or config.quantization.embedding_weight_only and "vocab_embedding" in name:
            return None
        if algo == QuantAlgo.INT4_AWQ:
            want = (want[0], want[1] // 2)
    axis, tp = tp_split_axis(name, qk_norm_full=config.qk_norm_full), config.mapping.tp_size
    if axis is not None and tp > 1:  # NOTE: ceil: vocab-parallel tensors are padded to a multiple of tp_size rows
        want = tuple(-(-n // tp) if i == axis % len(want) else n for i, n in enumerate(want))
    return want


def check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse tensors whose shapes do not match config.json (and, for a TP rank, its share of it)."""
    for name, shape in shapes.items():
        quantized = name.removesuffix(".weight") + ".weights_scaling_factor" in shapes
        want = stored_shape(name, config, quantized)
        if want is not None and tuple(shape) != want:
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(shape)} but config.json implies {want}; "
                                  "the weights and config.json do not belong together.")


def open_checkpoint(ckpt_dir: Path, rank: int = 0) -> tuple[ModelConfig, SafetensorsFile]:
    """Open one rank without reading its tensors (each is read when looked up), after checking that it holds every
    tensor the builder needs, with the shapes config.json implies."""
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt_dir} does not exist; create it with `trtbuild convert`.")
    config = ModelConfig.load(ckpt_dir / CONFIG_FILE)
    path = rank_file(ckpt_dir, rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete, re-run `trtbuild convert`.")
    try:
        tensors = SafetensorsFile(path)
    except (SafetensorsError, OSError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); re-run `trtbuild convert`.") from None
    mapping = config.mapping
    needed = expected_tensors(
        config,
        mapping.layers_of(rank, config.num_hidden_layers),
        first_stage=mapping.pp_rank(rank) == 0,
        last_stage=mapping.pp_rank(rank) == mapping.pp_size - 1,
    )
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} tensors (first: {missing[0]}); re-run `trtbuild convert`.")
    check_shapes(config, {n: tensors.shape(n) for n in needed}, str(path))
    return config, tensors


def load_checkpoint(ckpt_dir: Path, rank: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`open_checkpoint`, with every tensor read into memory."""
    config, tensors = open_checkpoint(ckpt_dir, rank)
    try:
        return config, dict(tensors.items())
    except (SafetensorsError, OSError) as e:
        raise CheckpointError(f"{tensors.path} is corrupt ({e}); re-run `trtbuild convert`.") from None
