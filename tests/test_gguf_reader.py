"""Tests for builder/convert/gguf_reader.py: HF naming, dequantization, errors and tokenizer export."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from trtbuild.builder.convert.gguf_reader import read_gguf
from trtbuild.builder.convert.gguf_tokenizer import _ensure_post_processor, export_gguf_tokenizer
from trtbuild.errors import CheckpointError

SHARED = Path(os.environ.get("TRTBUILD_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
STORIES = SHARED / "models" / "stories260K"
STORIES_GGUF = STORIES / "stories260K-f32.gguf"
needs_stories = pytest.mark.skipif(not STORIES_GGUF.is_file(), reason=f"shared model missing: {STORIES_GGUF}")

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 1, 64, 8  # hidden 256: one Q4_K super-block per row
RNG = np.random.default_rng(0)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permute (the forward direction)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_llama(path: Path, overrides: dict | None = None, arch: str = "llama", meta: dict | None = None) -> dict:
    """Write a one-layer llama GGUF; overrides maps GGUF tensor name -> array or (raw uint8 array, qtype)."""
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "output.weight": (VOCAB, HIDDEN)}
    layer = {
        "attn_norm": (HIDDEN,),
        "ffn_norm": (HIDDEN,),
        "attn_q": (HIDDEN, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    shapes |= {f"blk.0.{k}.weight": v for k, v in layer.items()}
    tensors = {k: RNG.standard_normal(v).astype(np.float32) for k, v in shapes.items()} | (overrides or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
            key, value
        )
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(raw little-endian bytes [..., 2], float32 value) of x rounded to float16."""
    h = np.asarray(x, dtype=np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _q8_0(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-built Q8_0 blocks (ggml block_q8_0: f16 d, int8 qs[32]; y = d * q) and their values."""
    nb = cols // 32
    d_raw, d = _f16(RNG.uniform(0.001, 0.1, (rows, nb)))
    q = RNG.integers(-128, 128, (rows, nb, 32)).astype(np.int8)
    raw = np.concatenate([d_raw, q.view(np.uint8)], axis=-1).reshape(rows, -1)
    return raw, (d[..., None] * q).reshape(rows, cols)


def _q4_01(rows: int, cols: int, with_min: bool) -> tuple[np.ndarray, np.ndarray]:
    """Hand-built Q4_0 (y = d*(q-8)) or Q4_1 (y = d*q + m) blocks: qs[j] = q[j] | q[j+16] << 4."""
    nb = cols // 32
    d_raw, d = _f16(RNG.uniform(0.001, 0.1, (rows, nb)))
    m_raw, m = _f16(RNG.uniform(-1.0, 1.0, (rows, nb)))
    q = RNG.integers(0, 16, (rows, nb, 32)).astype(np.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    if with_min:
        return np.concatenate([d_raw, m_raw, qs], -1).reshape(rows, -1), (d[..., None] * q + m[..., None]).reshape(
            rows, cols
        )
    return np.concatenate([d_raw, qs], -1).reshape(rows, -1), (d[..., None] * (q.astype(np.float32) - 8)).reshape(
        rows, cols
    )


def _q4_k(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-built Q4_K super-blocks (ggml block_q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, qs[128]).

    Sub-block j (32 values) is d*sc[j]*q - dmin*m[j]; sub-blocks 2i/2i+1 are the low/high nibbles of qs[32i:32i+32].
    """
    nb = cols // 256
    d_raw, d = _f16(RNG.uniform(0.001, 0.01, (rows, nb)))
    dmin_raw, dmin = _f16(RNG.uniform(0.001, 0.01, (rows, nb)))
    sc = RNG.integers(0, 64, (rows, nb, 8)).astype(np.uint8)
    mn = RNG.integers(0, 64, (rows, nb, 8)).astype(np.uint8)
    scales = np.concatenate(
        [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
         (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)], axis=-1)  # fmt: skip
    q = RNG.integers(0, 16, (rows, nb, 4, 2, 32)).astype(np.uint8)  # [pair, low/high nibble, 32]
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(rows, nb, 128)
    raw = np.concatenate([d_raw, dmin_raw, scales, qs], -1).reshape(rows, -1)
    vals = (d[..., None] * sc)[..., None] * q.reshape(rows, nb, 8, 32) - (dmin[..., None] * mn)[..., None]
    return raw, vals.reshape(rows, cols)


def _bf16(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    top = RNG.integers(0, 1 << 16, (rows, cols)).astype(np.uint16) & 0xBFFF  # clear exponent MSB: finite values
    return top.view(np.uint8).reshape(rows, -1), (top.astype(np.uint32) << 16).view(np.float32)


HAND_BUILT = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: lambda r, c: _q4_01(r, c, with_min=False),
    Q.Q4_1: lambda r, c: _q4_01(r, c, with_min=True),
    Q.Q4_K: _q4_k,
    Q.BF16: _bf16,
}


@needs_stories
def test_stories260k_matches_safetensors() -> None:
    from safetensors.numpy import load_file

    cfg, sd = read_gguf(STORIES_GGUF)
    ref = load_file(STORIES / "model.safetensors")
    assert set(sd) == set(ref) and "lm_head.weight" not in sd
    for name, expected in ref.items():
        assert sd[name].dtype == np.float32 and sd[name].shape == expected.shape, name
        np.testing.assert_allclose(sd[name], expected, atol=1e-6, rtol=0, err_msg=name)
    hf = json.loads((STORIES / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "model_type",
        "architectures",
        "hidden_act",
    ):
        assert cfg[key] == hf[key], key


def test_names_shapes_and_qk_unpermute(tmp_path: Path) -> None:
    q, k = RNG.standard_normal((HIDDEN, HIDDEN)), RNG.standard_normal((HIDDEN // HEADS * KV_HEADS, HIDDEN))
    q, k = q.astype(np.float32), k.astype(np.float32)
    written = _write_llama(
        tmp_path / "m.gguf", {"blk.0.attn_q.weight": _permute(q, HEADS), "blk.0.attn_k.weight": _permute(k, KV_HEADS)}
    )
    cfg, sd = read_gguf(tmp_path / "m.gguf")
    assert cfg["tie_word_embeddings"] is False and cfg["head_dim"] == HIDDEN // HEADS and cfg["vocab_size"] == VOCAB
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.q_proj.weight"], q)
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.k_proj.weight"], k)
    np.testing.assert_array_equal(sd["lm_head.weight"], written["output.weight"])
    np.testing.assert_array_equal(sd["model.layers.0.mlp.down_proj.weight"], written["blk.0.ffn_down.weight"])
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (HIDDEN, FFN)
    assert sd["model.layers.0.post_attention_layernorm.weight"].shape == (HIDDEN,)


@pytest.mark.parametrize("qtype", list(HAND_BUILT), ids=lambda q: q.name)
def test_dequantize_hand_built_blocks(tmp_path: Path, qtype: Q) -> None:
    raw, expected = HAND_BUILT[qtype](FFN, HIDDEN)
    _write_llama(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    got = read_gguf(tmp_path / "m.gguf")[1]["model.layers.0.mlp.up_proj.weight"]
    assert got.shape == (FFN, HIDDEN) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_dequantize_exactly_representable_round_trip(tmp_path: Path, qtype: Q) -> None:
    """Values on each block's quantization grid survive gguf.quants.quantize -> read_gguf unchanged."""
    k = RNG.integers(0, 16, (FFN, HIDDEN // 32, 32)).astype(np.float32)
    k[..., 0], k[..., 1] = 0, 15  # pin each block's min/max so the scale is exactly 1/8 or 1/4
    x = {Q.F16: k / 8, Q.Q4_1: k / 4 - 1, Q.Q4_0: (k - 8) / 4, Q.Q8_0: (k - 8) * 127 / 8 / 16}[qtype]
    if qtype == Q.Q4_0:
        x[..., 0] = -2.0  # largest magnitude negative: d = max / -8 = 0.25
    if qtype == Q.Q8_0:
        x = np.round(x * 16) / 16
        x[..., 0] = 127 / 16  # d = 1/16 exactly
    x = x.reshape(FFN, HIDDEN)
    data = x.astype(np.float16) if qtype == Q.F16 else (gguf.quants.quantize(x, qtype), qtype)
    _write_llama(tmp_path / "m.gguf", {"blk.0.ffn_gate.weight": data})
    np.testing.assert_array_equal(read_gguf(tmp_path / "m.gguf")[1]["model.layers.0.mlp.gate_proj.weight"], x)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    _write_llama(
        tmp_path / "m.gguf",
        {"blk.0.ffn_up.weight": (np.zeros((FFN, HIDDEN // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8), Q.Q8_1)},
    )
    with pytest.raises(CheckpointError, match="Q8_1"):
        read_gguf(tmp_path / "m.gguf")


def test_rope_scaling(tmp_path: Path) -> None:
    _write_llama(tmp_path / "lin.gguf", meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert read_gguf(tmp_path / "lin.gguf")[0]["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    dim, factor, old = HIDDEN // HEADS, 8.0, 8192  # llama.cpp's generate_extra_tensors for rope_type llama3
    factors = []
    for freq in 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim)):
        wavelen = 2 * math.pi / freq
        smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
        factors.append(1 if wavelen < old / 4 else factor if wavelen > old else 1 / ((1 - smooth) / factor + smooth))
    _write_llama(tmp_path / "l3.gguf", {"rope_freqs.weight": np.array(factors, np.float32)})
    cfg, sd = read_gguf(tmp_path / "l3.gguf")
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert not any("rope" in k for k in sd)
    _write_llama(tmp_path / "bad.gguf", {"rope_freqs.weight": np.full(dim // 2, 3.0, np.float32)})
    with pytest.raises(CheckpointError, match="rope_freqs"):
        read_gguf(tmp_path / "bad.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    _write_llama(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(CheckpointError, match="'gpt2'; trtbuild reads GGUF architectures llama, mistral, qwen2, qwen3"):
        read_gguf(tmp_path / "m.gguf")


KV = HIDDEN // HEADS * KV_HEADS
_BIASES = {f"blk.0.attn_{p}.bias": RNG.standard_normal(n).astype(np.float32)
           for p, n in (("q", HIDDEN), ("k", KV), ("v", KV))}
_QK_NORMS = {f"blk.0.attn_{p}_norm.weight": RNG.standard_normal(HIDDEN // HEADS).astype(np.float32) for p in "qk"}


@pytest.mark.parametrize(
    ("arch", "meta", "extra", "family", "window"),
    [
        ("llama", {}, {}, "llama", None),
        ("llama", {"general.name": "Mistral 7B Instruct v0.3"}, {}, "mistral", None),
        ("llama", {"llama.attention.sliding_window": 4096}, {}, "mistral", 4096),
        ("qwen2", {}, _BIASES, "qwen2", None),
        ("qwen3", {}, _QK_NORMS, "qwen3", None),
    ],
    ids=["llama", "mistral_by_name", "mistral_by_window", "qwen2", "qwen3"],
)
def test_architectures(tmp_path: Path, arch: str, meta: dict, extra: dict, family: str, window: int | None) -> None:
    """Each architecture maps to its HF family; q/k rows are un-permuted only where llama.cpp permuted them."""
    from trtbuild.configs.from_hf import model_config_from_hf

    written = _write_llama(tmp_path / "m.gguf", extra, arch=arch, meta=meta)
    cfg, sd = read_gguf(tmp_path / "m.gguf")
    config = model_config_from_hf(cfg)
    assert (config.family, config.sliding_window) == (family, window)
    assert (config.qkv_bias, config.qk_norm) == (arch == "qwen2", arch == "qwen3")
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(_permute(q, HEADS) if family in ("llama", "mistral") else q,
                                  written["blk.0.attn_q.weight"])
    hf_names = {**{f"blk.0.attn_{p}.bias": f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"},
                **{f"blk.0.attn_{p}_norm.weight": f"model.layers.0.self_attn.{p}_norm.weight" for p in "qk"}}
    for name, value in extra.items():
        np.testing.assert_array_equal(sd[hf_names[name]], value)


def test_architecture_tensor_sets(tmp_path: Path) -> None:
    _write_llama(tmp_path / "q2.gguf", arch="qwen2")
    with pytest.raises(CheckpointError, match=r"lacks tensors \['blk.0.attn_q.bias'.*not a qwen2 model"):
        read_gguf(tmp_path / "q2.gguf")
    _write_llama(tmp_path / "q3.gguf", arch="qwen3")
    with pytest.raises(CheckpointError, match=r"lacks tensors \['blk.0.attn_q_norm.weight'"):
        read_gguf(tmp_path / "q3.gguf")
    _write_llama(tmp_path / "l.gguf", _QK_NORMS)
    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.attn_q_norm.weight' for a llama model"):
        read_gguf(tmp_path / "l.gguf")
    _write_llama(tmp_path / "p.gguf", meta={"llama.rope.dimension_count": HIDDEN // HEADS // 2})
    with pytest.raises(CheckpointError, match="partial rotary"):
        read_gguf(tmp_path / "p.gguf")


@pytest.mark.parametrize("kind", ["missing", "empty", "not_gguf", "truncated_header", "truncated_data", "directory"])
def test_bad_files(tmp_path: Path, kind: str) -> None:
    good = tmp_path / "good.gguf"
    _write_llama(good)
    blob = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "not_gguf":
        bad.write_text('{"this": "is json"}' * 10)
    elif kind == "truncated_header":
        bad.write_bytes(blob[:200])
    elif kind == "truncated_data":
        bad.write_bytes(blob[: len(blob) // 2])
    elif kind == "directory":
        bad.mkdir()
    with pytest.raises(CheckpointError) as err:
        read_gguf(bad)
    assert str(bad) in err.value.message
    with pytest.raises(CheckpointError):
        export_gguf_tokenizer(bad, tmp_path / "tok")


@needs_stories
def test_tokenizer_export_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenizers import Tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "tok"
    export_gguf_tokenizer(STORIES_GGUF, out)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in out.iterdir()}
    ref = Tokenizer.from_file(str(STORIES / "tokenizer.json"))
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("Once upon a time").ids == [1, 403, 407, 261, 378]
    for text in ("Once upon a time", 'Lily saw a big dog. She said, "Hi!"', "  two  spaces\nnewline 42"):
        assert tok.encode(text).ids == ref.encode(text).ids, text
    assert json.loads((out / "special_tokens_map.json").read_text())["bos_token"] == "<s>"
    # A tokenizer.json without a post-processor gets BOS added back when the GGUF says add_bos_token.
    data = json.loads((out / "tokenizer.json").read_text())
    data["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("Once upon a time").ids[0] != 1
    _ensure_post_processor(out / "tokenizer.json", ("<s>", 1), None)
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("Once upon a time").ids == [1, 403, 407, 261, 378]


def test_export_without_embedded_tokenizer(tmp_path: Path) -> None:
    _write_llama(tmp_path / "m.gguf")
    with pytest.raises(CheckpointError, match="no embedded tokenizer"):
        export_gguf_tokenizer(tmp_path / "m.gguf", tmp_path / "tok")
