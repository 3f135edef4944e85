"""`trtbuild convert`: HF folder or GGUF file -> unified checkpoint, sharded for tensor/pipeline parallelism.

Tensors stream through one at a time (read, rename, cast or quantize, shard, write), so memory holds about one
tensor, whatever the model's size. Names and shapes are checked from the source's headers before any tensor is read.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trtbuild.builder.convert.checkpoint import (
    CONFIG_FILE,
    check_shapes,
    copy_tokenizer_files,
    expected_shape,
    expected_tensors,
    prepare_output_dir,
    rank_file,
    remove_partial_output,
)
from trtbuild.builder.convert.experts import stack_experts
from trtbuild.builder.convert.fused import split_fused
from trtbuild.builder.convert.hf_reader import SourceTensor
from trtbuild.builder.convert.names import hf_to_checkpoint_name, is_linear, model_linear_prefixes
from trtbuild.builder.convert.nemotron_h import as_layer_pairs
from trtbuild.builder.convert.safetensors_io import SafetensorsWriter
from trtbuild.builder.convert.sharding import check_mapping, check_nbits_split, shard_for_rank
from trtbuild.configs import Mapping, ModelConfig
from trtbuild.configs.from_hf import model_config_from_hf, text_model_config
from trtbuild.configs.model_config import GEMMA_FAMILIES, QWEN35_FAMILIES
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.errors import CheckpointError, ConfigError
from trtbuild.quantization import QuantAlgo

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_ONLY_BITS = {"int8": 8, "int4": 4}
EMBEDDING = "transformer.vocab_embedding.weight"


@dataclasses.dataclass(frozen=True)
class WeightOnly:
    """`--weight-only`: round-to-nearest quantization of float linear weights (group_size None: per channel)."""

    bits: int
    group_size: int | None


def zero_centered_norm(name: str, config: ModelConfig) -> bool:
    """Whether HF tensor `name` is an RMSNorm weight w whose norm multiplies by 1 + w: every norm of Gemma's, and
    Qwen3.5's but the gated norm of its linear attention."""
    if config.family in QWEN35_FAMILIES:
        return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")
    return config.family in GEMMA_FAMILIES and name.endswith("norm.weight")


def norm_multipliers(source: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """An HF Gemma's (or Qwen3.5's) RMSNorm weights w as the multipliers 1 + w its RMSNorms apply (in float32): the
    checkpoint holds those, as llama.cpp's GGUF files do, so every target's plain RMSNorm computes them."""
    return {name: SourceTensor(src.shape, lambda src=src: torch.as_tensor(src.load()).to(torch.float32) + 1.0)
            if zero_centered_norm(name, config) else src for name, src in source.items()}


def conv_kernels(plan: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """Convolution kernels (LFM2's, Qwen3.5's linear attention's) as [channels, L]: Hugging Face keeps nn.Conv1d's
    [channels, 1, L]."""
    def flat(src: SourceTensor) -> SourceTensor:
        shape = (src.shape[0], config.conv_kernel)
        return SourceTensor(shape, lambda: torch.as_tensor(src.load()).reshape(shape))

    return {name: flat(src) if name.endswith(("conv.kernel.weight", "linear_attn.conv.weight", "mamba.conv.weight"))
            and len(src.shape) == 3 else src for name, src in plan.items()}


def xielu_scalars(plan: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """Apertus's xIELU scalars as [1] (Hugging Face keeps beta and eps as 0-d buffers)."""
    def one(src: SourceTensor) -> SourceTensor:
        return SourceTensor((1,), lambda: torch.as_tensor(src.load()).reshape(1))

    return {name: one(src) if ".mlp.act." in name else src for name, src in plan.items()}


def per_head_vectors(plan: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """A Mamba2 layer's A and D as [heads] and its norm as [inner]: llama.cpp's GGUF holds [heads, 1] and [groups,
    inner / groups]."""
    def flat(src: SourceTensor) -> SourceTensor:
        return SourceTensor((math.prod(src.shape),), lambda: torch.as_tensor(src.load()).reshape(-1))

    return {name: flat(src) if name.endswith(("mamba.A", "mamba.D", "mamba.norm.weight")) and len(src.shape) > 1
            else src for name, src in plan.items()}


def decay_rates(plan: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """Qwen3.5's linear attention decay rates A = -exp(A_log), as transformers computes them (in float32) and as
    llama.cpp's GGUF files hold them (ssm_a)."""
    out = {}
    for name, src in plan.items():
        if name.endswith(("linear_attn.A_log", "mamba.A_log")):
            name, src = name.removesuffix("_log"), SourceTensor(
                src.shape, lambda src=src: -torch.exp(torch.as_tensor(src.load()).to(torch.float32)))
        out[name] = src
    return out


def keeps_float32(name: str, config: ModelConfig) -> bool:
    """Gemma's norm multipliers stay float32 in a 16-bit checkpoint: 1 + w in bfloat16 would round w away; so do
    Apertus's xIELU scalars (read once, as constants)."""
    zero_centered = config.family in (*GEMMA_FAMILIES, *QWEN35_FAMILIES) and \
        name.endswith(("norm.weight", "ln_f.weight"))
    # NOTE: the linear attention's decay parameters are read once, as constants, in float32
    return (zero_centered and not name.endswith("linear_attn.norm.weight")) or ".mlp.act." in name or \
        name.endswith(("linear_attn.A", "linear_attn.dt_bias", "mamba.A", "mamba.dt_bias", "mamba.D"))


def checkpoint_plan(source: dict[str, SourceTensor], config: ModelConfig) -> dict[str, SourceTensor]:
    """Checkpoint name -> source tensor for every tensor the checkpoint needs; checks names and shapes first."""
    plan = {}
    for hf_name, src in stack_experts(split_fused(as_layer_pairs(source, config), config), config).items():
        if (name := hf_to_checkpoint_name(hf_name, config)) is not None:
            plan[name] = src
    # Tied models store one of the two (which one depends on who saved them); the checkpoint holds both.
    embedding, lm_head = EMBEDDING, "lm_head.weight"
    if config.tie_word_embeddings and (embedding in plan) != (lm_head in plan):
        plan[lm_head if embedding in plan else embedding] = plan[embedding if embedding in plan else lm_head]
    plan = decay_rates(per_head_vectors(xielu_scalars(conv_kernels(plan, config))))
    base = dataclasses.replace(config, quantization=QuantConfig(), mapping=Mapping())  # the unsharded source
    needed = expected_tensors(base, range(config.num_hidden_layers), first_stage=True, last_stage=True)
    missing = [n for n in needed if n not in plan]
    if missing:
        raise CheckpointError(
            f"the model lacks {len(missing)} tensors the {config.architecture} layout needs (first: {missing[0]}); "
            "the weights are incomplete or belong to another architecture."
        )
    check_shapes(base, {n: plan[n].shape for n in needed}, "the model")
    return {n: plan[n] for n in needed}


def default_group_size(config: ModelConfig) -> int:
    """The largest of 128/64/32 that divides the input features of every linear."""
    from trtbuild.builder.convert.weight_only import GROUP_SIZES
    from trtbuild.builder.convert.weight_only import default_group_size as largest

    features = (config.hidden_size, config.q_size, config.moe_intermediate_size if config.is_moe
                else config.intermediate_size, config.shared_expert_intermediate_size or config.hidden_size)
    if (g := largest(features)) is None:
        raise CheckpointError(f"no group size of {', '.join(map(str, GROUP_SIZES))} divides the input features "
                              f"{features} of this model's linears; use --weight-only int8 (per channel).")
    return g


def with_weight_only(config: ModelConfig, plan: dict[str, SourceTensor], weight_only: WeightOnly | None
                     ) -> ModelConfig:
    """The config's quantization: every linear whose source is quantized (a GGUF tensor kept as it is) or that
    `weight_only` quantizes is a weight_only linear; the rest are listed in exclude_modules."""
    prefixes = model_linear_prefixes(config, range(config.num_hidden_layers), last_stage=True)
    forms = {p: plan[p + ".weight"].nbits or (weight_only and (weight_only.bits, weight_only.group_size, False))
             for p in prefixes}
    quantized = {p: f for p, f in forms.items() if f}
    if not quantized:
        return config
    check_nbits_split(config, {p: f[:2] for p, f in quantized.items()})
    groups = {f[1] for f in quantized.values()}
    embedding = plan[EMBEDDING].nbits
    quant = QuantConfig(quant_algo=QuantAlgo.WEIGHT_ONLY.value, group_size=groups.pop() if len(groups) == 1 else None,
                        has_zero_point=any(f[2] for f in [*quantized.values(), embedding] if f),
                        exclude_modules=tuple(p for p in prefixes if p not in quantized),
                        embedding_weight_only=weight_only is not None or embedding is not None)
    return dataclasses.replace(config, quantization=quant)


def checkpoint_tensors(name: str, src: SourceTensor, config: ModelConfig, weight_only: WeightOnly | None
                       ) -> dict[str, torch.Tensor]:
    """The checkpoint tensors made from one source tensor: cast to the checkpoint dtype, or a weight_only linear's
    codes, scales and zero points."""
    value = src.load()
    prefix, q = name.removesuffix(".weight"), config.quantization
    if (name == EMBEDDING and q.embedding_weight_only) or (
            name.endswith(".weight") and is_linear(prefix) and q.algo_of(prefix) == QuantAlgo.WEIGHT_ONLY):
        from trtbuild.builder.convert.weight_only import NBitsWeight, quantize_rtn

        if not isinstance(value, NBitsWeight):  # stacked experts [experts, out, in] as [experts * out, in]
            value = quantize_rtn(value.reshape(-1, value.shape[-1]), weight_only.bits, weight_only.group_size)
        out = {name: torch.from_numpy(value.codes),
               prefix + ".weights_scaling_factor": torch.from_numpy(value.scales)}
        if value.zero_points is not None:
            out[prefix + ".weights_zero_point"] = torch.from_numpy(value.zero_points)
        return out
    if not isinstance(value, torch.Tensor | np.ndarray):  # a quantized GGUF tensor the engine reads in float
        value = value.dequantize()
    t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    dtype = torch.float32 if keeps_float32(name, config) else _TORCH_DTYPES[config.dtype]
    return {name: t.to(dtype).contiguous()}


def to_checkpoint_tensors(hf_tensors: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """In-memory form of the conversion: HF-named tensors -> checkpoint tensors (names and shapes checked)."""
    source = {n: SourceTensor(tuple(t.shape), lambda t=t: t) for n, t in hf_tensors.items()}
    out: dict[str, torch.Tensor] = {}
    for name, src in checkpoint_plan(norm_multipliers(source, config), config).items():
        out.update(checkpoint_tensors(name, src, config, None))
    seen: set[int] = set()
    for name, t in out.items():  # a tied model's two tensors come from one source tensor: store two copies
        if t.data_ptr() in seen:
            out[name] = t.clone()
        seen.add(out[name].data_ptr())
    return out


def _open_source(model: Path, dequantize: bool) -> tuple[dict, dict[str, SourceTensor], bool]:
    if not model.exists():
        raise ConfigError("model", f"{model} does not exist.")
    is_gguf = model.is_file() and model.suffix.lower() == ".gguf"
    if model.is_file() and not is_gguf:
        raise ConfigError("model", f"{model} is a file but not a .gguf; pass a GGUF file or an HF model folder.")
    if is_gguf:
        from trtbuild.builder.convert.gguf_reader import open_gguf

        return (*open_gguf(model, keep_quantization=not dequantize), True)
    from trtbuild.builder.convert.hf_reader import open_hf

    return (*open_hf(model), False)


def keep_first_layers(hf_config: dict, num_layers: int) -> dict:
    """The HF config of the model cut to its first `num_layers` decoder layers (the final norm and the head stay):
    a self-draft for speculative decoding. Per-layer lists in the config are cut too."""
    total = int(hf_config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ConfigError("num_layers", f"must be between 1 and the model's {total} layers, got {num_layers}")
    cut = dict(hf_config, num_hidden_layers=num_layers)
    for key, value in hf_config.items():
        if isinstance(value, list) and len(value) == total and key.startswith("layer"):  # e.g. Qwen3's layer_types
            cut[key] = value[:num_layers]
    return cut


def convert(model: Path, output: Path, dtype: str = "auto", tp_size: int = 1, pp_size: int = 1,
            weight_only: WeightOnly | None = None, dequantize: bool = False, num_layers: int | None = None
            ) -> ModelConfig:
    """Convert `model` (HF folder or .gguf file) into a checkpoint at `output`; returns the written config.

    A GGUF file's quantized tensors are kept as they are (weight_only linears) unless `dequantize`; `weight_only`
    quantizes the float linear weights (round to nearest). `num_layers` keeps only the first layers (the later
    layers' tensors are never read)."""
    model, output = Path(model), Path(output)
    if weight_only is not None and weight_only.bits == 8 and weight_only.group_size is not None \
            and weight_only.group_size % 16:
        raise ConfigError("group_size", f"{weight_only.group_size} is not a multiple of 16.")
    hf_config, source, is_gguf = _open_source(model, dequantize)
    hf_config = text_model_config(hf_config)
    if num_layers is not None:
        hf_config = keep_first_layers(hf_config, num_layers)
    prepare_output_dir(output)  # fail before the slow part, never overwrite anything
    try:
        config = model_config_from_hf(hf_config, dtype).with_mapping(Mapping(tp_size=tp_size, pp_size=pp_size))
        if "lm_head.weight" not in source and not config.tie_word_embeddings:
            config = dataclasses.replace(config, has_lm_head=False)  # NOTE: a base model (hf_reader.open_hf)
        check_mapping(config, config.mapping)
        plan = checkpoint_plan(source if is_gguf else norm_multipliers(source, config), config)
        if weight_only is not None and weight_only.bits == 4 and weight_only.group_size is None:
            weight_only = dataclasses.replace(weight_only, group_size=default_group_size(config))
        config = with_weight_only(config, plan, weight_only)
        _check_groups(config, weight_only)
        writers = [SafetensorsWriter(rank_file(output, r)) for r in range(config.mapping.world_size)]
        for name, src in tqdm(plan.items(), desc="converting", unit="tensor", leave=False):
            for out_name, tensor in checkpoint_tensors(name, src, config, weight_only).items():
                for rank, writer in enumerate(writers):
                    for n, t in shard_for_rank({out_name: tensor}, config, config.mapping, rank).items():
                        writer.write(n, t)
        for writer in writers:
            writer.close()
        if is_gguf:
            from trtbuild.builder.convert.gguf_tokenizer import export_gguf_tokenizer

            export_gguf_tokenizer(model, output)
        else:
            copy_tokenizer_files(model, output)
        config.save(output / CONFIG_FILE)  # written last: a folder with config.json is a complete checkpoint
    except BaseException:
        remove_partial_output(output)
        raise
    return config


def _check_groups(config: ModelConfig, weight_only: WeightOnly | None) -> None:
    """--group-size must divide the input features of every linear it quantizes."""
    if weight_only is None or weight_only.group_size is None:
        return
    for prefix in model_linear_prefixes(config, range(config.num_hidden_layers), last_stage=True):
        k = expected_shape(prefix + ".weight", config)[-1]
        if config.quantization.algo_of(prefix) == QuantAlgo.WEIGHT_ONLY and k % weight_only.group_size:
            raise ConfigError("group_size", f"{weight_only.group_size} does not divide the {k} input features of "
                                            f"{prefix}; choose one of 32, 64 or 128 that does.")
