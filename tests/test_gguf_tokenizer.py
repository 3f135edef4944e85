"""builder/convert/gguf_tokenizer.py on hand-made GGUF vocabularies: byte-level BPE per pre-tokenizer, added tokens,
unused slots, BOS defaults and chat templates. (Whole models against their HF tokenizers: test_gguf_convert.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from trtbuild.builder.convert.gguf_tokenizer import export_gguf_tokenizer

ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level characters
# "b c" ranks before "a b", so merging gives "a" + "bc" for "abc"; "abc" is nonetheless in the vocabulary.
WORDS = ["bc", "ab", "abc"]
MERGES = ["b c", "a b", "ab c"]
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>"]
T = gguf.TokenType


def _write(path: Path, pre: str, meta: dict | None = None) -> dict[str, int]:
    tokens = [*ALPHABET, *WORDS, *SPECIALS, "<think>", "[PAD263]"]
    types = [T.NORMAL] * (len(ALPHABET) + len(WORDS)) + [T.CONTROL] * len(SPECIALS) + [T.USER_DEFINED, T.UNUSED]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|eot_id|>"))
    for key, value in (meta or {}).items():
        (w.add_bool if isinstance(value, bool) else w.add_string)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t: i for i, t in enumerate(tokens)}


def _export(tmp_path: Path, pre: str, meta: dict | None = None) -> tuple[Tokenizer, dict, dict[str, int]]:
    tmp_path.mkdir(exist_ok=True)
    ids = _write(tmp_path / "t.gguf", pre, meta)
    export_gguf_tokenizer(tmp_path / "t.gguf", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    return Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")), cfg, ids


@pytest.mark.parametrize(
    ("pre", "meta", "bos", "abc"),
    [
        ("qwen2", {}, False, ["a", "bc"]),
        ("llama-bpe", {}, True, ["abc"]),  # Llama 3: ignore_merges, BOS unless the file says otherwise
        ("llama-bpe", {"tokenizer.ggml.add_bos_token": False}, False, ["abc"]),
        ("qwen2", {"tokenizer.ggml.add_bos_token": True}, True, ["a", "bc"]),
        ("gpt-4o", {}, False, ["a", "bc"]),  # gpt-oss's o200k: merges as ranked, no BOS
    ],
    ids=["qwen2", "llama-bpe", "llama-bpe-no-bos", "qwen2-bos", "gpt-4o"],
)
def test_byte_level_pre_tokenizers(tmp_path: Path, pre: str, meta: dict, bos: bool, abc: list[str]) -> None:
    tok, cfg, ids = _export(tmp_path, pre, meta)
    prefix = [ids["<|begin_of_text|>"]] if bos else []
    assert tok.encode("abc").ids == prefix + [ids[t] for t in abc]
    assert tok.encode("abc", add_special_tokens=False).ids == [ids[t] for t in abc]
    # Added tokens stay whole with their GGUF ids; unused slots are not in the vocabulary.
    text = "<|eot_id|>a<think>b"
    assert tok.encode(text, add_special_tokens=False).ids == [ids["<|eot_id|>"], ids["a"], ids["<think>"], ids["b"]]
    assert tok.get_vocab_size() == len(ids) - 1 and tok.token_to_id("[PAD263]") is None
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert specials == {ids[t] for t in SPECIALS}
    assert tok.decode(tok.encode("héllo 世界 🙂 12").ids, skip_special_tokens=True) == "héllo 世界 🙂 12"
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|begin_of_text|>", "<|eot_id|>")
    assert "chat_template" not in cfg


@pytest.mark.parametrize(("qwen_pre", "llama_pre"), [("qwen2", "llama-bpe"), ("deepseek-r1-qwen", "dbrx"),
                                                     ("qwen2", "falcon3"), ("qwen2", "smaug-bpe")])
def test_digits_and_nfc(tmp_path: Path, qwen_pre: str, llama_pre: str) -> None:
    """Qwen2 splits digits one by one and normalizes to NFC; Llama 3 groups up to three digits and does not. The
    other names llama.cpp gives these pre-tokenizers (DeepSeek-R1-Distill-Qwen's, DBRX's, Falcon 3's) read alike."""
    qwen, _, ids = _export(tmp_path / "q", qwen_pre)
    llama, _, _ = _export(tmp_path / "l", llama_pre)
    assert qwen.pre_tokenizer.pre_tokenize_str("12345")[:2] == [("1", (0, 1)), ("2", (1, 2))]
    assert [p for p, _ in llama.pre_tokenizer.pre_tokenize_str("12345")] == ["123", "45"]
    decomposed = "e\u0301"  # e + combining acute: NFC makes it é, two UTF-8 bytes
    assert qwen.encode(decomposed).ids == [ids[c] for c in ("Ã", "©")]
    assert len(llama.encode(decomposed, add_special_tokens=False).ids) == 3


def test_gpt_4o_splits_words_before_capitals_keeping_contractions_and_digits_by_three(tmp_path: Path) -> None:
    tok, _, _ = _export(tmp_path, "gpt-4o")
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("HelloWorld's 12345 fooBAR\n\n  x")]
    assert pieces == ["Hello", "World's", "Ġ", "123", "45", "Ġfoo", "BAR", "ĊĊ", "Ġ", "Ġx"]


@pytest.mark.parametrize("pre", ["starcoder", "smollm", "command-r"])
def test_starcoder_splits_digits_first_as_its_hf_tokenizer(tmp_path: Path, pre: str) -> None:
    """StarCoder 2's and SmolLM2's tokenizer.json split every digit off, then run GPT-2's regex on the rest (llama.cpp's
    STARCODER group: the two regexes one after the other, which no single regex reproduces: "x  1" keeps its two
    spaces together)."""
    tok, _, _ = _export(tmp_path, pre)
    hf = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in ("x  1", "abc123 def", "  x1\n\n  y", "i've 3.14 + 42", "def f(a, b):\n    return a+b"):
        assert tok.pre_tokenizer.pre_tokenize_str(text) == hf.pre_tokenize_str(text), text
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x  1")] == ["x", "ĠĠ", "1"]


def test_chat_templates_go_to_tokenizer_config(tmp_path: Path) -> None:
    meta = {"tokenizer.chat_template": "{{ messages[0]['content'] }}", "tokenizer.chat_template.tool_use": "tools"}
    _, cfg, _ = _export(tmp_path, "qwen2", meta)
    assert cfg["chat_template"] == [
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "tools"},
    ]
    assert not (tmp_path / "out" / "chat_template.jinja").exists()


def test_chat_template_renders_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    _export(tmp_path, "llama-bpe", {"tokenizer.chat_template": template})
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False)
    assert text == "<|begin_of_text|>user: abc<|eot_id|>"
