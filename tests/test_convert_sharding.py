"""`trtbuild convert`'s TP/PP sharding: merged back, each shard's tensors, shapes and layers, impossible splits.

Sharding is checked against the TP=1/PP=1 checkpoint bit for bit, and each shard's slice is checked against the
slice of the full tensor it must hold, so that a split and a merge that are wrong in the same way still fail.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from convert_helpers import hf_config, load_ranks
from safetensors.torch import load_file

from trtbuild.builder.convert.checkpoint import expected_tensors, load_checkpoint, open_checkpoint, stored_shape
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.names import hf_to_checkpoint_name, layer_of
from trtbuild.builder.convert.sharding import merge_shards
from trtbuild.configs import Mapping, ModelConfig
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.errors import CheckpointError, ConfigError

# qwen2: q/k/v biases; llama3_rope: llama3 RoPE + tied embeddings; odd_vocab: the same with vocab 321 (TP=2 pads
# the vocab-parallel tensors) and 3 layers (PP=2 splits them unevenly, 2 + 1).
SHARD_MODELS = ["qwen2", "llama3_rope", "odd_vocab"]
SPLITS = [(1, 2), (2, 1), (2, 2)]


# ---- TP / PP sharding ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHARD_MODELS)
def test_tp1_checkpoint_holds_the_hf_weights(name, hf_dir, converted):
    hf = {}
    for f in hf_dir(name).glob("*.safetensors"):
        hf.update(load_file(str(f)))
    ref = load_ranks(converted(name), 1)[0]
    mapped = {hf_to_checkpoint_name(n): t for n, t in hf.items() if hf_to_checkpoint_name(n)}
    if hf_config(hf_dir(name))["tie_word_embeddings"]:
        assert "lm_head.weight" not in mapped  # HF stores one of the tied pair; the checkpoint holds both
        mapped["lm_head.weight"] = mapped["transformer.vocab_embedding.weight"]
    assert ref.keys() == mapped.keys()
    for n, t in ref.items():
        assert t.dtype == torch.float32 and torch.equal(t, mapped[n]), n
    if name == "qwen2":
        assert "transformer.layers.1.attention.k.bias" in ref


@pytest.mark.parametrize("name", SHARD_MODELS)
@pytest.mark.parametrize(("tp", "pp"), SPLITS)
def test_shards_merge_back_to_the_tp1_checkpoint_exactly(name, tp, pp, converted):
    ref = load_ranks(converted(name), 1)[0]
    ckpt = converted(name, tp, pp)
    doc = json.loads((ckpt / "config.json").read_text())
    assert doc["mapping"] == {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    config = ModelConfig.load(ckpt / "config.json")
    assert config.mapping == Mapping(tp_size=tp, pp_size=pp)
    merged = merge_shards(load_ranks(ckpt, tp * pp), config, config.mapping)
    assert merged.keys() == ref.keys()
    for n, t in ref.items():
        assert merged[n].dtype == t.dtype and torch.equal(merged[n], t), n


@pytest.mark.parametrize("name", SHARD_MODELS)
@pytest.mark.parametrize(("tp", "pp"), SPLITS)
def test_shard_shapes_contents_and_layer_placement(name, tp, pp, hf_dir, converted):
    hf = hf_config(hf_dir(name))
    heads, kv, hidden, inter = (hf[k] for k in ("num_attention_heads", "num_key_value_heads", "hidden_size",
                                                "intermediate_size"))
    head, vocab, n_layers = hf.get("head_dim") or hidden // heads, hf["vocab_size"], hf["num_hidden_layers"]
    ref = load_ranks(converted(name), 1)[0]
    ckpt = converted(name, tp, pp)
    config = ModelConfig.load(ckpt / "config.json")
    shards = load_ranks(ckpt, tp * pp)
    stages = np.array_split(np.arange(n_layers), pp)  # contiguous, the first stages one layer longer
    q_rows, kv_rows, ffn, vocab_rows = heads // tp * head, kv // tp * head, inter // tp, -(-vocab // tp)
    for rank, shard in enumerate(shards):
        tp_rank, pp_rank = rank % tp, rank // tp  # rank = pp_rank * tp + tp_rank
        layers = stages[pp_rank].tolist()
        first, last = pp_rank == 0, pp_rank == pp - 1
        assert {layer_of(n) for n in shard} - {None} == set(layers)
        assert set(shard) == set(expected_tensors(config, layers, first_stage=first, last_stage=last))
        assert ("transformer.vocab_embedding.weight" in shard) == first
        assert ("lm_head.weight" in shard) == ("transformer.ln_f.weight" in shard) == last
        assert load_checkpoint(ckpt, rank)[1].keys() == shard.keys()

        def rows(t, n, _tp_rank=tp_rank):
            return t[_tp_rank * n : (_tp_rank + 1) * n]

        for i in layers:
            p = f"transformer.layers.{i}."
            want = {
                "attention.q.weight": ((q_rows, hidden), rows(ref[p + "attention.q.weight"], q_rows)),
                "attention.k.weight": ((kv_rows, hidden), rows(ref[p + "attention.k.weight"], kv_rows)),
                "attention.v.weight": ((kv_rows, hidden), rows(ref[p + "attention.v.weight"], kv_rows)),
                "attention.dense.weight": ((hidden, q_rows), rows(ref[p + "attention.dense.weight"].T, q_rows).T),
                "mlp.gate.weight": ((ffn, hidden), rows(ref[p + "mlp.gate.weight"], ffn)),
                "mlp.fc.weight": ((ffn, hidden), rows(ref[p + "mlp.fc.weight"], ffn)),
                "mlp.proj.weight": ((hidden, ffn), rows(ref[p + "mlp.proj.weight"].T, ffn).T),
                "input_layernorm.weight": ((hidden,), ref[p + "input_layernorm.weight"]),
                "post_layernorm.weight": ((hidden,), ref[p + "post_layernorm.weight"]),
            }
            if name == "qwen2":
                want["attention.q.bias"] = ((q_rows,), rows(ref[p + "attention.q.bias"], q_rows))
                want["attention.k.bias"] = ((kv_rows,), rows(ref[p + "attention.k.bias"], kv_rows))
                want["attention.v.bias"] = ((kv_rows,), rows(ref[p + "attention.v.bias"], kv_rows))
            for suffix, (shape, expected) in want.items():
                got = shard[p + suffix]
                assert tuple(got.shape) == shape, (rank, p + suffix)
                assert torch.equal(got, expected), (rank, p + suffix)
        for n in ("transformer.vocab_embedding.weight", "lm_head.weight"):
            if n not in shard:
                continue
            got = shard[n]
            assert tuple(got.shape) == (vocab_rows, hidden), (rank, n)
            real = rows(ref[n], vocab_rows)  # rows past the vocab are zero padding
            assert torch.equal(got[: len(real)], real), (rank, n)
            assert not got[len(real) :].any(), (rank, n)
            if name == "odd_vocab" and tp == 2:
                assert len(real) == (161 if tp_rank == 0 else 160)
        if last:
            assert torch.equal(shard["transformer.ln_f.weight"], ref["transformer.ln_f.weight"])


def test_tied_embeddings_are_stored_twice_on_their_stages(converted):
    ref = load_ranks(converted("llama3_rope"), 1)[0]
    assert torch.equal(ref["lm_head.weight"], ref["transformer.vocab_embedding.weight"])
    first, last = load_ranks(converted("llama3_rope", 1, 2), 2)
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.vocab_embedding.weight" not in last


@pytest.mark.parametrize(("tp", "pp", "pattern"), [
    (3, 1, r"tp_size 3 does not divide num_attention_heads=4"),
    (4, 1, r"tp_size 4 does not divide num_key_value_heads=2"),
    (1, 3, r"pp_size 3 exceeds the 2 layers"),
    (0, 1, r"tp_size must be at least 1"),
])
def test_impossible_split_is_refused_and_leaves_no_folder(tp, pp, pattern, hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=pattern):
        convert(hf_dir("qwen2"), tmp_path / "out", tp_size=tp, pp_size=pp)
    assert not (tmp_path / "out").exists()


def test_open_checkpoint_checks_the_shapes_of_tp_shards_and_packed_weights(converted, tmp_path):
    """Each rank's tensors have its share of the shapes config.json implies; int4 weights are checked packed."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted("llama", tp=2), ckpt)
    config = ModelConfig.load(ckpt / "config.json")
    open_checkpoint(ckpt, rank=1)
    dataclasses.replace(config, intermediate_size=2 * config.intermediate_size).save(ckpt / "config.json")
    half = config.intermediate_size // 2
    with pytest.raises(CheckpointError, match=rf"rank1\.safetensors: tensor .*mlp\.(gate|fc)\.weight has shape "
                                              rf"\({half}, {config.hidden_size}\) but config\.json implies "
                                              rf"\({2 * half}, {config.hidden_size}\)"):
        open_checkpoint(ckpt, rank=1)
    int4 = dataclasses.replace(config, quantization=QuantConfig(quant_algo="int4_awq", pre_quant_scale=True,
                                                                exclude_modules=("lm_head",)))
    assert stored_shape("transformer.layers.0.mlp.proj.weight", int4, quantized=True) == (
        config.hidden_size, config.intermediate_size // 2 // 2)  # row-parallel: in split, two values a byte
    assert stored_shape("lm_head.weight", int4) == (-(-config.vocab_size // 2), config.hidden_size)


@pytest.mark.parametrize(("family", "weight_only"), [("qwen2_moe", None), ("qwen3_moe", (4, 32)),
                                                     ("qwen3_moe", (8, None))])
def test_experts_split_per_expert_and_merge_back_exactly(family, weight_only, tmp_path):
    """Each expert's gate and up rows and its down projection's inputs split over the ranks, float stacks
    [experts, out, in] and weight-only ones [experts x out, in] (codes, and scales per group or per channel) alike;
    merged back they are the tp 1 checkpoint."""
    from helpers import make_random_hf_model

    from trtbuild.builder.convert.convert import WeightOnly

    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"moe_intermediate_size": 64})
    options = {"weight_only": WeightOnly(*weight_only)} if weight_only else {}
    convert(hf, tmp_path / "tp1", **options)
    ref = load_ranks(tmp_path / "tp1", 1)[0]
    config = convert(hf, tmp_path / "tp2", tp_size=2, **options)
    shards = load_ranks(tmp_path / "tp2", 2)
    merged = merge_shards(shards, config, config.mapping)
    assert merged.keys() == ref.keys()
    for n, t in ref.items():
        row_parallel = n.endswith(("proj.weights_scaling_factor", "dense.weights_scaling_factor"))
        if row_parallel and t.ndim == 2 and t.shape[1] == 1:
            t = t.repeat(1, 2)  # per-channel scales of a row-parallel linear: one group per rank's inputs
        assert merged[n].dtype == t.dtype and torch.equal(merged[n], t), n
    gate = "transformer.layers.0.mlp.experts.gate.weight"
    experts = config.num_experts
    for rank, shard in enumerate(shards):
        got, want = (t.reshape(experts, -1, t.shape[-1]) for t in (shard[gate], ref[gate]))
        assert torch.equal(got, want[:, rank * 32 : (rank + 1) * 32]), rank  # expert e's rows of this rank
