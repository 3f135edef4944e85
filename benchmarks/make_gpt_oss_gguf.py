"""Make a random-weight GGUF in the real shape of OpenAI's gpt-oss-20b, laid out as ggml-org's released
gpt-oss-20b-mxfp4.gguf is (llama.cpp's converter, file type MXFP4_MOE): the stacked experts MXFP4, the attention
projections, token embedding and output Q8_0, the router, norms, biases and attention sinks F32; its metadata keys
(yarn RoPE, sliding window 128 on every other layer, 32 experts, 4 a token), and o200k_harmony's special tokens at
their ids (199998-200018) with the harmony chat template. For measuring trtbuild against llama.cpp on the same file
(benchmarks/peers.py) without downloading weights: the weights are random (seeded), and the tokenizer is a small
byte-level BPE trained on this repository's docs (benchmarks/make_real_size_model.py's), padded to 201088 tokens.

    python benchmarks/make_gpt_oss_gguf.py --out /work/models/gptoss              # 24 layers, about 12 GB
    python benchmarks/make_gpt_oss_gguf.py --out /work/models/gptoss-2l --layers 2  # a smoke test, about 2 GB

The MXFP4 blocks are drawn directly (an exponent byte and 4-bit codes distributed as a quantized Gaussian's), not
quantized from 19 billion floats; the other tensors are drawn as make_real_size_model.py draws them. Tensors are
written one at a time, so memory stays near the largest (the token embedding, about 1.2 GB while it is encoded).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_tensors import encode  # noqa: E402
from make_real_size_model import ROWS_PER_CHUNK, make_tokenizer, random_rows, write_vocab  # noqa: E402
from real_shapes import GPT_OSS, Shape  # noqa: E402

# openai/gpt-oss-20b's config.json: head_dim 64 (not hidden / heads), intermediate_size per expert
GPT_OSS_20B = Shape(GPT_OSS, 2880, 24, 64, 8, 2880, 201088, False, 150000.0,
                    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=4096), 131072, 1e-5, 128, head_size=64, experts=32,
                    experts_per_tok=4)
FIRST_SPECIAL = 199998  # o200k_harmony's added tokens (real_shapes.HARMONY_SPECIALS) start here
MXFP4_BLOCK, MXFP4_BYTES = 32, 17  # values a block; its exponent byte and 16 bytes of two 4-bit codes
# Each block's E8M0 exponent: its values are e2m1 * 2^(e - 127); with CODE_STD below, e = 120 gives a std of ~0.02
# (transformers' initializer range); a quarter of the blocks one step smaller and a quarter one larger, as trained
# weights' blocks differ in scale (overall std ~0.024)
EXPONENTS = np.array([119, 120, 120, 121], dtype=np.uint8)
CODE_STD = 2.5  # the std, in e2m1 units, of the Gaussian whose quantized codes fill a block (its max lands near 6)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; 8-15 are their negatives


def harmony_tokenizer(out: Path):
    """make_real_size_model's byte-level BPE, laid out as o200k_harmony so the special ids are the released ones
    (<|return|> 200002, <|channel|> 200005, ...): its tokens from id 0, [PADi] fillers up to 199997 (normal tokens in
    the GGUF, as the real ones there are), then the 21 harmony specials in order; the GGUF pads the rest to 201088
    with unused [PADi]. Saved as tokenizer.json beside make_tokenizer's tokenizer_config.json (eos, pad, template)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from trtbuild.builder.convert.gguf_tokenizer import pre_tokenizer_split

    base = make_tokenizer(out, dataclasses.replace(GPT_OSS, specials=()))  # specials placed below, not at ids 0-20
    vocab = base.get_vocab()
    vocab.update({f"[PAD{i}]": i for i in range(len(vocab), FIRST_SPECIAL)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(base.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # o200k's regex (tokenizer.ggml.pre gpt-4o), as the converter rebuilds it
    split = Regex(pre_tokenizer_split("gpt-4o"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = base.decoder
    tok.add_special_tokens(list(GPT_OSS.specials))  # appended in order: ids 199998, 199999, ...
    tok.save(str(out / "tokenizer.json"))
    return tok


def write_metadata(w, shape: Shape, tok) -> None:
    """The keys llama.cpp's GptOssModel writes, as in the released file (no yarn beta keys: its betas 32 / 1 are
    llama.cpp's defaults; no add_bos_token key)."""
    import gguf

    w.add_type("model")
    w.add_name("gpt-oss-20b-random")
    w.add_basename("gpt-oss")
    w.add_size_label("20B")
    w.add_block_count(shape.num_hidden_layers)
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.experts_per_tok)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_sliding_window(shape.sliding_window)  # every other layer from layer 0: llama.cpp's gpt-oss default
    w.add_expert_feed_forward_length(shape.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(shape.rope_scaling["factor"])
    w.add_rope_scaling_orig_ctx_len(shape.rope_scaling["original_max_position_embeddings"])
    write_vocab(w, shape.family, tok, shape.vocab_size)
    w.add_chat_template(shape.family.chat_template)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor: ggml's dims reversed, experts stacked [experts, out, in]."""
    h, e, f = shape.hidden_size, shape.experts, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab_size, h))]
    for i in range(shape.num_hidden_layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,)))
        for proj, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            out += [(p + proj + ".weight", (rows, cols)), (p + proj + ".bias", (rows,))]
        out += [(p + "attn_sinks.weight", (shape.num_attention_heads,)), (p + "post_attention_norm.weight", (h,)),
                (p + "ffn_gate_inp.weight", (e, h)), (p + "ffn_gate_inp.bias", (e,))]
        for proj, rows, cols in (("ffn_gate_exps", f, h), ("ffn_up_exps", f, h), ("ffn_down_exps", h, f)):
            out += [(p + proj + ".weight", (e, rows, cols)), (p + proj + ".bias", (e, rows))]
    return out + [("output_norm.weight", (h,)), ("output.weight", (shape.vocab_size, h))]


def ggml_type(name: str, dims: tuple[int, ...]):
    """The released file's types (llama-quantize's MXFP4_MOE): stacked experts MXFP4, other matrices Q8_0, but the
    router F32 as llama.cpp's converter keeps it; vectors and biases F32 (None)."""
    from gguf import GGMLQuantizationType as Q

    if len(dims) == 3:
        return Q.MXFP4
    if len(dims) == 1 or name.endswith(".bias") or "ffn_gate_inp" in name:
        return None
    return Q.Q8_0


def nbytes(dims: tuple[int, ...], qtype) -> int:
    import gguf

    if qtype is None:
        return int(np.prod(dims)) * 4
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(dims)) // block * type_bytes


@functools.cache
def _code_pairs() -> np.ndarray:
    """Byte value of index i (0-65535): two MXFP4 codes, each picked by a byte of i from 256 equal-probability
    quantiles of N(0, CODE_STD) rounded to the nearest e2m1 value, so uniform random indices give codes distributed
    as a quantized Gaussian's (mostly small, a few at +-6) rather than uniformly."""
    from statistics import NormalDist

    x = np.array([NormalDist(0.0, CODE_STD).inv_cdf((i + 0.5) / 256) for i in range(256)])
    magnitude = np.abs(np.abs(x)[:, None] - np.array(E2M1)).argmin(axis=1)
    code = (magnitude + 8 * ((x < 0) & (magnitude > 0))).astype(np.uint8)
    i = np.arange(65536)
    return code[i & 0xFF] | (code[i >> 8] << 4)


def mxfp4_experts(name: str, dims: tuple[int, int, int], seed: int) -> np.ndarray:
    """Random MXFP4 blocks for stacked experts [experts, rows, cols], each expert from its own seeded stream; the
    raw bytes ggml's MXFP4 tensor holds: per block of 32 an exponent byte, then 16 bytes of code pairs."""
    experts, rows, cols = dims
    blocks = cols // MXFP4_BLOCK
    out = np.empty((experts, rows, blocks, MXFP4_BYTES), dtype=np.uint8)
    pairs = _code_pairs()
    for x in range(experts):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), x])
        out[x, ..., 0] = EXPONENTS[rng.integers(0, len(EXPONENTS), (rows, blocks))]
        out[x, ..., 1:] = pairs[rng.integers(0, 65536, (rows, blocks, MXFP4_BYTES - 1), dtype=np.uint16)]
    return out.reshape(experts, rows, blocks * MXFP4_BYTES)


def tensor_data(name: str, dims: tuple[int, ...], qtype, seed: int) -> np.ndarray:
    """The tensor's bytes as written: MXFP4 blocks drawn directly; sinks ~ N(0, 1) (per-head logits, not weights);
    the rest make_real_size_model's draws (weights std 0.02, norms ~1, biases ~0.1), encoded a chunk of rows at a
    time."""
    if len(dims) == 3:
        return mxfp4_experts(name, dims, seed)
    if name.endswith("attn_sinks.weight"):
        return np.random.default_rng([seed, zlib.crc32(name.encode())]).standard_normal(dims, dtype=np.float32)
    rows = random_rows(name, dims, seed)
    step = ROWS_PER_CHUNK if len(dims) == 2 else dims[0]
    return np.concatenate([encode(rows(a, min(a + step, dims[0])), qtype) for a in range(0, dims[0], step)])


def make_gguf(path: Path, shape: Shape, tok, seed: int) -> None:
    """Write the header, metadata and tensor infos, then each tensor's data in turn."""
    import gguf

    plan = [(name, dims, ggml_type(name, dims)) for name, dims in tensor_shapes(shape)]
    w = gguf.GGUFWriter(str(path), shape.family.arch)
    write_metadata(w, shape, tok)
    for name, dims, qtype in plan:
        w.add_tensor_info(name, dims, np.dtype(np.float32), nbytes(dims, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims, qtype in plan:
        w.write_tensor_data(tensor_data(name, dims, qtype, seed))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=GPT_OSS_20B.num_hidden_layers,
                    help="keep the first N layers (a quick smoke test); default all 24")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 1 <= args.layers <= GPT_OSS_20B.num_hidden_layers:
        ap.error(f"--layers: 1 to {GPT_OSS_20B.num_hidden_layers}")
    shape = dataclasses.replace(GPT_OSS_20B, num_hidden_layers=args.layers)
    (args.out / "tokenizer").mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    tok = harmony_tokenizer(args.out / "tokenizer")
    cut = "" if args.layers == GPT_OSS_20B.num_hidden_layers else f"-{args.layers}layers"
    path = args.out / f"gpt-oss-20b{cut}-mxfp4.gguf"
    make_gguf(path, shape, tok, args.seed)
    print(f"GGUF {path}: {path.stat().st_size / 1e9:.2f} GB ({path.stat().st_size} bytes), "
          f"{time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
