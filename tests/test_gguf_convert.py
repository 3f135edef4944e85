"""A GGUF converts to the same checkpoint as the HF folder it was made from: stories260K's real GGUF, and tiny random
Llama / Mistral / Qwen2 / Qwen3 / Phi-3 models written the way llama.cpp's converter writes them (tokenizer and chat
template included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_helpers import PROBE_TEXTS, make_hf_folder, write_gguf_like_llama_cpp
from helpers import AVX512, STORIES260K, require_shared_models
from safetensors.torch import load_file, save_file

from trtbuild.builder.convert.convert import convert
from trtbuild.runtime.tokenizer import Tokenizer


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = (load_file(str(d / "rank0.safetensors")) for d in (a, b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


def test_gguf_and_safetensors_give_the_same_checkpoint(tmp_path):
    require_shared_models()
    convert(STORIES260K, tmp_path / "from_hf")
    convert(STORIES260K / "stories260K-f32.gguf", tmp_path / "from_gguf")
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")
    text = "Once upon a time, a little dog"
    assert Tokenizer(tmp_path / "from_gguf").encode(text) == Tokenizer(tmp_path / "from_hf").encode(text)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen2_yarn", "qwen3", "phi3", "phi3_longrope",
                                    "phi3_partial", "smollm3", "smollm3_spm", "gemma", "gemma2", "gemma3", "granite",
                                    "olmo2", "olmo3", "ernie4_5", "glm4", "exaone4", "exaone4_window",
                                    "cohere", "cohere2", "ministral3", "arcee", "starcoder2", "hunyuan_dense",
                                    "lfm2", "lfm2_wide", "apertus", "qwen3_5", "qwen3_5_moe"])
def test_llama_cpp_style_gguf_converts_like_its_hf_folder(tmp_path, family, monkeypatch):
    from transformers import AutoTokenizer

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # NOTE: a GGUF records no query_pre_attn_scalar: llama.cpp takes Gemma's from the head size, as released Gemmas
    # (but the 27B ones) have it
    overrides = {"query_pre_attn_scalar": 16} if family in ("gemma2", "gemma3") else None
    if family == "starcoder2":  # NOTE: llama.cpp runs StarCoder 2 without its sliding window, so a GGUF has none
        overrides = {"sliding_window": None}
    if family.startswith("qwen3_5"):  # NOTE: with more value heads than key heads a GGUF keeps them in another order
        overrides = {"linear_num_value_heads": 2}  # (tests/test_recurrent_layers.py)
    hf = make_hf_folder(family, tmp_path / family, overrides)
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family), tmp_path / "from_gguf")
    assert family.startswith(config.family)
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")

    ref, got = Tokenizer(tmp_path / "from_hf"), Tokenizer(tmp_path / "from_gguf")
    for text in PROBE_TEXTS:
        assert got.encode(text) == ref.encode(text), text
        assert got.decode(got.encode(text), skip_special_tokens=False) == ref.decode(ref.encode(text), False), text
    assert got.vocab_size == ref.vocab_size

    template = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((tmp_path / "from_gguf" / "tokenizer_config.json").read_text())["chat_template"] == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"}]
    ref_chat, got_chat = (AutoTokenizer.from_pretrained(tmp_path / d).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) for d in ("from_hf", "from_gguf"))
    assert got_chat == ref_chat and "héllo 世界" in got_chat
    assert got.encode(got_chat, add_special_tokens=False) == ref.encode(ref_chat, add_special_tokens=False)


# ---- quantized GGUF files kept as they are ----------------------------------------------------------------------
Q = __import__("gguf").GGMLQuantizationType
# every type with an exact engine form, one that falls back to float (MXFP4, its exact form taken away: gguf writes
# and reads no quantized type without one) and F16, spread over both layers so that q/k/v and gate/up siblings of
# different types meet
QTYPES = {
    "token_embd.weight": Q.Q6_K, "output.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q4_1, "blk.0.ffn_gate.weight": Q.Q5_0, "blk.0.ffn_up.weight": Q.MXFP4,
    "blk.0.ffn_down.weight": Q.Q5_K,
    "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_K, "blk.1.attn_v.weight": Q.Q5_1,
    "blk.1.attn_output.weight": Q.Q5_0, "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q4_K,
    "blk.1.ffn_down.weight": Q.F16,
}
FLOAT_LINEARS = ("transformer.layers.0.mlp.fc", "transformer.layers.1.mlp.proj")  # MXFP4 and F16


@pytest.mark.parametrize(("family", "embedding"), [("llama", Q.Q6_K), ("qwen2", Q.Q4_K)])
def test_quantized_gguf_engine_equals_its_dequantized_checkpoint(tmp_path, family, embedding, caplog, monkeypatch):
    """Built from the GGUF as it is, the engine (MatMulNBits at accuracy level 1) computes what the engine of the
    --dequantize checkpoint computes, to fp32 rounding; every linear of an exact type stays low-bit, and so does the
    embedding table (GatherBlockQuantized for Q6_K; a gather of packed rows dequantized by standard ops for Q4_K,
    whose float zero points GatherBlockQuantized does not take)."""
    import numpy as np
    import onnx
    from test_weight_only import OPTIONS, run

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert import gguf_quants
    from trtbuild.builder.engine_dir import CPU_ENGINE_FILE

    monkeypatch.delitem(gguf_quants.EXACT_NBITS, Q.MXFP4)  # the type without an exact form (QTYPES)
    hf = make_hf_folder(family, tmp_path / "hf", overrides={"hidden_size": 256, "intermediate_size": 512})
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", family, {**QTYPES, "token_embd.weight": embedding})
    with caplog.at_level("INFO"):
        config = convert(gguf_path, tmp_path / "as_is")
    assert "GGUF MXFP4: 1 tensors have no exact low-bit form in trtbuild" in caplog.text
    q4k, q6k = 4 + (embedding == Q.Q4_K), 1 + (embedding == Q.Q6_K)
    assert f"GGUF Q4_K: {q4k} tensors kept exactly as 4-bit weights in groups of 32 with float zero points" \
        in caplog.text
    for qtype in ("Q5_K", "Q5_1"):
        assert f"GGUF {qtype}: 1 tensors kept exactly as 8-bit weights in groups of 32 with float zero points" \
            in caplog.text
    q = config.quantization
    assert (q.quant_algo, q.group_size, q.has_zero_point, q.exclude_modules) == ("weight_only", None, True,
                                                                                FLOAT_LINEARS)
    assert q.embedding_weight_only
    assert f"GGUF Q6_K: {q6k} tensors kept exactly as 8-bit weights in groups of 16" in caplog.text
    convert(gguf_path, tmp_path / "float", dtype="float32", dequantize=True)
    engine = build_engine(tmp_path / "as_is", tmp_path / "e_as_is", **OPTIONS)
    reference = build_engine(tmp_path / "float", tmp_path / "e_float", **OPTIONS)
    got, want = run(engine), run(reference)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    model = onnx.load(str(engine / CPU_ENGINE_FILE), load_external_data=False)
    assert sum(n.op_type == "GatherBlockQuantized" for n in model.graph.node) == (embedding == Q.Q6_K)
    bits = sorted(next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node
                  if n.op_type == "MatMulNBits")
    # 12 low-bit linears + lm_head, 6 of them 4-bit. Siblings merge only where their codes have one form (with float
    # zero points or without, and as the native linears would pack them): layer 0's q (Q4_K) and k (Q4_0) and layer
    # 1's q (Q8_0) and v (Q5_1) stay apart, layer 1's gate and up (Q4_K) run as one kernel. Float zero points run as
    # an exact fp32 correction beside the codes' kernel: one GEMM for each of the 6 kernels of Q4_K, Q5_K, Q4_1 and
    # Q5_1 linears (DenseMatMul where the native float linears run, else ONNX Runtime's MatMul)
    assert bits == [4] * 5 + [8] * 7
    gemm = "DenseMatMul" if AVX512 else "MatMul"
    assert sum(n.op_type == gemm and n.name.endswith("_zero_points") for n in model.graph.node) == 6


def test_a_phi3_gguf_keeps_its_fused_tensors_quantized_row_by_row(tmp_path, monkeypatch):
    """Phi-3's fused attn_qkv (Q4_K) and gate+up ffn_up (Q6_K) split into q, k, v, gate and up by rows of blocks:
    every part stays kept exactly, and the engine gives the dequantized checkpoint's logits."""
    import numpy as np
    from test_weight_only import OPTIONS, run

    from trtbuild.builder.build import build_engine

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 4}
    hf = make_hf_folder("phi3_longrope", tmp_path / "hf", overrides=shape)
    qtypes = {f"blk.{i}.{n}.weight": t for i in range(2) for n, t in (("attn_qkv", Q.Q4_K), ("ffn_up", Q.Q6_K),
                                                                         ("attn_output", Q.Q8_0), ("ffn_down", Q.Q4_0))}
    gguf_path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "phi3_longrope", qtypes)
    config = convert(gguf_path, tmp_path / "as_is")
    assert config.quantization.exclude_modules == ("lm_head",)
    tensors = load_file(str(tmp_path / "as_is" / "rank0.safetensors"))
    for part in ("attention.q", "attention.k", "attention.v", "mlp.gate", "mlp.fc"):
        assert tensors[f"transformer.layers.1.{part}.weight"].dtype == torch.uint8, part
    convert(gguf_path, tmp_path / "float", dtype="float32", dequantize=True)
    got = run(build_engine(tmp_path / "as_is", tmp_path / "e_as_is", **OPTIONS))
    want = run(build_engine(tmp_path / "float", tmp_path / "e_float", **OPTIONS))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# ---- F16 files: the checkpoint holds their 16-bit values ---------------------------------------------------------
def _round_to_float16(hf: Path) -> None:
    tensors = {n: t.half().float() for n, t in load_file(str(hf / "model.safetensors")).items()}
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})


def test_an_f16_gguf_converts_to_a_float16_checkpoint_and_the_same_engine(tmp_path, monkeypatch):
    """llama.cpp's F16 files: matrices F16, norms and biases F32. When the F32 ones are exact in float16, the
    checkpoint is float16 (half the disk), and the engine (16-bit DenseMatMul) gives the float32 checkpoint's
    logits exactly; one F32 value that float16 cannot hold keeps the checkpoint float32."""
    import gguf
    from test_native_linears import steps

    from trtbuild.builder.build import build_engine

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("qwen2", tmp_path / "hf")
    _round_to_float16(hf)
    reader_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 2)
    matrices = {reader_names.get_name(n, try_suffixes=(".weight",)): gguf.GGMLQuantizationType.F16
                for n, t in load_file(str(hf / "model.safetensors")).items() if t.dim() == 2}
    f16 = write_gguf_like_llama_cpp(hf, tmp_path / "m-f16.gguf", "qwen2", matrices)
    config = convert(f16, tmp_path / "ckpt16")
    assert config.dtype == "float16"
    assert {t.dtype for t in load_file(str(tmp_path / "ckpt16" / "rank0.safetensors")).values()} == {torch.float16}
    assert convert(f16, tmp_path / "ckpt32", dtype="float32").dtype == "float32"
    limits = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128, kv_pool_dtype="float32")  # exact KV
    engines = [build_engine(tmp_path / f"ckpt{b}", tmp_path / f"engine{b}", **limits) for b in (16, 32)]
    for got, want in zip(*(steps(e) for e in engines), strict=True):
        assert torch.equal(torch.from_numpy(got), torch.from_numpy(want))

    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.norm.weight"][0] = 1.0 + 2.0**-20  # not a float16
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    f16_wide_norm = write_gguf_like_llama_cpp(hf, tmp_path / "m-f16b.gguf", "qwen2", matrices)
    assert convert(f16_wide_norm, tmp_path / "ckpt-wide").dtype == "float32"
