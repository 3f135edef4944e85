"""Make a random-weight model with the real shape of Qwen2.5-0.5B / -1.5B, Llama-3.2-1B / Llama-3.1-8B, SmolLM3-3B (NoPE
layers), Granite 3.3 2B (Granite's multipliers), Gemma 3 1B / Gemma 2 2B (sandwich norms, sliding-window layers,
soft-capping), ERNIE-4.5-0.3B / GLM-4-9B (interleaved RoPE), EXAONE-4.0-1.2B (post norms), AFM-4.5B / StarCoder2-3B
(MLPs without a gate; StarCoder 2's LayerNorms and biases), LFM2-1.2B / LFM2-8B-A1B (short convolution layers; GGUF
only), Qwen3.5-0.8B (gated DeltaNet layers; GGUF only), a Granite-4.0-H-Micro-like 3B (Mamba2 layers; GGUF only),
OLMoE-1B-7B / Granite 3.1 3B-A800M (mixtures of experts; GGUF only) or Phi-3.5-mini / Phi-4-mini (3.8B: fused q/k/v
and gate/up, LongRoPE, Phi-4-mini's partial rotary embeddings; with a byte-level BPE as Phi-4 has), as an HF folder
(bf16 safetensors; `--dtype float32` for float32 weights) and as a GGUF with a Q4_K / Q6_K mix written with the
`gguf` package, for measuring convert / build / load / decode at real sizes. No weights are downloaded: the weights
are random (seeded) and the tokenizer is a small byte-level BPE trained here on this repository's docs, padded to the
model's vocabulary as the real tokenizers are, with the family's special tokens and chat template.

    python benchmarks/make_real_size_model.py --out /work/models/qwen1p5b [--shape 0.5b|1.5b|llama-1b]
    python benchmarks/make_real_size_model.py --out /work/models/llama8b --shape llama-8b --no-hf
    python benchmarks/make_real_size_model.py --out /work/models/phi3 --shape phi3-mini --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/phi4 --shape phi4-mini --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/smollm3 --shape smollm3-3b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/gemma3 --shape gemma3-1b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/gemma3-4b --shape gemma3-4b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/granite --shape granite-2b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/olmo2 --shape olmo2-1b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/olmoe --shape olmoe-1b-7b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/gmoe --shape granite-moe-3b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/ernie --shape ernie4.5-0.3b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/exaone4 --shape exaone4-1.2b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/glm4 --shape glm4-9b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/afm --shape afm-4.5b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/sc2 --shape starcoder2-3b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/lfm2 --shape lfm2-1.2b --no-hf --gguf-type f32
    python benchmarks/make_real_size_model.py --out /work/models/lfm2moe --shape lfm2-8b-a1b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/qwen35 --shape qwen3.5-0.8b --no-hf --gguf-type f16
    python benchmarks/make_real_size_model.py --out /work/models/granite4h --shape granite4-h-micro --no-hf \\
        --gguf-type f16

`--no-hf` writes the GGUF straight from seeded random tensors, one at a time, without the HF folder (an 8B one
would take 16 GB of disk); its tensors are drawn as transformers initializes them. The GGUF is written tensor by
tensor, so memory stays near the largest tensor whatever the model's size.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from gguf_tensors import encode, gguf_type, llama3_rope_freqs, llama_permute  # noqa: E402
from hybrid_metadata import context_length, head_count_kv, write_linear_attention, write_mamba2  # noqa: E402
from real_shapes import (  # noqa: E402
    AFMOE,
    ARCEE,
    ERNIE,
    EXAONE4,
    GEMMA2,
    GEMMA3,
    GEMMAS,
    GLM4,
    GRANITE,
    GRANITEHYBRID,
    GRANITEMOE,
    LFM2,
    LFM2MOE,
    LLAMA3,
    OLMO2,
    PERMUTED,
    PHI3,
    QWEN2,
    QWEN35,
    SHAPES,
    SMOLLM3,
    STARCODER2,
    Family,
    Shape,
)
from shape_tensors import gguf_name, hf_tensors  # noqa: E402

ROWS_PER_CHUNK = 4096  # rows drawn and encoded at a time: bounds memory for the 128k-row token tables


def make_tokenizer(out: Path, family: Family):
    """A byte-level BPE (the family's pre-tokenizer regex) trained on this repository's docs, with its specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    letters = rf"[\p{{L}}{family.marks}]+" if family.marks else r"\p{L}+"
    split = Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?" + letters + "|" + family.digits +
                  r"| ?[^\s\p{L}" + family.marks + r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(split, "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))] + [(REPO / "README.md").read_text()]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=list(family.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    cls = "Qwen2Tokenizer" if family is QWEN2 else "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": cls, "eos_token": family.eos, "pad_token": family.pad, "bos_token": family.bos,
        "chat_template": family.chat_template, "model_max_length": 32768}, indent=2))
    return tok


def make_hf(out: Path, shape: Shape, tok, seed: int, dtype: str) -> None:
    import torch
    import transformers

    kwargs = {k: getattr(shape, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size", "vocab_size",
                                             "tie_word_embeddings", "rope_theta", "rope_scaling",
                                             "max_position_embeddings", "rms_norm_eps")}
    if shape.sliding_window is not None:
        kwargs["sliding_window"] = shape.sliding_window
    config_cls = {QWEN2: transformers.Qwen2Config, PHI3: transformers.Phi3Config, SMOLLM3: transformers.SmolLM3Config,
                  GEMMA2: transformers.Gemma2Config, GEMMA3: transformers.Gemma3TextConfig,
                  GRANITE: transformers.GraniteConfig, OLMO2: transformers.Olmo2Config,
                  ERNIE: transformers.Ernie4_5Config, GLM4: transformers.Glm4Config,
                  EXAONE4: transformers.Exaone4Config, ARCEE: transformers.ArceeConfig,
                  STARCODER2: transformers.Starcoder2Config}.get(shape.family, transformers.LlamaConfig)
    kwargs.update(shape.multipliers or {})
    if shape.head_size:
        kwargs["head_dim"] = shape.head_size
    if shape.family in GEMMAS:  # query_pre_attn_scalar: the head size, as in the released ones
        kwargs["query_pre_attn_scalar"] = shape.head_dim
    if shape.family is GLM4:
        kwargs.update(partial_rotary_factor=shape.partial_rotary_factor, attention_bias=True)
    if shape.family is STARCODER2:  # LayerNorms' epsilon, under its name
        kwargs["norm_epsilon"] = shape.rms_norm_eps
    if shape.family is EXAONE4:  # NOTE: Exaone4Config cannot derive it without a window
        kwargs.update(sliding_window=None, layer_types=["full_attention"] * shape.num_hidden_layers)
    if shape.family is PHI3:
        kwargs["original_max_position_embeddings"] = shape.rope_scaling["original_max_position_embeddings"]
        kwargs["partial_rotary_factor"] = shape.partial_rotary_factor
    vocab = tok.get_vocab()
    cfg = config_cls(**kwargs, eos_token_id=vocab[shape.family.eos], bos_token_id=vocab.get(shape.family.bos),
                     pad_token_id=vocab[shape.family.pad])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():  # norms around 1 and small biases, as in a trained model
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's RMSNorm multiplies by 1 + weight
                p.copy_((0 if shape.family in GEMMAS else 1) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    del model


def random_rows(name: str, shape: tuple[int, ...], seed: int) -> Callable[[int, int], np.ndarray]:
    """Rows [a, b) of a seeded random tensor, drawn as transformers initializes (normal, std 0.02), norms ~1 and
    biases ~0.1 as in a trained model; each chunk of rows from its own stream, so any chunking gives the same."""
    def rows(a: int, b: int) -> np.ndarray:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), a])
        x = rng.standard_normal((b - a, *shape[1:]), dtype=np.float32)
        if name.endswith("norm.weight"):
            return 1 + 0.1 * x
        if name.endswith(".A_log"):  # drawn as the GGUFs hold it, ssm_a = -exp(A_log), in Mamba2's A_init_range
            return -rng.uniform(1, 16, (b - a, *shape[1:])).astype(np.float32)  # (1, 16); transformers' Qwen3.5
            # A_log is log(uniform(0, 16)), kept off 0 here; its Granite 4.0-H one log(1 .. heads)
        if name.endswith((".dt_bias", ".D")):  # transformers' ones (Mamba2's D: the skip)
            return 1 + 0.1 * x
        return (0.1 if name.endswith(".bias") else 0.02) * x
    return rows


def write_metadata(w, shape: Shape, tok) -> None:
    import gguf

    fam = shape.family
    w.add_name(f"{fam.arch}-random")
    w.add_context_length(context_length(shape))
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.dense_intermediate_size or shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    if fam is AFMOE:  # AfmoeModel.set_gguf_parameters (llama.cpp's default sliding pattern: every fourth full)
        w.add_expert_feed_forward_length(shape.intermediate_size)
        w.add_expert_shared_count(shape.shared_experts)
        w.add_leading_dense_block_count(shape.dense_layers)
        w.add_sliding_window(shape.sliding_window)
    if fam is LFM2MOE:  # LFM2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(shape.intermediate_size)
        w.add_leading_dense_block_count(shape.dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_head_count_kv(head_count_kv(shape))
    if fam in (LFM2, LFM2MOE):  # LFM2Model.set_gguf_parameters
        w.add_shortconv_l_cache(3)
        w.add_vocab_size(shape.vocab_size)
    w.add_rope_freq_base(shape.rope_theta)
    if fam is STARCODER2:  # LayerNorms (TextModel.set_gguf_parameters, from norm_epsilon)
        w.add_layer_norm_eps(shape.rms_norm_eps)
    else:
        w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    if fam in PERMUTED:  # LlamaModel.set_gguf_parameters
        w.add_rope_dimension_count(shape.head_dim)
        w.add_vocab_size(shape.vocab_size)
    if shape.head_size:  # TextModel.set_gguf_parameters, where the config gives head_dim
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.linear_attention is not None:
        write_linear_attention(w, shape)
    if shape.mamba2 is not None:
        write_mamba2(w, shape)
    if shape.rope_scaling and shape.rope_scaling["rope_type"] == "yarn":  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.rope_scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(shape.rope_scaling["original_max_position_embeddings"])
    if fam is GLM4:  # Glm4Model.set_gguf_parameters
        w.add_rope_dimension_count(shape.rotary_dim)
    if fam is PHI3:  # Phi3MiniModel.set_gguf_parameters
        orig = shape.rope_scaling["original_max_position_embeddings"]
        scale = shape.max_position_embeddings / orig
        w.add_rope_dimension_count(shape.rotary_dim)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        w.add_sliding_window(shape.sliding_window or 0)
    if shape.experts:  # TextModel.set_gguf_parameters
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_per_tok)
    if fam in (GRANITE, GRANITEMOE, GRANITEHYBRID):  # GraniteModel.set_gguf_parameters
        m = shape.multipliers
        w.add_attention_scale(m["attention_multiplier"])
        w.add_embedding_scale(m["embedding_multiplier"])
        w.add_residual_scale(m["residual_multiplier"])
        w.add_logit_scale(m["logits_scaling"])
    if fam in GEMMAS:  # Gemma2Model / Gemma3Model.set_gguf_parameters
        w.add_sliding_window(shape.sliding_window)
        if fam is GEMMA2:
            w.add_attn_logit_softcapping(50.0)
            w.add_final_logit_softcapping(30.0)
        else:
            w.add_rope_freq_base_swa(10000.0)
            if shape.rope_scaling and shape.rope_scaling["rope_type"] == "linear":  # the full layers' (4B and up)
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(shape.rope_scaling["factor"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    write_vocab(w, fam, tok, shape.vocab_size)
    w.add_add_bos_token(fam.bos is not None)
    w.add_chat_template(fam.chat_template)


def write_vocab(w, fam: Family, tok, vocab_size: int) -> None:
    """tokenizer.ggml.* as llama.cpp's converter writes a byte-level BPE: `tok`'s tokens at their ids, padded with
    unused [PADi] to the embedding's rows; the family's specials as control tokens, with its bos / eos / pad ids.
    Shared with make_gpt_oss_gguf.py, whose vocabulary puts its specials at fixed high ids."""
    import gguf

    vocab = tok.get_vocab()
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if t in fam.specials else gguf.TokenType.NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fam.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(vocab[fam.eos])
    w.add_pad_token_id(vocab[fam.pad])
    if fam.bos is not None:
        w.add_bos_token_id(vocab[fam.bos])


def make_gguf(path: Path, shape: Shape, tok, hf: Path | None, seed: int, form: str = "q4_k_m") -> None:
    """The model as a GGUF, tensor by tensor: from the HF folder `hf`, or random (`seed`) when it is None.
    `form` f32 / f16: every matrix in that type (for llama.cpp's own `llama-quantize` to make Q8_0, Q4_0, Q4_K_M ...
    from); q4_k_m: gguf_type's mix."""
    import gguf

    from trtbuild.builder.convert.safetensors_io import SafetensorsFile

    stored = {}
    if hf is not None:
        for f in sorted(hf.glob("*.safetensors")):
            st = SafetensorsFile(f)
            stored.update({name: st for name in st})

    @functools.lru_cache(maxsize=1)  # the tensor being written, read once for all its chunks
    def load(name: str) -> np.ndarray:
        return stored[name][name].float().numpy()

    heads = {"q_proj": shape.num_attention_heads, "k_proj": shape.num_key_value_heads}
    w = gguf.GGUFWriter(str(path), shape.family.arch)
    write_metadata(w, shape, tok)
    plan = []
    factors = {}
    if shape.family in (LLAMA3, EXAONE4) and shape.rope_scaling:  # LlamaModel, Exaone4Model
        factors["rope_freqs.weight"] = llama3_rope_freqs(shape)
    elif shape.family is PHI3:  # LongRoPE's two sets, as llama.cpp's Phi3MiniModel writes them
        factors = {f"rope_factors_{k}.weight": np.array(shape.rope_scaling[f"{k}_factor"], dtype=np.float32)
                   for k in ("long", "short")}
    for name, f in factors.items():
        plan.append((name, f.shape, None, lambda a, b, f=f: f[a:b]))

    def source(name: str, dims: tuple[int, ...]) -> Callable[[int, int], np.ndarray]:
        if hf is None:
            rows = random_rows(name, dims, seed)
        else:
            shift = 1.0 if shape.family in GEMMAS and name.endswith("norm.weight") else 0.0  # Gemma: 1 + weight

            def rows(a: int, b: int) -> np.ndarray:
                return load(name)[a:b] + shift
        proj = name.split(".")[-2]
        if shape.family not in PERMUTED or proj not in heads:
            return rows

        def permuted(a: int, b: int) -> np.ndarray:  # llama GGUFs hold q / k rows permuted
            return llama_permute(rows(0, dims[0]), heads[proj])[a:b]
        return permuted

    for name, dims in hf_tensors(shape):
        gname = gguf_name(name, shape.family)
        plan.append((gname, dims, gguf_type(gname, dims[-1], form), source(name, dims)))
    for name, dims, qtype, _ in plan:
        nbytes = int(np.prod(dims)) * 4
        if qtype is not None:
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) // block * type_bytes
        w.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, dims, qtype, rows in plan:
        step = ROWS_PER_CHUNK if len(dims) == 2 else dims[0]
        w.write_tensor_data(np.concatenate([encode(rows(a, min(a + step, dims[0])), qtype)
                                            for a in range(0, dims[0], step)]))
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf-type", choices=["q4_k_m", "f32", "f16"], default="q4_k_m",
                    help="f32 / f16: for llama-quantize to make the other types from (benchmarks/peers.py)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the HF weights' type: bfloat16 as released checkpoints are; float32 for weights that no "
                         "16-bit type holds exactly (as in a model trained and saved in float32)")
    ap.add_argument("--no-hf", action="store_true", help="write only the GGUF, from seeded random tensors")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    if (shape.experts or shape.family in (LFM2, LFM2MOE, QWEN35, GRANITEHYBRID)) and not args.no_hf:
        ap.error(f"{args.shape} is written as a GGUF only: pass --no-hf")
    hf = None if args.no_hf else args.out / "hf"
    tok_dir = args.out / "tokenizer" if hf is None else hf
    tok_dir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    tok = make_tokenizer(tok_dir, shape.family)
    if hf is not None and not (hf / "config.json").is_file():
        make_hf(hf, shape, tok, args.seed, args.dtype)
        print(f"HF folder {hf}: {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    gguf_path = args.out / f"model-{args.gguf_type.upper()}.gguf"
    make_gguf(gguf_path, shape, tok, hf, args.seed, args.gguf_type)
    print(f"GGUF {gguf_path}: {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
