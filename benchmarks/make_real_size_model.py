"""Make a random-weight model with the real shape of Qwen2.5-1.5B (or -0.5B), as an HF folder (bf16 safetensors;
`--dtype float32` for float32 weights) and as a GGUF with a Q4_K / Q6_K mix written with the `gguf` package, for
measuring convert / build / load / decode at real sizes. No weights are downloaded: the weights are random (seeded)
and the tokenizer is a small byte-level BPE trained here, padded to the model's vocabulary as Qwen's own tokenizer
is.

    python benchmarks/make_real_size_model.py --out /work/models/qwen2.5-1.5b-random [--shape 0.5b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

SHAPES = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, ffn, vocab, tied)
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(out: Path):
    """A byte-level BPE (Qwen2-style pre-tokenizer) trained on this repository's docs, with ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))] + [(REPO / "README.md").read_text()]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHAT_TEMPLATE, "model_max_length": 32768}, indent=2))
    return tok


def make_hf(out: Path, shape: str, seed: int, dtype: str) -> None:
    import torch
    import transformers

    cfg = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1000000.0,
                                   rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms around 1 and small biases, as in a trained model
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    del model


def make_gguf(hf: Path, path: Path, tok, f32: bool = False) -> None:
    """The HF folder as a qwen2 GGUF: Q6_K for output, attn_v and ffn_down, Q4_K elsewhere (as llama.cpp's
    Q4_K_M gives its most sensitive tensors 6 bits; Q8_0 where rows are not a multiple of 256), F32 norms and
    biases. `f32`: every tensor F32 (for llama.cpp's own `llama-quantize` to make Q8_0, Q4_0, Q4_K_M from)."""
    import gguf
    from gguf_kquants import encode_q4_k, encode_q6_k

    from trtbuild.builder.convert.safetensors_io import SafetensorsFile

    cfg = json.loads((hf / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("qwen2.5-random")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    vocab = tok.get_vocab()
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [gguf.TokenType.UNUSED] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    files = [SafetensorsFile(f) for f in sorted(hf.glob("*.safetensors"))]
    for st in files:
        for name in st:
            if name in names:
                gname = names[name]
            else:
                _, _, i, rest = name.split(".", 3)
                module, kind = rest.rsplit(".", 1)
                gname = f"blk.{i}.{layer[module]}.{kind}"
            x = st[name].float().numpy()
            if x.ndim == 1 or f32:
                w.add_tensor(gname, x)
                continue
            if x.shape[1] % 256:  # K-quants need rows of 256k values; llama.cpp's Q4_K_M falls back to Q8_0 too
                w.add_tensor(gname, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            six = gname.split(".")[-2] in ("output", "attn_v", "ffn_down")
            qtype = gguf.GGMLQuantizationType.Q6_K if six else gguf.GGMLQuantizationType.Q4_K
            w.add_tensor(gname, encode_q6_k(x) if six else encode_q4_k(x), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf-type", choices=["q4_k_m", "f32"], default="q4_k_m",
                    help="f32: for llama-quantize to make the other types from (benchmarks/peers.py)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the HF weights' type: bfloat16 as released checkpoints are; float32 for weights that no "
                         "16-bit type holds exactly (as in a model trained and saved in float32)")
    args = ap.parse_args()
    hf = args.out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    tok = make_tokenizer(hf)
    if not (hf / "config.json").is_file():
        make_hf(hf, args.shape, args.seed, args.dtype)
    print(f"HF folder {hf}: {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    gguf_path = args.out / f"model-{args.gguf_type.upper()}.gguf"
    make_gguf(hf, gguf_path, tok, f32=args.gguf_type == "f32")
    print(f"GGUF {gguf_path}: {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
