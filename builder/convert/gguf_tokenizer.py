"""Rebuild the tokenizer a GGUF embeds as Hugging Face files: tokenizer.json, tokenizer_config.json (with the chat
template) and special_tokens_map.json.

Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2") whose `tokenizer.ggml.pre` is in `_PRE_TOKENIZERS` (Qwen2/
Qwen2.5/Qwen3, Llama 3, gpt-oss) are rebuilt here with the `tokenizers` library from the tokens, merges and token
types, with the normalizer, pre-tokenizer and BPE options of the original tokenizer.json. transformers' GGUF loader
gets these wrong in ways that change token ids (no NFC normalizer for Qwen, no ignore_merges for Llama 3) and its
behaviour varies with its version. SentencePiece vocabularies ("llama") and other pre-tokenizers still go through
transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtbuild.builder.convert.gguf_reader import _fields, _open
from trtbuild.errors import CheckpointError

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5


@dataclass(frozen=True)
class _PreTokenizer:
    """How the original tokenizer.json splits text before BPE, for one `tokenizer.ggml.pre`."""

    split: str  # the regex of its Split pre-tokenizer (isolated), followed by ByteLevel without a regex
    digits_first: bool = False  # every digit split off before `split` runs on the rest (llama.cpp's STARCODER)
    nfc: bool = False  # NFC normalizer first
    ignore_merges: bool = False  # a pre-token that is in the vocabulary is one token, whatever the merges say
    add_bos: bool = False  # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token


_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _PreTokenizer(_WORDS + r"|\p{N}" + _REST, nfc=True)  # digits one by one
_LLAMA3 = _PreTokenizer(_WORDS + r"|\p{N}{1,3}" + _REST, ignore_merges=True, add_bos=True)
# Qwen3.5: Qwen2's, with combining marks (\p{M}) kept in words
_QWEN35 = _PreTokenizer(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", nfc=True)
# o200k (gpt-4o, gpt-oss): words split before capitals, a contraction kept on its word, digits by three
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION, _LEAD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"[^\r\n\p{L}\p{N}]?"
_GPT4O = _PreTokenizer(f"{_LEAD}{_UPPER}*{_LOWER}+{_CONTRACTION}|{_LEAD}{_UPPER}+{_LOWER}*{_CONTRACTION}"
                       r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Mistral Nemo / Small, Ministral 3): o200k's word split without contractions, digits one by one
_TEKKEN = _PreTokenizer(f"{_LEAD}{_UPPER}*{_LOWER}+|{_LEAD}{_UPPER}+{_LOWER}*"
                        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+", ignore_merges=True, add_bos=True)
_GLM4 = _PreTokenizer(_LLAMA3.split, ignore_merges=True)  # llama.cpp's CHATGLM4: Llama 3's split, no BOS
_GPT2 = _PreTokenizer(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")  # EXAONE 4
# StarCoder 2, SmolLM / SmolLM2, Command R and the others llama.cpp groups with them: digits one by one first, then
# GPT-2's split on what is between
_STARCODER = _PreTokenizer(_GPT2.split, digits_first=True)
# tokenizer.ggml.pre -> pre-tokenizer (the names llama.cpp's llama-vocab.cpp maps to LLAMA3 (DBRX and SMAUG: its
# regex too), QWEN2, GPT4O, CHATGLM4, GPT2, TEKKEN and STARCODER; DeepSeek-R1-Distill-Qwen's is deepseek-r1-qwen)
_PRE_TOKENIZERS = {**dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"), _QWEN2),
                   **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "lfm2", "falcon3", "pixtral", "midm-2.0",
                                    "dbrx", "smaug-bpe"), _LLAMA3),
                   "qwen35": _QWEN35, "gpt-4o": _GPT4O, "glm4": _GLM4, "exaone4": _GPT2, "tekken": _TEKKEN,
                   **dict.fromkeys(("starcoder", "smollm", "command-r", "refact", "codeshell", "exaone", "minerva-7b",
                                    "mellum2"), _STARCODER)}


def pre_tokenizer_split(pre: str) -> str:
    """The Split regex of the original tokenizer.json of a `tokenizer.ggml.pre` in _PRE_TOKENIZERS (e.g. "gpt-4o")."""
    return _PRE_TOKENIZERS[pre].split


def _byte_level_bpe(path: Path, meta: dict[str, Any], pre: _PreTokenizer) -> Any:
    """A `tokenizers.Tokenizer` with the GGUF's byte-level BPE vocabulary, merges and added tokens, ids unchanged."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Unused slots ([PAD151665] ...) pad the vocabulary to the embedding size; the original tokenizer lacks them.
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind != _UNUSED}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{path}: tokenizer.ggml.merges has entries that are not two tokens; it is corrupt.")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    except Exception as exc:  # tokenizers raises its own exception type for merges of unknown tokens
        raise CheckpointError(f"{path}: the embedded BPE tokenizer is inconsistent ({exc}); it is corrupt.") from None
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *([pre_tokenizers.Digits(individual_digits=True)] if pre.digits_first else []),
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens are matched whole in the raw text; they are in `vocab` already, so they keep their ids.
    added = [(t, kind) for t, kind in zip(tokens, types, strict=True) if kind in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in added if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in added if k == _USER_DEFINED])
    return tok


def _ensure_post_processor(tokenizer_json: Path, bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> None:
    """Make the plain `tokenizers` library add BOS/EOS the way the GGUF asks (add_bos_token / add_eos_token)."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = tok.encode("a").ids
    if (bos is None or (ids and ids[0] == bos[1])) and (eos is None or (ids and ids[-1] == eos[1])):
        return
    single = " ".join([*([f"{bos[0]}:0"] if bos else []), "$A:0", *([f"{eos[0]}:0"] if eos else [])])
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    specials = [s for s in (bos, eos) if s is not None]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
    tok.post_processor = template if tok.post_processor is None else processors.Sequence([tok.post_processor, template])
    tok.save(str(tokenizer_json))


def _prefix_space_after_specials(tokenizer_json: Path, meta: dict[str, Any]) -> None:
    """SentencePiece vocabularies: prefix "▁" to every piece of text, also after a special token.

    That is what llama.cpp does (tokenizer.ggml.add_space_prefix, default true, adds the space at the start and after
    each special token) and what the Llama/Mistral tokenizers these files come from do; transformers builds
    Metaspace(prepend_scheme="first"), which tokenizes "<s>Once" as "O n ce" instead of "▁Once".
    """
    data = json.loads(tokenizer_json.read_text())
    pre = data.get("pre_tokenizer") or {}
    scheme = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    for step in pre.get("pretokenizers") or [pre]:
        if step.get("type") == "Metaspace":
            step["prepend_scheme"] = scheme
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def _drop_tokens_past_vocabulary(tokenizer_json: Path, size: int) -> None:
    """Remove added tokens numbered past the GGUF's own token list: transformers' tokenizer classes add their
    defaults where a vocabulary lacks them (Gemma's <bos> <eos> <pad> <mask>), ids the model has no embedding for."""
    data = json.loads(tokenizer_json.read_text())
    added = data.get("added_tokens") or []
    if any(t["id"] >= size for t in added):
        data["added_tokens"] = [t for t in added if t["id"] < size]
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


# Phi-3's special tokens strip the whitespace after them ("<|user|>\nHi" reads as "<|user|>Hi"), save these three
_PHI3_KEEP_WHITESPACE = ("<unk>", "<s>", "<|endoftext|>")


def _phi3_rstrip(tokenizer_json: Path, meta: dict[str, Any]) -> None:
    """A model named Phi-3: every special added token strips the whitespace that follows it, but for
    _PHI3_KEEP_WHITESPACE, as Phi-3's own tokenizer.json says and llama.cpp gives such a model's tokens (it goes by
    general.name too: a GGUF keeps no per-token flags)."""
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return
    data = json.loads(tokenizer_json.read_text())
    for token in data.get("added_tokens") or []:
        if token.get("special") or token.get("content") == "</s>":
            token["rstrip"] = token.get("content") not in _PHI3_KEEP_WHITESPACE
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def _chat_template(meta: dict[str, Any]) -> str | list[dict[str, str]] | None:
    """tokenizer.chat_template, or HF's list form when the GGUF also has named ones (tokenizer.chat_template.NAME)."""
    default = meta.get("tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): v for k, v in meta.items()
             if k.startswith("tokenizer.chat_template.")}  # fmt: skip
    if not named:
        return default
    templates = [{"name": "default", "template": default}] if default else []
    return templates + [{"name": n, "template": t} for n, t in named.items()]


def _save_with_transformers(path: Path, out_dir: Path, meta: dict[str, Any]) -> None:
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except ValueError as exc:  # NOTE: AutoTokenizer reads the model config too, and refuses architectures
            if "architecture" not in str(exc):  # transformers does not run (smollm3); the tokenizer needs none
                raise
            tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          local_files_only=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    except Exception as exc:  # transformers raises many types for unsupported tokenizer models
        raise CheckpointError(
            f"Could not convert the tokenizer embedded in {path} ({type(exc).__name__}: {exc}). "
            f"Its tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; pass an HF tokenizer directory instead."
        ) from None
    if not (out_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"transformers did not produce tokenizer.json for {path}; pass an HF tokenizer instead.")


def export_gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for the GGUF's embedded tokenizer."""
    path, out_dir = Path(path), Path(out_dir)
    meta = _fields(_open(path))
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path} has no embedded tokenizer (tokenizer.ggml.tokens); pass a tokenizer directory.")
    pre = _PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre")) if meta.get("tokenizer.ggml.model") == "gpt2" else None
    if pre is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _byte_level_bpe(path, meta, pre).save(str(out_dir / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    else:
        _save_with_transformers(path, out_dir, meta)
        _drop_tokens_past_vocabulary(out_dir / "tokenizer.json", len(tokens))
        if meta.get("tokenizer.ggml.model") == "llama":
            _prefix_space_after_specials(out_dir / "tokenizer.json", meta)
        cfg_path = out_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def special(kind: str) -> tuple[str, int] | None:
        idx = meta.get(f"tokenizer.ggml.{kind}_token_id")
        return (tokens[idx], int(idx)) if idx is not None and 0 <= idx < len(tokens) else None

    kinds = (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
    names = {f"{k}_token": special(g) for k, g in kinds}
    add_bos = meta.get("tokenizer.ggml.add_bos_token", pre.add_bos if pre else False)
    eos = special("eos") if meta.get("tokenizer.ggml.add_eos_token", False) else None
    _ensure_post_processor(out_dir / "tokenizer.json", special("bos") if add_bos else None, eos)
    _phi3_rstrip(out_dir / "tokenizer.json", meta)

    for key in ("is_local", "local_files_only"):  # artefacts of how transformers loaded it, not of the tokenizer
        cfg.pop(key, None)
    for key, value in names.items():
        if value is not None:
            cfg.setdefault(key, value[0])
    if (template := _chat_template(meta)) is not None:
        cfg["chat_template"] = template  # in tokenizer_config.json, which every transformers version reads
        (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    smap = out_dir / "special_tokens_map.json"
    if not smap.is_file():
        smap.write_text(json.dumps({k: v[0] for k, v in names.items() if v is not None}, indent=2) + "\n")
