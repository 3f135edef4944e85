"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): the checkpoint's stacked experts, GGUF files, and what is refused.
Their engines' logits and greedy tokens against transformers are in tests/test_hf_parity.py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import make_random_hf_model, require_shared_models
from test_gguf_convert import assert_same_checkpoint

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.convert.safetensors_io import SafetensorsFile
from trtbuild.errors import CheckpointError, ConfigError, TrtbuildError
from trtbuild.quantize.options import QuantizeOptions
from trtbuild.quantize.quantize import quantize
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

MOE = ["qwen3_moe", "mixtral", "olmoe"]
Q = gguf.GGMLQuantizationType
OPTIONS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128, tokens_per_block=8)


@pytest.mark.parametrize("family", MOE)
def test_the_checkpoint_holds_each_layer_s_router_and_stacked_experts(tmp_path, family):
    hf = make_random_hf_model(family, tmp_path / "hf")
    config = convert(hf, tmp_path / "ckpt")
    assert (config.family, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.moe_normalize_topk) == (family, 8, 2, 32, family != "olmoe")
    ckpt = SafetensorsFile(tmp_path / "ckpt" / "rank0.safetensors")
    source = SafetensorsFile(hf / "model.safetensors")
    p, expert = "transformer.layers.1.mlp.", "mixtral" if family == "mixtral" else "other"
    names = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3",
                         "block_sparse_moe.experts.{}.w2"),
             "other": ("mlp.gate", "mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")}
    router, gate, up, down = (f"model.layers.1.{n}.weight" for n in names[expert])
    assert np.array_equal(ckpt[p + "router.weight"].numpy(), source[router].numpy())
    for ours, theirs, shape in (("gate", gate, (8, 32, 64)), ("fc", up, (8, 32, 64)), ("proj", down, (8, 64, 32))):
        stacked = ckpt[p + f"experts.{ours}.weight"].numpy()
        assert stacked.shape == shape
        assert np.array_equal(stacked[5], source[theirs.format(5)].numpy())
    assert not any(n.startswith(tuple(p + x for x in ("gate", "fc", "proj"))) for n in ckpt)


@pytest.mark.parametrize("family", MOE)
def test_a_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, family, monkeypatch):
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder(family, tmp_path / family)
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family), tmp_path / "from_gguf")
    assert config.family == family and config.num_experts == 8
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


def test_a_quantized_moe_gguf_keeps_its_attention_quantized_and_dequantizes_its_experts(tmp_path, caplog):
    """Q4_0 attention stays low-bit; Q4_0 / Q8_0 experts (3-D) run in float: the engine generates what the engine
    of the --dequantize checkpoint generates."""
    require_shared_models()
    qtypes = {**{f"blk.{i}.attn_{p}.weight": Q.Q4_0 for i in range(2) for p in ("q", "k", "v", "output")},
              **{f"blk.{i}.ffn_{p}_exps.weight": Q.Q8_0 if p == "down" else Q.Q4_0 for i in range(2)
                 for p in ("gate", "up", "down")}}
    gguf_path = write_gguf_like_llama_cpp(make_hf_folder("qwen3_moe", tmp_path / "hf"), tmp_path / "m.gguf",
                                          "qwen3_moe", qtypes)
    with caplog.at_level("INFO"):
        config = convert(gguf_path, tmp_path / "as_is")
    assert "GGUF Q4_0: 8 tensors kept exactly as 4-bit weights" in caplog.text
    q = config.quantization
    assert q.quant_algo == "weight_only" and q.exclude_modules == ("lm_head",)
    convert(gguf_path, tmp_path / "float", dequantize=True)
    engines = [build_engine(tmp_path / c, tmp_path / f"e_{c}", **OPTIONS) for c in ("as_is", "float")]
    outputs = [LLM(e, RuntimeConfig(num_threads=1)).generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=12))[0]
               for e in engines]
    assert outputs[0].token_ids == outputs[1].token_ids and len(outputs[0].token_ids) == 12


def test_what_a_mixture_of_experts_cannot_be_given_is_refused(tmp_path):
    hf = make_random_hf_model("qwen3_moe", tmp_path / "hf")
    with pytest.raises(ConfigError, match="experts are not split over tensor-parallel ranks"):
        convert(hf, tmp_path / "tp", tp_size=2)
    with pytest.raises(ConfigError, match="would stay in float"):
        convert(hf, tmp_path / "wo", weight_only=WeightOnly(8, None))
    with pytest.raises(ConfigError, match="mixture of experts, which `trtbuild quantize` does not calibrate"):
        quantize(QuantizeOptions(model=hf, output=tmp_path / "q", qformat="fp8"))
    assert not (tmp_path / "q").exists()
    convert(hf, tmp_path / "ckpt")
    for target in ("cuda", "tensorrt"):
        with pytest.raises(TrtbuildError, match="mixture of experts, which the .* target has no kernel"):
            build_engine(tmp_path / "ckpt", tmp_path / target, target=target, **OPTIONS)
    config = json.loads((hf / "config.json").read_text())
    for edit, pattern in (({"mlp_only_layers": [1]}, "dense MLP layers among its expert layers"),
                          ({"decoder_sparse_step": 2}, "dense MLP layers among its expert layers")):
        (hf / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(CheckpointError, match=pattern):
            convert(hf, tmp_path / "bad")
    (hf / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match="picking 1 to num_experts experts"):
        convert(hf, tmp_path / "bad")
