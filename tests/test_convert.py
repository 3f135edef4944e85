"""`trtbuild convert` (TP/PP sharding, config.json schema, dtypes, errors), `build` refusals, engine-dir checks.

Sharding is checked against the TP=1/PP=1 checkpoint bit for bit, and each shard's slice is checked against the
slice of the full tensor it must hold, so that a split and a merge that are wrong in the same way still fail.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from helpers import REPO, STORIES260K, make_random_hf_model, require_shared_models
from safetensors.torch import load_file, save_file

from trtbuild import ENGINE_FORMAT_VERSION
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.checkpoint import (
    TOKENIZER_FILES,
    expected_tensors,
    load_checkpoint,
    open_checkpoint,
    stored_shape,
)
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.names import hf_to_checkpoint_name, layer_of
from trtbuild.builder.convert.sharding import merge_shards
from trtbuild.builder.engine_dir import _CPU_FLAGS, cpu_features, read_engine_config
from trtbuild.configs import Mapping, ModelConfig
from trtbuild.configs.from_hf import SUPPORTED_ARCHITECTURES
from trtbuild.configs.model_config import QuantConfig
from trtbuild.errors import CheckpointError, ConfigError, EngineCompatibilityError, TrtbuildError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

# qwen2: q/k/v biases; llama3_rope: llama3 RoPE + tied embeddings; odd_vocab: the same with vocab 321 (TP=2 pads
# the vocab-parallel tensors) and 3 layers (PP=2 splits them unevenly, 2 + 1).
SHARD_MODELS = ["qwen2", "llama3_rope", "odd_vocab"]
SPLITS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def hf_dir(random_hf_model, tmp_path_factory):
    """name -> HF model folder (RANDOM_CONFIGS families plus `odd_vocab`)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name != "odd_vocab":
            return random_hf_model(name)
        if name not in cache:
            cache[name] = make_random_hf_model("llama3_rope", tmp_path_factory.mktemp("hf_odd_vocab"), seed=1,
                                               overrides={"vocab_size": 321, "num_hidden_layers": 3})
        return cache[name]

    return get


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """(name, tp, pp, dtype) -> checkpoint folder, converted once per module."""
    cache: dict[tuple, Path] = {}

    def get(name: str, tp: int = 1, pp: int = 1, dtype: str = "auto") -> Path:
        key = (name, tp, pp, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{name}_tp{tp}_pp{pp}_{dtype}") / "ckpt"
            convert(hf_dir(name), out, dtype=dtype, tp_size=tp, pp_size=pp)
            cache[key] = out
        return cache[key]

    return get


def hf_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def load_ranks(ckpt: Path, world_size: int) -> list[dict[str, torch.Tensor]]:
    names = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert names == sorted(f"rank{r}.safetensors" for r in range(world_size))
    return [load_file(str(ckpt / f"rank{r}.safetensors")) for r in range(world_size)]


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


# ---- config.json ------------------------------------------------------------------------------------------------
def documented_config_fields() -> set[str]:
    """Field names of the config.json table in docs/checkpoint.md."""
    section = (REPO / "docs" / "checkpoint.md").read_text().split("## config.json", 1)[1].split("\n## ", 1)[0]
    fields = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            fields.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return fields


REQUIRED_FIELDS = {"architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_size", "rotary_base", "rotary_scaling", "norm_epsilon",
                   "tie_word_embeddings", "mapping", "quantization"}
FAMILY_FIELDS = {
    "llama": dict(architecture="LlamaForCausalLM", family="llama", qkv_bias=False, qk_norm=False, head_size=16,
                  rotary_base=10000.0, rotary_scaling=None, tie_word_embeddings=False),
    "llama3_rope": dict(architecture="LlamaForCausalLM", family="llama", qkv_bias=False, qk_norm=False,
                        rotary_base=500000.0, tie_word_embeddings=True, rotary_scaling={
                            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}),
    "qwen2": dict(architecture="Qwen2ForCausalLM", family="qwen2", qkv_bias=True, qk_norm=False,
                  rotary_base=1000000.0),
    "qwen2_yarn": dict(architecture="Qwen2ForCausalLM", family="qwen2", rotary_base=1000000.0, rotary_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(architecture="Qwen3ForCausalLM", family="qwen3", qkv_bias=False, qk_norm=True, head_size=32),
    "mistral": dict(architecture="MistralForCausalLM", family="mistral", qkv_bias=False, qk_norm=False,
                    sliding_window=None),
}


@pytest.mark.parametrize("family", list(FAMILY_FIELDS))
def test_config_json_schema_and_round_trip(family, converted):
    ckpt = converted(family)
    doc = json.loads((ckpt / "config.json").read_text())
    documented = documented_config_fields()
    assert documented >= REQUIRED_FIELDS
    assert set(doc) == documented
    common = dict(format_version=1, dtype="float32", vocab_size=320, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_size=16,
                  norm_epsilon=1e-6, max_position_embeddings=256, hidden_act="silu",
                  mapping={"world_size": 1, "tp_size": 1, "pp_size": 1},
                  quantization={"quant_algo": None, "kv_cache_quant_algo": None, "group_size": None,
                                "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": [],
                                "shared_input_scales": False, "smoothquant_alpha": None,
                                "per_token_activations": False, "lm_head_quant_algo": None,
                                "embedding_weight_only": False})
    for key, value in {**common, **FAMILY_FIELDS[family]}.items():
        assert doc[key] == value, key
    config = ModelConfig.load(ckpt / "config.json")
    assert config.to_dict() == doc
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert set(p.name for p in ckpt.iterdir()) == {"config.json", "rank0.safetensors", "generation_config.json"}


def test_stories260k_config_and_tokenizer_files_are_copied(tmp_path):
    require_shared_models()
    config = convert(STORIES260K, tmp_path / "ckpt")
    assert ModelConfig.load(tmp_path / "ckpt" / "config.json") == config
    assert (config.architecture, config.vocab_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_size, config.tie_word_embeddings) == \
        ("LlamaForCausalLM", 512, 5, 8, 4, 8, True)
    copied = {n for n in TOKENIZER_FILES if (STORIES260K / n).is_file()}
    assert {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"} <= copied
    for n in copied:
        assert (tmp_path / "ckpt" / n).read_bytes() == (STORIES260K / n).read_bytes(), n
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == copied | {"config.json", "rank0.safetensors"}


# ---- dtype ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype_option_casts_every_tensor(dtype, converted):
    want = getattr(torch, dtype)
    ref = load_ranks(converted("qwen2"), 1)[0]
    ckpt = converted("qwen2", dtype=dtype)
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == dtype
    got = load_ranks(ckpt, 1)[0]
    assert got.keys() == ref.keys()
    for n, t in got.items():
        assert t.dtype == want and torch.equal(t, ref[n].to(want)), n
    sharded = load_ranks(converted("qwen2", 2, 2, dtype), 4)
    assert {t.dtype for shard in sharded for t in shard.values()} == {want}


def test_auto_dtype_keeps_a_bfloat16_model(hf_dir, tmp_path):
    src = tmp_path / "bf16"
    shutil.copytree(hf_dir("llama"), src)
    weights = load_file(str(src / "model.safetensors"))
    save_file({n: t.to(torch.bfloat16) for n, t in weights.items()}, str(src / "model.safetensors"))
    hf = hf_config(src)
    hf["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(hf))
    assert convert(src, tmp_path / "ckpt").dtype == "bfloat16"
    assert {t.dtype for t in load_ranks(tmp_path / "ckpt", 1)[0].values()} == {torch.bfloat16}


# ---- errors -----------------------------------------------------------------------------------------------------
def broken_copy(src: Path, dst: Path, config_edit: dict | None = None, edit_files=None) -> Path:
    """A copy of the HF folder `src` with config.json fields replaced (or deleted) and then `edit_files(dst)` run."""
    shutil.copytree(src, dst)
    if config_edit:
        hf = {**hf_config(dst), **config_edit}
        (dst / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != "<delete>"}))
    if edit_files:
        edit_files(dst)
    return dst


def _truncate(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _garble_header(f: Path) -> None:
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 16 + data[16:])


WEIGHTS = "model.safetensors"
BROKEN_MODELS = {  # case -> (config.json edit, file edit, error pattern)
    "unsupported_arch": ({"architectures": ["GPT2LMHeadModel"]}, None,
                         r"unsupported architecture 'GPT2LMHeadModel'; trtbuild converts .*"
                         + ".*".join(re.escape(a) for a in SUPPORTED_ARCHITECTURES)),
    "no_architectures": ({"architectures": "<delete>"}, None, r"unsupported architecture None"),
    "truncated_weights": (None, lambda d: _truncate(d / WEIGHTS), r"model\.safetensors is corrupt or truncated"),
    "garbled_weights": (None, lambda d: _garble_header(d / WEIGHTS), r"model\.safetensors is corrupt or truncated"),
    "empty_weights": (None, lambda d: (d / WEIGHTS).write_bytes(b""), r"model\.safetensors is corrupt or truncated"),
    "shape_mismatch": ({"intermediate_size": 128}, None,
                       r"mlp\.gate\.weight has shape \(96, 64\) but config\.json implies \(128, 64\)"),
    "missing_layers": ({"num_hidden_layers": 3}, None, r"lacks 9 tensors .*transformer\.layers\.2\..*incomplete"),
    "config_lacks_field": ({"hidden_size": "<delete>"}, None, r"lacks the field 'hidden_size'"),
    "config_bad_value": ({"num_attention_heads": "four"}, None, r"config\.json has an invalid value"),
    "config_not_json": (None, lambda d: (d / "config.json").write_text("{"), r"config\.json is not valid JSON"),
    "config_not_object": (None, lambda d: (d / "config.json").write_text("[]"), r"config\.json is not a JSON object"),
    "unsupported_rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}, None,
                         r"rope scaling type 'dynamic' is not supported \(default, linear, llama3, longrope, yarn "
                         r"are\)"),
    "yarn_without_factor": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, None,
                            r"rope scaling yarn gives no factor"),
    "yarn_factor_not_positive": ({"rope_parameters": {"rope_type": "yarn", "factor": 0, "rope_theta": 10000.0}},
                                 None, r"rope scaling yarn factor must be above 0, got 0"),
    "unsupported_act": ({"hidden_act": "gelu"}, None, r"hidden_act 'gelu' is not supported"),
    "no_config": (None, lambda d: (d / "config.json").unlink(), r"has no config\.json"),
    "no_safetensors": (None, lambda d: (d / WEIGHTS).rename(d / "pytorch_model.bin"),
                       r"has no \*\.safetensors weights.*safe_serialization=True"),
}


@pytest.mark.parametrize("case", list(BROKEN_MODELS))
def test_broken_model_gives_a_clear_error_and_no_output(case, hf_dir, tmp_path):
    config_edit, edit_files, pattern = BROKEN_MODELS[case]
    model = broken_copy(hf_dir("llama"), tmp_path / "model", config_edit, edit_files)
    with pytest.raises(CheckpointError, match=pattern):
        convert(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_model_path_and_non_gguf_file(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model .*nowhere does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"is a file but not a \.gguf"):
        convert(hf_dir("llama") / "config.json", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_never_touched(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty; choose a new folder"):
        convert(hf_dir("llama"), out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty"):
        convert(hf_dir("llama"), a_file)
    assert a_file.read_text() == "mine"


def test_failure_while_writing_shards_removes_the_half_written_folder(hf_dir, tmp_path, monkeypatch):
    from trtbuild.builder.convert.safetensors_io import SafetensorsWriter

    real_write = SafetensorsWriter.write
    written = []

    def failing_write(self, name, tensor):
        if len(written) == 40:
            raise OSError("No space left on device")
        real_write(self, name, tensor)
        written.append(self.path.name)

    monkeypatch.setattr(SafetensorsWriter, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        convert(hf_dir("qwen2"), tmp_path / "out", tp_size=2, pp_size=2)
    assert len(set(written)) >= 2  # the failure came after real tensors were written to several ranks
    assert not (tmp_path / "out").exists()


# ---- build refusals ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_build_refuses_multi_rank_checkpoint_on_cpu(tp, pp, converted, tmp_path):
    with pytest.raises(TrtbuildError, match=rf"single-rank.*2 ranks \(tp={tp}, pp={pp}\).*trtbuild convert.*"
                                            r"--tp-size 1 --pp-size 1"):
        build_engine(converted("llama3_rope", tp, pp), tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize(("options", "pattern"), [
    (dict(max_seq_len=257), r"max_seq_len 257 exceeds the model's max_position_embeddings \(256\); pass 256 or "
                            r"less"),
    (dict(target="tensorrt"), r"target tensorrt needs NVIDIA TensorRT's Python package.*pip install tensorrt"),
    (dict(target="gpu"), r"target must be one of cpu, cuda, tensorrt, got 'gpu'"),
    (dict(target="cpu", dtype="bfloat16"), r"dtype must be one of float32, float16, bfloat16 for the cuda target"),
    (dict(max_batch_size=32, max_num_tokens=16), r"max_num_tokens 16 is below max_batch_size 32"),
    (dict(tokens_per_block=0), r"^tokens_per_block must be at least 1, got 0"),
])
def test_build_refuses_impossible_options(options, pattern, converted, tmp_path):
    with pytest.raises(TrtbuildError, match=pattern):
        build_engine(converted("llama"), tmp_path / "engine", **options)
    assert not (tmp_path / "engine").exists()


def test_build_refuses_bad_checkpoints(converted, hf_dir, tmp_path):
    with pytest.raises(TrtbuildError, match=r"checkpoint folder .* does not exist.*trtbuild convert"):
        build_engine(tmp_path / "nowhere", tmp_path / "e1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json not found.*trtbuild convert"):
        build_engine(tmp_path / "empty", tmp_path / "e2")
    with pytest.raises(CheckpointError, match=r"unknown fields in checkpoint config\.json.*trtbuild convert"):
        build_engine(hf_dir("llama"), tmp_path / "e3")  # an HF folder is not a checkpoint
    corrupt = tmp_path / "corrupt"
    shutil.copytree(converted("llama"), corrupt)
    _truncate(corrupt / "rank0.safetensors")
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors is corrupt.*trtbuild convert"):
        build_engine(corrupt, tmp_path / "e4")
    (corrupt / "rank0.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors is missing"):
        build_engine(corrupt, tmp_path / "e5")
    for e in ("e1", "e2", "e3", "e4", "e5"):
        assert not (tmp_path / e).exists(), e
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(CheckpointError, match=r"exists and is not empty"):
        build_engine(converted("llama"), out)
    assert [p.name for p in out.iterdir()] == ["keep"] and (out / "keep").read_text() == "mine"


# ---- engine directory compatibility -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_dir(random_hf_model, engine_from_hf):
    return engine_from_hf(random_hf_model("llama"), max_batch_size=4, max_num_tokens=256)  # same as test_hf_parity


@pytest.fixture
def engine_copy(engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(engine_dir, dst)
    return dst


def edit_engine_config(engine: Path, edit) -> None:
    doc = json.loads((engine / "config.json").read_text())
    edit(doc)
    (engine / "config.json").write_text(json.dumps(doc))


def _missing_cpu_feature() -> str:
    here = set(cpu_features())
    return next(f for f in _CPU_FLAGS if f not in here)  # no CPU has both the x86 and the Arm flags


def _add_missing_feature(doc: dict) -> None:
    doc["target"]["cpu_features"] = [*doc["target"]["cpu_features"], _missing_cpu_feature()]


INCOMPATIBLE = {
    "tensorrt_target": (lambda d: d["target"].update(name="tensorrt"),
                        r"built for target 'tensorrt'.*rebuild it: `trtbuild build .*--target cpu`"),
    "format_as_text": (lambda d: d.update(engine_format_version=str(ENGINE_FORMAT_VERSION)),
                       rf"engine format '{ENGINE_FORMAT_VERSION}'\); this trtbuild .* reads format "
                       rf"{ENGINE_FORMAT_VERSION}\. Rebuild it"),
    "future_format": (lambda d: d.update(engine_format_version=999),
                      rf"engine format 999\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild it"),
    "format_2_weights_inside": (lambda d: [d.update(engine_format_version=2), d.pop("weight_files")],
                                rf"engine format 2\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild "
                                r"it from its checkpoint"),
    "format_3_kv_cache_dtype": (lambda d: [d.update(engine_format_version=3),
                                           d["build_config"].update(kv_cache_dtype=d["build_config"].pop("kv_pool_dtype"))],
                                rf"engine format 3\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. Rebuild "
                                r"it from its checkpoint"),
    "format_4_no_speculative_mode": (lambda d: [d.update(engine_format_version=4),
                                                [d["build_config"].pop(f) for f in ("speculative_decoding_mode",
                                                                                    "max_draft_len")]],
                                     rf"engine format 4\); this trtbuild .* reads format {ENGINE_FORMAT_VERSION}\. "
                                     r"Rebuild it from its checkpoint"),
    "missing_cpu_feature": (_add_missing_feature, r"built for a CPU with \w+, which this CPU lacks; rebuild it"),
    "other_machine": (lambda d: d["target"].update(machine="s390x"), r"built on a s390x CPU.*rebuild it"),
    "newer_onnxruntime": (lambda d: d["target"].update(onnxruntime_version="999.0.0"),
                          r"built with onnxruntime 999\.0\.0, newer than the installed.*upgrade onnxruntime"),
}


def test_engine_copy_runs(engine_copy):
    info = read_engine_config(engine_copy)
    assert info.target["name"] == "cpu" and info.target["cpu_features"] == cpu_features()
    assert (info.build.max_seq_len, info.build.tokens_per_block) == (256, 8)
    logits = CpuEngine(engine_copy, num_threads=1).step([SequenceChunk(0, [5, 6, 7], 0, num_logits=1, block_ids=[0])])
    assert logits.shape == (1, 320) and np.isfinite(logits).all()


@pytest.mark.parametrize("case", list(INCOMPATIBLE))
def test_incompatible_engine_fails_before_opening_the_onnx_file(case, engine_copy, monkeypatch):
    import onnxruntime

    edit, pattern = INCOMPATIBLE[case]
    edit_engine_config(engine_copy, edit)
    with pytest.raises(EngineCompatibilityError, match=pattern):
        read_engine_config(engine_copy)
    (engine_copy / "rank0.onnx").write_bytes(b"not an onnx model")
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(EngineCompatibilityError, match=pattern):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_missing_or_corrupt_engine_file(engine_copy):
    onnx_file = engine_copy / "rank0.onnx"
    data = onnx_file.read_bytes()
    onnx_file.write_bytes(data[: len(data) // 3])
    with pytest.raises(EngineCompatibilityError, match=r"rank0\.onnx could not be loaded.*rebuild the engine"):
        CpuEngine(engine_copy, num_threads=1)
    onnx_file.unlink()
    read_engine_config(engine_copy)  # config.json alone is fine
    with pytest.raises(EngineCompatibilityError, match=r"rank0\.onnx is missing; rebuild the engine"):
        CpuEngine(engine_copy, num_threads=1)


def test_weights_outside_the_graph(engine_copy):
    """Every initializer above the inline threshold is in rank0.weights, page-aligned; the graph file is small."""
    from trtbuild.builder.weight_file import ALIGN, INLINE_MAX_BYTES

    model = onnx.load(str(engine_copy / "rank0.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    assert external and all(len(t.raw_data) < INLINE_MAX_BYTES for t in inline)
    entries = [{e.key: e.value for e in t.external_data} for t in external]
    assert {e["location"] for e in entries} == {"rank0.weights"}
    assert all(int(e["offset"]) % ALIGN == 0 for e in entries)
    weights = (engine_copy / "rank0.weights").stat().st_size
    assert read_engine_config(engine_copy).weight_files == {"rank0.weights": weights}
    assert max(int(e["offset"]) + int(e["length"]) for e in entries) == weights
    assert (engine_copy / "rank0.onnx").stat().st_size < weights / 10
    assert not list(engine_copy.glob("*.staging"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_or_truncated_weight_file_fails_before_loading(engine_copy, damage, monkeypatch):
    import onnxruntime

    weights = engine_copy / "rank0.weights"
    size = weights.stat().st_size
    if damage == "missing":
        weights.unlink()
        pattern = rf"rank0\.weights is missing \({size} bytes expected\); copy the whole engine directory"
    else:
        with open(weights, "r+b") as f:
            f.truncate(size - 4096)
        pattern = rf"rank0\.weights has {size - 4096} bytes but the engine was built with {size}: it is truncated"
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    with pytest.raises(EngineCompatibilityError, match=pattern):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_engine_that_does_not_fit_in_memory_is_refused_with_the_numbers(engine_copy, monkeypatch):
    import onnxruntime

    from trtbuild.runtime import memory

    weights = (engine_copy / "rank0.weights").stat().st_size
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights)  # less than weights + working memory
    opened = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: opened.append(a))
    needed = (weights + (256 << 20)) / 2**30
    with pytest.raises(TrtbuildError, match=rf"engine .* needs about {needed:.2f} GiB of memory but "
                                            rf"{weights / 2**30:.2f} GiB is available \(MemAvailable\); free memory"):
        CpuEngine(engine_copy, num_threads=1)
    assert opened == []


def test_kv_cache_budget_beyond_available_memory_is_refused(monkeypatch):
    from trtbuild.configs import BuildConfig
    from trtbuild.runtime import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ConfigError, match=r"kv_cache_memory 4294967296 bytes is more than the 1\.00 GiB of memory "
                                          r"available \(MemAvailable\); give less"):
        memory.kv_cache_blocks(1024, BuildConfig(), memory=float(4 << 30))
    assert memory.kv_cache_blocks(1024, BuildConfig(), memory=float(1 << 20)) == 1024
    # a GPU engine's pool is sized from the GPU's free memory, not the host's
    gpu = (1 << 20, "GPU memory free beside the engine's weights")
    assert memory.kv_cache_blocks(1024, BuildConfig(), memory=0.5, available=gpu) == 512
    with pytest.raises(ConfigError, match=r"more than the 0\.00 GiB of GPU memory free beside the engine's weights"):
        memory.kv_cache_blocks(1024, BuildConfig(), memory=float(4 << 20), available=gpu)


def test_not_an_engine_directory(engine_copy, converted, tmp_path):
    for path in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(EngineCompatibilityError, match=r"is not an engine directory \(no config\.json\); build "
                                                           r"one with `trtbuild build`"):
            CpuEngine(path)
    with pytest.raises(EngineCompatibilityError, match=r"trtbuild build"):
        CpuEngine(converted("llama"))  # a checkpoint's config.json is not an engine's
    (engine_copy / "config.json").write_text("{not json")
    with pytest.raises(EngineCompatibilityError, match=r"config\.json is corrupt.*trtbuild build"):
        CpuEngine(engine_copy)


UNREADABLE = {
    "not_utf8": lambda engine: (engine / "config.json").write_bytes(b"\xff\xfe{"),
    "target_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(target="cpu")),
    "model_config_unknown_field": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(c=1)),
    "model_config_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(model_config=[1, 2])),
    "build_config_invalid": lambda engine: edit_engine_config(engine, lambda d: d["build_config"].update(
        max_batch_size=0)),
    "build_config_missing": lambda engine: edit_engine_config(engine, lambda d: d.pop("build_config")),
    "weight_files_not_object": lambda engine: edit_engine_config(engine, lambda d: d.update(weight_files=["w"])),
    "weight_size_not_number": lambda engine: edit_engine_config(engine, lambda d: d["weight_files"].update(
        {"rank0.weights": "x"})),
    "io_without_kv_cache": lambda engine: edit_engine_config(engine, lambda d: d["io"].update(inputs=[])),
    "model_field_wrong_type": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(
        num_hidden_layers="five")),
    "model_heads_not_grouped": lambda engine: edit_engine_config(engine, lambda d: d["model_config"].update(
        num_key_value_heads=d["model_config"]["num_attention_heads"] + 1)),
    "kv_cache_dims_symbolic": lambda engine: edit_engine_config(engine, lambda d: d["io"]["inputs"][-1].update(
        shape=["num_blocks"] * 6)),
    "kv_cache_dtype_unknown": lambda engine: edit_engine_config(engine, lambda d: d["io"]["inputs"][-1].update(
        dtype="float99")),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_engine_config_is_the_rebuild_error(case, engine_copy):
    """Any config.json that cannot be read back is the engine-compatibility error with the rebuild command."""
    UNREADABLE[case](engine_copy)
    with pytest.raises(EngineCompatibilityError, match=r"config\.json .*trtbuild build --checkpoint"):
        read_engine_config(engine_copy)


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
