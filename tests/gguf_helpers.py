"""Test helpers (importable as `gguf_helpers`): HF model folders with tokenizers and chat templates, and a GGUF writer
that does what llama.cpp's convert_hf_to_gguf.py does for Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Gemma 1/2/3,
Granite, OLMo 2 / 3, ERNIE 4.5, GLM-4, EXAONE 4, Cohere / Cohere 2, Ministral 3 and the mixtures of experts
Qwen3-MoE, Mixtral, OLMoE and Granite MoE (with --outtype f32)."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf_recurrent_helpers import (
    add_granite_hybrid_parameters,
    add_nemotron_h_parameters,
    add_qwen35_parameters,
    granite_hybrid_tensor,
    mamba2_hf_config,
    nemotron_h_hf_config,
    qwen35_tensor,
)
from helpers import STORIES260K, make_random_hf_model

# The Split regex of Qwen2's tokenizer.json
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
# Texts the rebuilt tokenizer must encode like the original: ASCII, non-ASCII, decomposed (NFC), digits, whitespace,
# contractions and special / added tokens.
PROBE_TEXTS = (
    "hello world, the quick brown fox",
    "héllo 世界 🙂",
    "he\u0301llo",
    "1234567 digits 3.14159",
    "  two  spaces\n\nnew\tlines ",
    "I'VE been told he's there",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<think>ok</think>",
    "<s>Once upon a time</s>",
    "a</s>\n  b</s> <s> c",
)
# the architectures llama.cpp's LlamaModel converts (q / k rows permuted)
PERMUTED = ("llama", "smollm3", "granite", "granitemoe", "mistral3", "arcee", "afmoe", "granitehybrid", "nemotron_h")
# HF family -> (GGUF architecture llama.cpp writes, vocabulary kind, general.name)
FAMILIES = {
    "llama": ("llama", "spm", "Llama Tiny"),
    "mistral": ("llama", "spm", "Mistral Tiny"),
    "qwen2": ("qwen2", "bpe", "Qwen2.5 Tiny"),
    "qwen2_yarn": ("qwen2", "bpe", "Qwen2.5 Tiny"),
    "qwen3": ("qwen3", "bpe", "Qwen3 Tiny"),
    "phi3": ("phi3", "spm", "Phi3 Tiny"),
    "phi3_longrope": ("phi3", "spm", "Phi3 Tiny"),
    "phi3_partial": ("phi3", "spm", "Phi3 Tiny"),
    "smollm3": ("smollm3", "bpe", "SmolLM3 Tiny"),
    # a SentencePiece vocabulary in an architecture transformers' GGUF loader does not know: only its tokenizer
    # code reads it (builder/convert/gguf_tokenizer.py)
    "smollm3_spm": ("smollm3", "spm", "SmolLM3 Tiny"),
    # a SentencePiece vocabulary without the prefix space, as Gemma's (tokenizer.ggml.add_space_prefix false)
    "gemma": ("gemma", "spm", "Gemma Tiny"),
    "gemma2": ("gemma2", "spm", "Gemma2 Tiny"),
    "gemma3": ("gemma3", "spm", "Gemma3 Tiny"),
    "granite": ("granite", "spm", "Granite Tiny"),
    "olmo2": ("olmo2", "spm", "OLMo2 Tiny"),
    "olmo3": ("olmo2", "spm", "OLMo3 Tiny"),  # llama.cpp's Olmo2Model writes OLMo 3 too
    # mixtures of experts, their experts stacked per layer (llama.cpp writes Mixtral as llama)
    "qwen3_moe": ("qwen3moe", "bpe", "Qwen3 MoE Tiny"),
    "mixtral": ("llama", "spm", "Mixtral Tiny"),
    "olmoe": ("olmoe", "spm", "OLMoE Tiny"),
    "granitemoe": ("granitemoe", "spm", "Granite MoE Tiny"),
    # Granite 4.0 without Mamba2 layers: GraniteHybridModel writes them as granite / granitemoe
    "granite4": ("granite", "spm", "Granite 4.0 Tiny"),
    "granite4_moe": ("granitemoe", "spm", "Granite 4.0 MoE Tiny"),
    # Granite 4.0-H: GraniteHybridModel with Mamba2 layers
    "granite4_h": ("granitehybrid", "spm", "Granite 4.0-H Tiny"),
    "granite4_h_moe": ("granitehybrid", "spm", "Granite 4.0-H MoE Tiny"),
    "nemotron_h": ("nemotron_h", "bpe", "Nemotron-H Tiny"),
    "mamba2": ("mamba2", "bpe", "Mamba2 Tiny"),
    "qwen2_moe": ("qwen2moe", "bpe", "Qwen2 MoE Tiny"),
    "gpt_oss": ("gpt-oss", "bpe", "GPT OSS Tiny"),
    "ernie4_5": ("ernie4_5", "spm", "ERNIE 4.5 Tiny"),
    "glm4": ("glm4", "bpe", "GLM 4 Tiny"),
    "exaone4": ("exaone4", "bpe", "EXAONE 4.0 Tiny"),
    "exaone4_window": ("exaone4", "bpe", "EXAONE 4.0 Tiny"),
    "cohere": ("command-r", "bpe", "Command R Tiny"),
    "cohere2": ("cohere2", "bpe", "Command R7B Tiny"),
    "ministral3": ("mistral3", "spm", "Ministral 3 Tiny"),
    "arcee": ("arcee", "bpe", "AFM Tiny"),
    "apertus": ("apertus", "bpe", "Apertus Tiny"),
    "afmoe": ("afmoe", "bpe", "AFMoE Tiny"),
    "qwen3_5": ("qwen35", "bpe", "Qwen3.5 Tiny"),
    "qwen3_5_moe": ("qwen35moe", "bpe", "Qwen3.5 MoE Tiny"),
    "starcoder2": ("starcoder2", "bpe", "StarCoder2 Tiny"),
    "hunyuan_dense": ("hunyuan-dense", "bpe", "Hunyuan Tiny"),
    "lfm2": ("lfm2", "bpe", "LFM2 Tiny"),
    "lfm2_wide": ("lfm2", "bpe", "LFM2 Tiny"),
    "lfm2_moe": ("lfm2moe", "bpe", "LFM2 MoE Tiny"),
    "lfm2_moe_raw": ("lfm2moe", "bpe", "LFM2 MoE Tiny"),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward)\.experts)\.(\d+)\.(\w+\.weight)$")


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert tensors as one [experts, out, in] tensor per projection, as llama.cpp's converters
    merge them (`model.layers.{i}.mlp.experts.gate_proj.weight`, Mixtral's `...block_sparse_moe.experts.w1.weight`)."""
    out, experts = {}, {}
    for name, data in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = data
        else:
            out[name] = data
    for name, parts in experts.items():
        out[name] = np.stack([parts[e] for e in sorted(parts)])
    for name in [n for n in out if n.endswith("block_sparse_moe.input_linear.weight")]:  # GraniteMoeModel: split
        gate, up = np.split(out.pop(name), 2, axis=1)
        layer = name.removesuffix(".block_sparse_moe.input_linear.weight")
        out[f"{layer}.mlp.experts.gate_proj.weight"], out[f"{layer}.mlp.experts.up_proj.weight"] = gate, up
    # Granite 4.0's shared_mlp (GraniteMoeModel.modify_tensors): the shared expert beside experts, else the MLP
    mlp = "mlp.shared_expert" if any("block_sparse_moe" in n for n in out) else "mlp"
    for name in [n for n in out if ".shared_mlp." in n]:
        layer, which = name.split(".shared_mlp.")
        if which.startswith("input_linear"):
            out[f"{layer}.{mlp}.gate_proj.weight"], out[f"{layer}.{mlp}.up_proj.weight"] = np.split(out.pop(name), 2)
        else:
            out[f"{layer}.{mlp}.down_proj.weight"] = out.pop(name)
    return out


def _gpt_oss_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GptOssModel.modify_tensors for float experts: gate_up_proj [experts, in, 2 x out] split into its even (gate)
    and odd (up) columns and transposed to [experts, out, in], as down_proj; biases split alike; `sinks.weight`."""
    out = {}
    for name, data in tensors.items():
        if name.endswith("gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            t = data.transpose(0, 2, 1)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t[:, ::2], t[:, 1::2]
        elif name.endswith("gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            out[base + "gate_proj.bias"], out[base + "up_proj.bias"] = data[:, ::2], data[:, 1::2]
        elif name.endswith("down_proj"):
            out[name + ".weight"] = data.transpose(0, 2, 1)
        elif name.endswith("down_proj_bias"):
            out[name.removesuffix("_bias") + ".bias"] = data
        else:
            out[name + (".weight" if name.endswith("sinks") else "")] = data
    return {n: np.ascontiguousarray(t) for n, t in out.items()}


def qwen_tokenizer() -> object:
    """A tiny Qwen2-style byte-level BPE (`tokenizers.Tokenizer`): NFC, Qwen2's split regex, trained merges, the
    special tokens <|endoftext|> <|im_start|> <|im_end|> and the plain added token <think>."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    corpus = ["hello world, the quick brown fox jumps over the lazy dog 12345", "héllo 世界 🙂 naïve café",
              "I've been told he's there, they'll see"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tok


def make_hf_folder(family: str, out_dir: Path, overrides: dict | None = None) -> Path:
    """A random `family` model with a tokenizer and a chat template: stories260K's SentencePiece tokenizer for
    llama/mistral/phi3 (vocab 512), the Qwen-style BPE of `qwen_tokenizer` for qwen2/qwen3 (vocab 320, so that unused
    slots pad the GGUF's token list as in real Qwen files)."""
    if FAMILIES[family][1] == "spm":
        make_random_hf_model(family, out_dir, overrides={"vocab_size": 512, **(overrides or {})})
        for name in ("tokenizer.model", "tokenizer.json"):
            shutil.copy(STORIES260K / name, out_dir / name)
        if family.startswith("phi3"):  # Phi-3's tokenizer.json: the prefix space from a normalizer, as llama.cpp,
            tok = json.loads((out_dir / "tokenizer.json").read_text())  # and </s> strips the whitespace after it
            tok["normalizer"] = {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
            tok["pre_tokenizer"] = None
            for added in tok["added_tokens"]:
                added["rstrip"] = added["content"] == "</s>"
            (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        if family.startswith("gemma"):  # Gemma's tokenizer.json: spaces become "▁", none is prefixed
            tok = json.loads((out_dir / "tokenizer.json").read_text())
            tok["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
            tok["pre_tokenizer"] = None
            tok["decoder"] = {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]}
            (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
        cfg = json.loads((STORIES260K / "tokenizer_config.json").read_text()) | {"chat_template": LLAMA_TEMPLATE}
    else:
        tok = qwen_tokenizer()
        ids = {t: tok.token_to_id(t) for t in QWEN_SPECIALS}
        make_random_hf_model(family, out_dir, overrides={"bos_token_id": ids["<|endoftext|>"],
                                                         "eos_token_id": ids["<|im_end|>"], **(overrides or {})})
        tok.save(str(out_dir / "tokenizer.json"))
        cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
               "chat_template": QWEN_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return out_dir


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp LlamaModel.permute: HF rotate_half rows -> GGML's interleaved RoPE rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_spm_vocab(w: gguf.GGUFWriter, hf_dir: Path, n_vocab: int) -> None:
    """TextModel._set_vocab_sentencepiece."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [gguf.TokenType.UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i], scores[i] = sp.IdToPiece(i).encode(), sp.GetScore(i)
        types[i] = (gguf.TokenType.UNKNOWN if sp.IsUnknown(i) else gguf.TokenType.CONTROL if sp.IsControl(i)
                    else gguf.TokenType.UNUSED if sp.IsUnused(i) else gguf.TokenType.BYTE if sp.IsByte(i)
                    else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, n_vocab=n_vocab).add_to_gguf(w)


def _add_bpe_vocab(w: gguf.GGUFWriter, hf_dir: Path, n_vocab: int, pre: str = "qwen2") -> None:
    """TextModel._set_vocab_gpt2 / get_vocab_base (the pre-tokenizer hash of a real Qwen tokenizer gives "qwen2", of
    a Qwen3.5 one "qwen35")."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        looks_special = reverse[i].startswith("<|") and reverse[i].endswith("|>")
        types.append(gguf.TokenType.NORMAL if i not in added else gguf.TokenType.CONTROL
                     if added[i].special or looks_special else gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(w)


def _encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw GGUF blocks of `data` [rows, cols] in `qtype` (K-quants and IQ types by tests/gguf_kquants.py: the lattice
    ones random blocks of data's magnitude; others by gguf)."""
    from gguf_kquants import (
        encode_iq4_nl,
        encode_iq4_xs,
        encode_q2_k,
        encode_q3_k,
        encode_q4_k,
        encode_q5_k,
        encode_q6_k,
        random_lattice_blocks,
    )

    from trtbuild.builder.convert.gguf_lattice import LATTICE_TYPES

    if data.ndim == 3:  # stacked experts: their rows one after the other
        return _encode(data.reshape(-1, data.shape[-1]), qtype).reshape(*data.shape[:-1], -1)
    Q = gguf.GGMLQuantizationType
    encoders = {Q.Q2_K: encode_q2_k, Q.Q3_K: encode_q3_k, Q.Q4_K: encode_q4_k, Q.Q5_K: encode_q5_k,
                Q.Q6_K: encode_q6_k, Q.IQ4_NL: encode_iq4_nl, Q.IQ4_XS: encode_iq4_xs}
    if qtype in LATTICE_TYPES:
        return random_lattice_blocks(data, qtype, seed=zlib.crc32(np.ascontiguousarray(data).tobytes()))
    return encoders[qtype](data) if qtype in encoders else gguf.quants.quantize(data, qtype)


def _add_phi3_parameters(w: gguf.GGUFWriter, cfg: dict, head_dim: int) -> None:
    """Phi3MiniModel.set_gguf_parameters / generate_extra_tensors (LongRoPE's factors as tensors)."""
    import math

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    orig = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))


def _add_yarn_parameters(w: gguf.GGUFWriter, cfg: dict) -> None:
    """TextModel.set_gguf_parameters for rope_type yarn (with a factor): the factor, the original context, and the
    attention factor and betas where the config gives them."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    if rope.get("rope_type") != "yarn" or rope.get("factor") is None:
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                     ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(rope[key])


def _add_gemma_parameters(w: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    """Gemma2Model / Gemma3Model.set_gguf_parameters (GemmaModel adds only add_space_prefix). NOTE: llama.cpp's
    converter writes no sliding_window_pattern for Gemma 3 (every released one has every sixth layer full, the
    default it assumes); this writes the model's own layers, so that a tiny model's layers are what HF runs."""
    w.add_add_space_prefix(False)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        full, local = cfg["rope_parameters"]["full_attention"], cfg["rope_parameters"]["sliding_attention"]
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(local["rope_theta"])


def _lfm2_features(cfg: dict) -> int:
    """LFM2Model._add_feed_forward_length: the MLP's features as the model computes them from block_ff_dim."""
    features = cfg.get("block_ff_dim") or cfg["intermediate_size"]
    if cfg["block_auto_adjust_ff_dim"]:
        features = int(cfg["block_ffn_dim_multiplier"] * int(2 * features / 3))
        features = -(-features // cfg["block_multiple_of"]) * cfg["block_multiple_of"]
    return features


def _llama3_rope_freqs(rope: dict, base: float, dim: int) -> np.ndarray:
    """The divisor of each rotary frequency that llama.cpp's converter stores for rope_type llama3."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf_like_llama_cpp(hf_dir: Path, path: Path, family: str,
                              qtypes: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """Write the HF folder `hf_dir` of `family` as llama.cpp's converter does (f32 tensors, or the GGML type
    `qtypes` gives a GGUF tensor name)."""
    from safetensors.numpy import load_file

    arch, vocab_kind, name = FAMILIES[family]
    cfg = json.loads((hf_dir / "config.json").read_text())
    if arch in ("nemotron_h", "mamba2"):
        cfg = (nemotron_h_hf_config if arch == "nemotron_h" else mamba2_hf_config)(cfg)
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // max(heads, 1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)  # llama.cpp derives it from the model folder's name
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    granite4_dense = cfg["model_type"] == "granitemoehybrid" and not cfg.get("num_local_experts")
    w.add_feed_forward_length(_lfm2_features(cfg) if arch == "lfm2" else cfg["shared_intermediate_size"]
                              if granite4_dense else cfg["intermediate_size"])
    w.add_head_count(heads)
    if arch in ("lfm2", "lfm2moe"):  # LFM2Model.set_gguf_parameters: no KV heads in the convolution layers
        w.add_head_count_kv([0 if t == "conv" else kv_heads for t in cfg["layer_types"]])
        w.add_shortconv_l_cache(cfg["conv_L_cache"])
        w.add_vocab_size(cfg["vocab_size"])
    else:
        w.add_head_count_kv(kv_heads)
    rope = cfg.get("rope_parameters") or {}
    base = cfg.get("rope_theta") or rope.get("full_attention", rope)["rope_theta"]
    if arch == "hunyuan-dense" and rope.get("alpha"):  # HunYuanModel.set_gguf_parameters: alpha folded into the base
        base *= rope["alpha"] ** (head_dim / (head_dim - 2))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
    w.add_rope_freq_base(base)
    if arch in ("lfm2", "lfm2moe"):
        w.add_layer_norm_rms_eps(cfg["norm_eps"])
    elif "layer_norm_eps" in cfg:  # TextModel.set_gguf_parameters: a LayerNorm model's epsilon
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "head_dim" in cfg:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in PERMUTED:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        _add_phi3_parameters(w, cfg, head_dim)
    _add_yarn_parameters(w, cfg)
    if arch.startswith("gemma"):
        _add_gemma_parameters(w, cfg, arch)
    if arch == "mistral3":  # Ministral3Model.set_gguf_parameters
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch in ("command-r", "cohere2"):  # CommandR2Model / Cohere2Model.set_gguf_parameters
        w.add_logit_scale(cfg["logit_scale"])
    if arch == "cohere2":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "glm4":  # Glm4Model.set_gguf_parameters
        w.add_rope_dimension_count(int(head_dim * (cfg.get("partial_rotary_factor")
                                                   or rope.get("partial_rotary_factor"))))
    if cfg["model_type"] in ("olmo3", "exaone4") and cfg.get("sliding_window"):  # Olmo2Model, Exaone4Model
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if experts := cfg.get("num_experts") or cfg.get("num_local_experts"):  # TextModel.set_gguf_parameters
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:  # Qwen2MoeModel, Qwen3MoeModel
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if shared := cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(shared)
    if arch == "lfm2moe":  # LFM2MoeModel.set_gguf_parameters
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if cfg["routed_scaling_factor"] != 1.0:  # NOTE: llama.cpp's converter drops it (1.0 in the released models)
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if arch == "afmoe":  # AfmoeModel.set_gguf_parameters (no sliding window pattern: llama.cpp's default is 4)
        w.add_expert_shared_count(cfg["num_shared_experts"])
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_weights_scale(cfg["route_scale"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if arch == "granitehybrid":
        add_granite_hybrid_parameters(w, cfg)
    if arch in ("nemotron_h", "mamba2"):
        add_nemotron_h_parameters(w, cfg)
    if arch in ("granite", "granitemoe", "granitehybrid"):  # GraniteModel.set_gguf_parameters
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch in ("qwen35", "qwen35moe"):
        add_qwen35_parameters(w, cfg, head_dim)
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, base, head_dim))
    if vocab_kind == "spm":
        _add_spm_vocab(w, hf_dir, cfg["vocab_size"])
    else:
        _add_bpe_vocab(w, hf_dir, cfg["vocab_size"], "qwen35" if arch.startswith("qwen35") else "qwen2")
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if arch == "apertus":  # ApertusModel.modify_tensors: the xIELU scalars as metadata, a value per layer
        for p in ("alpha_n", "alpha_p", "beta", "eps"):
            getattr(w, f"add_xielu_{p}")([float(tensors.pop(f"model.layers.{i}.mlp.act_fn.{p}").reshape(()))
                                          for i in range(layers)])
    names = gguf.get_tensor_name_map(model_arch, layers)
    for hf_name, data in (_gpt_oss_tensors if arch == "gpt-oss" else _stack_experts)(tensors).items():
        if arch in PERMUTED and hf_name.endswith(("q_proj.weight", "q_proj.bias")):  # LlamaModel.undo_permute
            data = _permute(data, heads)
        elif arch in PERMUTED and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, kv_heads)
        if arch in ("qwen35", "qwen35moe"):
            hf_name, data = qwen35_tensor(hf_name, data, cfg)
        if arch in ("granitehybrid", "nemotron_h", "mamba2"):
            hf_name, data = granite_hybrid_tensor(hf_name, data, cfg)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):  # GemmaModel.modify_tensors
            data = data + 1
        if "conv.conv" in hf_name:  # LFM2Model.modify_tensors: [hidden, 1, L] -> [hidden, L]
            data = data.squeeze(1)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or names.get_name(
            hf_name.removeprefix("model."), try_suffixes=(".weight",))  # LFM2MoeModel's merged experts' names
        if hf_name.endswith(".expert_bias"):  # LFM2MoeModel.filter_tensors: named ...expert_bias.bias
            gguf_name += ".bias"
        qtype = (qtypes or {}).get(gguf_name)
        if qtype is None:
            w.add_tensor(gguf_name, data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, data.astype(np.float16))
        else:
            w.add_tensor(gguf_name, _encode(data.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
