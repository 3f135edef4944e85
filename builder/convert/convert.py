"""`trtbuild convert`: HF folder or GGUF file -> unified checkpoint, sharded for tensor/pipeline parallelism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trtbuild.builder.convert.checkpoint import (
    CONFIG_FILE,
    copy_tokenizer_files,
    expected_tensors,
    prepare_output_dir,
    remove_partial_output,
    save_rank,
)
from trtbuild.builder.convert.names import hf_to_checkpoint_name
from trtbuild.builder.convert.sharding import check_mapping, shard_for_rank
from trtbuild.configs import Mapping, ModelConfig
from trtbuild.configs.model_config import model_config_from_hf
from trtbuild.errors import CheckpointError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _expected_shape(name: str, c: ModelConfig) -> tuple[int, ...]:
    suffix = name.split(".", 3)[-1] if name.startswith("transformer.layers.") else name
    return {
        "transformer.vocab_embedding.weight": (c.vocab_size, c.hidden_size),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
        "transformer.ln_f.weight": (c.hidden_size,),
        "input_layernorm.weight": (c.hidden_size,),
        "post_layernorm.weight": (c.hidden_size,),
        "attention.q.weight": (c.q_size, c.hidden_size),
        "attention.k.weight": (c.kv_size, c.hidden_size),
        "attention.v.weight": (c.kv_size, c.hidden_size),
        "attention.q.bias": (c.q_size,),
        "attention.k.bias": (c.kv_size,),
        "attention.v.bias": (c.kv_size,),
        "attention.q_norm.weight": (c.head_size,),
        "attention.k_norm.weight": (c.head_size,),
        "attention.dense.weight": (c.hidden_size, c.q_size),
        "mlp.gate.weight": (c.intermediate_size, c.hidden_size),
        "mlp.fc.weight": (c.intermediate_size, c.hidden_size),
        "mlp.proj.weight": (c.hidden_size, c.intermediate_size),
    }[suffix]


def to_checkpoint_tensors(hf_tensors: dict, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF tensors, cast them to the checkpoint dtype, untie lm_head, and check every name and shape."""
    dtype = _TORCH_DTYPES[config.dtype]
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in hf_tensors.items():
        name = hf_to_checkpoint_name(hf_name)
        if name is None:
            continue
        t = torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t
        out[name] = t.to(dtype).contiguous()
    # Tied models store one of the two (which one depends on who saved them); the checkpoint holds both.
    embedding, lm_head = "transformer.vocab_embedding.weight", "lm_head.weight"
    if config.tie_word_embeddings and (embedding in out) != (lm_head in out):
        present = embedding if embedding in out else lm_head
        out[lm_head if present == embedding else embedding] = out[present].clone()
    needed = expected_tensors(config, range(config.num_hidden_layers), first_stage=True, last_stage=True)
    missing = [n for n in needed if n not in out]
    if missing:
        raise CheckpointError(
            f"the model lacks {len(missing)} tensors the {config.architecture} layout needs (first: {missing[0]}); "
            "the weights are incomplete or belong to another architecture."
        )
    for name in needed:
        want = _expected_shape(name, config)
        if tuple(out[name].shape) != want:
            raise CheckpointError(
                f"tensor {name} has shape {tuple(out[name].shape)} but config.json implies {want}; "
                "the weights and config.json do not belong together."
            )
    return {n: out[n] for n in needed}


def convert(model: Path, output: Path, dtype: str = "auto", tp_size: int = 1, pp_size: int = 1) -> ModelConfig:
    """Convert `model` (HF folder or .gguf file) into a checkpoint at `output`; returns the written config."""
    model, output = Path(model), Path(output)
    if not model.exists():
        raise CheckpointError(f"--model {model} does not exist.")
    is_gguf = model.is_file() and model.suffix.lower() == ".gguf"
    if model.is_file() and not is_gguf:
        raise CheckpointError(f"--model {model} is a file but not a .gguf; pass a GGUF file or an HF model folder.")
    prepare_output_dir(output)  # fail before the slow part, never overwrite anything
    try:
        if is_gguf:
            from trtbuild.builder.convert.gguf_reader import read_gguf

            hf_config, hf_tensors = read_gguf(model)
        else:
            from trtbuild.builder.convert.hf_reader import read_hf

            hf_config, hf_tensors = read_hf(model)
        config = model_config_from_hf(hf_config, dtype).with_mapping(Mapping(tp_size=tp_size, pp_size=pp_size))
        check_mapping(config, config.mapping)
        tensors = to_checkpoint_tensors(hf_tensors, config)
        del hf_tensors
        for rank in tqdm(range(config.mapping.world_size), desc="writing shards", unit="rank", leave=False):
            save_rank(output, rank, shard_for_rank(tensors, config, config.mapping, rank))
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
