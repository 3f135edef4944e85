"""gpt-oss: its checkpoint layout (interleaved gate / up columns, [in, out] experts, biases, sinks), its GGUF files
and its released MXFP4 experts kept as they are. Its engine's logits and greedy tokens against transformers are in
tests/test_hf_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
from helpers import BLOCK_QUANT, make_random_hf_model, prefill_logits, require_shared_models
from safetensors.numpy import load_file, save_file
from test_gguf_convert import assert_same_checkpoint

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.convert.mxfp4 import ggml_blocks
from trtbuild.builder.convert.safetensors_io import SafetensorsFile
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, read_engine_config

Q = gguf.GGMLQuantizationType
OPTIONS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128, tokens_per_block=8)
# llama.cpp runs every gpt-oss file with swiglu_limit 7 (its GGUF has no key for it)
GGUF_LIMIT = {"swiglu_limit": 7.0}


def test_the_checkpoint_holds_gate_and_up_apart_as_out_by_in_with_their_biases(tmp_path):
    hf = make_random_hf_model("gpt_oss", tmp_path / "hf")
    config = convert(hf, tmp_path / "ckpt")
    assert (config.family, config.hidden_act, config.swiglu_alpha, config.swiglu_limit) == \
        ("gpt_oss", "swiglu_oai", 1.702, 0.1)
    assert config.attention_sinks and config.dense_bias and config.qkv_bias and config.moe_bias
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 and config.sliding_window == 6
    ckpt, source = SafetensorsFile(tmp_path / "ckpt" / "rank0.safetensors"), load_file(str(hf / "model.safetensors"))
    p, hf_p = "transformer.layers.1.", "model.layers.1."
    gate_up, gate_up_bias = source[hf_p + "mlp.experts.gate_up_proj"], source[hf_p + "mlp.experts.gate_up_proj_bias"]
    expected = {
        "mlp.experts.gate.weight": gate_up[:, :, 0::2].transpose(0, 2, 1),
        "mlp.experts.fc.weight": gate_up[:, :, 1::2].transpose(0, 2, 1),
        "mlp.experts.proj.weight": source[hf_p + "mlp.experts.down_proj"].transpose(0, 2, 1),
        "mlp.experts.gate.bias": gate_up_bias[:, 0::2], "mlp.experts.fc.bias": gate_up_bias[:, 1::2],
        "mlp.experts.proj.bias": source[hf_p + "mlp.experts.down_proj_bias"],
        "mlp.router.weight": source[hf_p + "mlp.router.weight"], "mlp.router.bias": source[hf_p + "mlp.router.bias"],
        "attention.sinks": source[hf_p + "self_attn.sinks"],
        "attention.dense.bias": source[hf_p + "self_attn.o_proj.bias"],
    }
    for name, want in expected.items():
        assert np.array_equal(ckpt[p + name].numpy(), want), name


def test_a_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, monkeypatch):
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("gpt_oss", tmp_path / "hf", overrides=GGUF_LIMIT)
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "gpt_oss"), tmp_path / "from_gguf")
    assert config.family == "gpt_oss" and config.swiglu_limit == 7.0
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


def _mxfp4_qtypes(layers: int) -> dict[str, Q]:
    return {f"blk.{i}.ffn_{p}_exps.weight": Q.MXFP4 for i in range(layers) for p in ("gate", "up", "down")}


def _as_released(hf: Path, out: Path) -> Path:
    """`hf` as OpenAI released gpt-oss: the experts' weights [experts, out, in] in MXFP4 `_blocks` (two codes a
    byte, in element order) and `_scales`, quantized as gguf quantizes to MXFP4; the rest as it is."""
    out.mkdir()
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = np.ascontiguousarray(tensors.pop(name).transpose(0, 2, 1))  # [experts, out, in]
        raw = gguf.quants.quantize(w.reshape(-1, w.shape[-1]), Q.MXFP4).reshape(*w.shape[:2], -1, 17)
        codes = np.concatenate([raw[..., 1:] & 0x0F, raw[..., 1:] >> 4], axis=-1)  # ggml: j low, j + 16 high
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
        tensors[name + "_scales"] = np.ascontiguousarray(raw[..., 0])
        assert np.array_equal(ggml_blocks(tensors[name + "_blocks"], tensors[name + "_scales"]),
                              raw.reshape(*raw.shape[:2], -1))
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_released_mxfp4_experts_convert_exactly_as_llama_cpp_s_mxfp4_gguf_of_them(tmp_path, monkeypatch):
    """OpenAI's MXFP4 experts (HF `_blocks` / `_scales`) and llama.cpp's MXFP4 GGUF of the same weights give one
    checkpoint: 4-bit codes into the e2m1 values with the file's power-of-two scales, bit for bit."""
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("gpt_oss", tmp_path / "hf", overrides=GGUF_LIMIT)
    released = _as_released(hf, tmp_path / "released")
    config = convert(released, tmp_path / "from_hf")
    assert config.quantization.quant_algo == "weight_only"
    assert "transformer.layers.0.mlp.experts.gate" not in config.quantization.exclude_modules
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "gpt_oss", _mxfp4_qtypes(4))
    convert(gguf_path, tmp_path / "from_gguf")
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


def test_mxfp4_experts_run_as_tables_of_experts_with_their_biases_and_clamped_swiglu(tmp_path, monkeypatch):
    """A GGUF with MXFP4 experts keeps them as 4-bit codebook tables (MoERoute, BlockQuantMatMul with `experts` and
    biases, SwiGLU with alpha / beta / limit) and computes what ONNX Runtime's float MoE over the same weights
    dequantized does, to the int8 rounding of the activations."""
    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("gpt_oss", tmp_path / "hf", overrides={"hidden_size": 128, "intermediate_size": 64,
                                                                "swiglu_limit": 7.0})
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "gpt_oss", _mxfp4_qtypes(4))
    convert(gguf_path, tmp_path / "ckpt")
    native = build_engine(tmp_path / "ckpt", tmp_path / "native", **OPTIONS)
    ort = build_engine(tmp_path / "ckpt", tmp_path / "ort", quant_linears="ort", **OPTIONS)
    graph = onnx.load(str(native / CPU_ENGINE_FILE), load_external_data=False).graph
    tables = [n for n in graph.node if n.op_type == "BlockQuantMatMul" and any(a.name == "experts"
                                                                               for a in n.attribute)]
    if BLOCK_QUANT:
        assert len(tables) == 8 and all(n.input[3] for n in tables)  # gate | up and down per layer, with biases
        swiglu = [n for n in graph.node if n.op_type == "SwiGLU"]
        assert len(swiglu) == 4 and all({a.name for a in n.attribute} >= {"alpha", "beta", "limit"} for n in swiglu)
    else:  # the auto build's fallback where the tables cannot run: ONNX Runtime's MoE, with the biases and the clamp
        assert not tables and not any(n.op_type == "MoERoute" for n in graph.node)
        moe = [n for n in graph.node if n.op_type == "MoE"]
        assert len(moe) == 4 and all(len(n.input) == 6 and n.input[3] and n.input[5] for n in moe)
        assert [onnx.helper.get_attribute_value(a) for n in moe for a in n.attribute if a.name == "swiglu_limit"] \
            == [7.0] * 4
        assert read_engine_config(native).build.quant_linears == "ort"
    ids = np.random.default_rng(5).integers(3, 300, size=9).tolist()
    got, want = prefill_logits(native, ids), prefill_logits(ort, ids)
    error = np.abs(got - want) / np.abs(want).max()
    assert error.mean() <= 0.01 and error.max() <= 0.1, (error.mean(), error.max())


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_experts_with_a_reachable_clamp_match_the_float_moe(tmp_path, bits):
    """`convert --weight-only` experts of the test model, whose SwiGLU limit (0.1) the activations reach: the
    native tables compute what ONNX Runtime's float MoE does."""
    hf = make_random_hf_model("gpt_oss", tmp_path / "hf", overrides={"hidden_size": 128, "intermediate_size": 64})
    convert(hf, tmp_path / "ckpt", weight_only=WeightOnly(bits, 32))
    native = build_engine(tmp_path / "ckpt", tmp_path / "native", **OPTIONS)
    ort = build_engine(tmp_path / "ckpt", tmp_path / "ort", quant_linears="ort", **OPTIONS)
    ids = np.random.default_rng(6).integers(3, 300, size=9).tolist()
    got, want = prefill_logits(native, ids), prefill_logits(ort, ids)
    error = np.abs(got - want) / np.abs(want).max()
    assert error.mean() <= 0.01 and error.max() <= 0.1, (error.mean(), error.max())
