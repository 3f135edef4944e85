"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): the checkpoint's stacked experts, GGUF files, and what is refused.
Their engines' logits and greedy tokens against transformers are in tests/test_hf_parity.py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import onnx
import pytest
from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import BLOCK_QUANT, make_random_hf_model, prefill_logits, require_shared_models
from test_gguf_convert import assert_same_checkpoint

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.convert.safetensors_io import SafetensorsFile
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, read_engine_config
from trtbuild.errors import CheckpointError, ConfigError, TrtbuildError
from trtbuild.quantize.options import QuantizeOptions
from trtbuild.quantize.quantize import quantize
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

MOE = ["qwen3_moe", "mixtral", "olmoe", "granitemoe", "qwen2_moe"]
Q = gguf.GGMLQuantizationType
OPTIONS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128, tokens_per_block=8)


@pytest.mark.parametrize("family", MOE)
def test_the_checkpoint_holds_each_layer_s_router_and_stacked_experts(tmp_path, family):
    hf = make_random_hf_model(family, tmp_path / "hf")
    config = convert(hf, tmp_path / "ckpt")
    assert (config.family, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.moe_normalize_topk) == (family, 8, 2, 32, family not in ("olmoe", "qwen2_moe"))
    assert config.shared_expert_intermediate_size == (48 if family == "qwen2_moe" else 0)
    ckpt = SafetensorsFile(tmp_path / "ckpt" / "rank0.safetensors")
    source = SafetensorsFile(hf / "model.safetensors")
    p, hf_p = "transformer.layers.1.mlp.", "model.layers.1."
    if family == "granitemoe":  # every expert's gate and up rows in one tensor
        router = source[hf_p + "block_sparse_moe.router.layer.weight"].numpy()
        gate_up = source[hf_p + "block_sparse_moe.input_linear.weight"].numpy()
        fifth = (gate_up[5, :32], gate_up[5, 32:], source[hf_p + "block_sparse_moe.output_linear.weight"].numpy()[5])
    else:
        names = (("block_sparse_moe.gate", "block_sparse_moe.experts.5.w1", "block_sparse_moe.experts.5.w3",
                  "block_sparse_moe.experts.5.w2") if family == "mixtral" else
                 ("mlp.gate", "mlp.experts.5.gate_proj", "mlp.experts.5.up_proj", "mlp.experts.5.down_proj"))
        router, *fifth = (source[f"{hf_p}{n}.weight"].numpy() for n in names)
    assert np.array_equal(ckpt[p + "router.weight"].numpy(), router)
    for ours, theirs, shape in zip(("gate", "fc", "proj"), fifth, ((8, 32, 64), (8, 32, 64), (8, 64, 32)),
                                   strict=True):
        stacked = ckpt[p + f"experts.{ours}.weight"].numpy()
        assert stacked.shape == shape and np.array_equal(stacked[5], theirs)
    assert not any(n.startswith(tuple(p + x for x in ("gate", "fc", "proj"))) for n in ckpt)


@pytest.mark.parametrize("family", [*MOE, "lfm2_moe"])
def test_a_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, family, monkeypatch):
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder(family, tmp_path / family)
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family), tmp_path / "from_gguf")
    assert config.family == family and config.num_experts == 8
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


@pytest.mark.parametrize("experts", ["Q4_0 / Q8_0", "Q4_K / Q6_K", "MXFP4 / MXFP4"])
def test_a_quantized_moe_gguf_keeps_its_experts_as_the_file_holds_them(tmp_path, caplog, experts):
    """Q8_0 attention and Q4_0 / Q8_0, Q4_K / Q6_K or MXFP4 (gpt-oss's) experts (3-D) stay low-bit: the experts run
    as tables of experts (MoERoute, BlockQuantMatMul with `experts`, SwiGLU), and the engine computes what the engine
    of the --dequantize checkpoint computes, to the int8 rounding of the activations."""
    require_shared_models()
    gate_up, down = (Q[name] for name in experts.split(" / "))
    qtypes = {**{f"blk.{i}.attn_{p}.weight": Q.Q8_0 for i in range(2) for p in ("q", "k", "v", "output")},
              **{f"blk.{i}.ffn_{p}_exps.weight": down if p == "down" else gate_up for i in range(2)
                 for p in ("gate", "up", "down")}}
    hf = make_hf_folder("qwen3_moe", tmp_path / "hf", overrides={"hidden_size": 256, "moe_intermediate_size": 256})
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "qwen3_moe", qtypes)
    with caplog.at_level("INFO"):
        config = convert(gguf_path, tmp_path / "as_is")
    assert f"GGUF {gate_up.name}: {4 if down != gate_up else 6} tensors kept exactly" in caplog.text
    q = config.quantization
    assert q.quant_algo == "weight_only" and q.exclude_modules == ("lm_head",)
    convert(gguf_path, tmp_path / "float", dequantize=True)
    engines = [build_engine(tmp_path / c, tmp_path / f"e_{c}", **OPTIONS) for c in ("as_is", "float")]
    graph = onnx.load(str(engines[0] / CPU_ENGINE_FILE), load_external_data=False).graph
    tables = [n for n in graph.node
              if n.op_type == "BlockQuantMatMul" and any(a.name == "experts" for a in n.attribute)]
    if BLOCK_QUANT:
        assert len(tables) == 4 and sum(n.op_type == "MoERoute" for n in graph.node) == 2  # gate | up, down per layer
        assert not any(n.op_type == "MoE" for n in graph.node)
    else:  # the auto build's fallback where the tables cannot run: ONNX Runtime's MoE over the experts dequantized
        assert not tables and not any(n.op_type == "MoERoute" for n in graph.node)
        assert sum(n.op_type == "MoE" for n in graph.node) == 2
        assert read_engine_config(engines[0]).build.quant_linears == "ort"
    ids = np.random.default_rng(3).integers(3, 300, size=11).tolist()
    got, want = (prefill_logits(e, ids) for e in engines)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    outputs = LLM(engines[0], RuntimeConfig(num_threads=1)).generate([ids], SamplingParams(max_tokens=12))
    assert len(outputs[0].token_ids) == 12


@pytest.mark.parametrize(("family", "bits"), [("qwen3_moe", 4), ("mixtral", 8), ("olmoe", 4), ("qwen2_moe", 8),
                                            ("lfm2_moe", 4), ("afmoe", 4)])
def test_weight_only_experts_run_as_tables_of_experts_or_in_float(tmp_path, family, bits):
    """`convert --weight-only` quantizes the stacked experts (one [experts x out, in] linear each); the native
    tables of experts compute what ONNX Runtime's float MoE over the same weights dequantized does (--quant-linears
    ort), to the int8 rounding of the activations; sigmoid routers (LFM2-MoE, AFMoE) in MoERoute's sigmoid mode."""
    features = "moe_intermediate_size" if family in ("qwen3_moe", "qwen2_moe", "lfm2_moe", "afmoe") else \
        "intermediate_size"
    shared = {"shared_expert_intermediate_size": 96} if family == "qwen2_moe" else {}
    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"hidden_size": 128, features: 64, **shared})
    config = convert(hf, tmp_path / "ckpt", weight_only=WeightOnly(bits, 32))
    ckpt = SafetensorsFile(tmp_path / "ckpt" / "rank0.safetensors")
    p = f"transformer.layers.{config.moe_dense_layers}.mlp."  # LFM2-MoE's layer 0 is dense
    codes = ckpt[p + "experts.proj.weight"]
    assert codes.dtype.itemsize == 1 and tuple(codes.shape) == (config.num_experts * 128, 64 * bits // 8)
    assert config.quantization.quant_algo == "weight_only"
    assert ckpt[p + "router.weight"].dtype.itemsize == 4  # the router stays in float
    native = build_engine(tmp_path / "ckpt", tmp_path / "native", **OPTIONS)
    ort = build_engine(tmp_path / "ckpt", tmp_path / "ort", quant_linears="ort", **OPTIONS)
    ops = [{n.op_type for n in onnx.load(str(e / CPU_ENGINE_FILE), load_external_data=False).graph.node}
           for e in (native, ort)]
    assert "MoE" in ops[1] and "MoERoute" not in ops[1]
    if BLOCK_QUANT:
        assert "MoERoute" in ops[0] and "MoE" not in ops[0]
    else:  # the auto build falls back to the float MoE where the tables cannot run: it is the ort engine
        assert ops[0] == ops[1] and read_engine_config(native).build.quant_linears == "ort"
    ids = np.random.default_rng(4).integers(3, 300, size=9).tolist()
    got, want = prefill_logits(native, ids), prefill_logits(ort, ids)
    # NOTE: the int8 rounding of the activations differs between the engines (and so may a near-tie of two experts)
    error = np.abs(got - want) / np.abs(want).max()
    assert error.mean() <= 0.01 and error.max() <= 0.1, (error.mean(), error.max())


def test_weight_only_experts_fall_back_to_float_where_the_native_ops_cannot_run(tmp_path, monkeypatch):
    from trtbuild import cpu_ops
    from trtbuild.builder.engine_dir import read_engine_config

    hf = make_random_hf_model("olmoe", tmp_path / "hf")
    convert(hf, tmp_path / "ckpt", weight_only=WeightOnly(8, 32))
    monkeypatch.setattr(cpu_ops, "runs_block_quant", lambda: False)
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", **OPTIONS)
    ops = {n.op_type for n in onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False).graph.node}
    assert "MoE" in ops and "MoERoute" not in ops and read_engine_config(engine).build.quant_linears == "ort"
    assert len(LLM(engine, RuntimeConfig(num_threads=1)).generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]
               .token_ids) == 4


def test_what_a_mixture_of_experts_cannot_be_given_is_refused(tmp_path):
    hf = make_random_hf_model("qwen3_moe", tmp_path / "hf")
    odd = make_random_hf_model("qwen3_moe", tmp_path / "odd", overrides={"moe_intermediate_size": 31})
    with pytest.raises(ConfigError, match="tp_size 2 does not divide moe_intermediate_size=31"):
        convert(odd, tmp_path / "tp", tp_size=2)  # tests/test_tensor_parallel.py splits the even ones
    with pytest.raises(ConfigError, match="experts have biases, which a tensor-parallel split would add once per rank"):
        convert(make_random_hf_model("gpt_oss", tmp_path / "gpt_oss"), tmp_path / "tp", tp_size=2)
    with pytest.raises(ConfigError, match="mixture of experts, which `trtbuild quantize` does not calibrate"):
        quantize(QuantizeOptions(model=hf, output=tmp_path / "q", qformat="fp8"))
    assert not (tmp_path / "q").exists()
    convert(hf, tmp_path / "ckpt")
    with pytest.raises(TrtbuildError, match="mixture of experts, which the tensorrt target has no kernel"):
        build_engine(tmp_path / "ckpt", tmp_path / "tensorrt", target="tensorrt", **OPTIONS)
    config = json.loads((hf / "config.json").read_text())
    for edit, pattern in (({"mlp_only_layers": [1]}, "dense MLP layers among its expert layers"),
                          ({"decoder_sparse_step": 2}, "dense MLP layers among its expert layers")):
        (hf / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(CheckpointError, match=pattern):
            convert(hf, tmp_path / "bad")
    (hf / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match="picking 1 to num_experts experts"):
        convert(hf, tmp_path / "bad")
