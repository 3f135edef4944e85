"""Fill-in-the-middle: the prompt runtime/fim.py assembles (llama.cpp's layout, each family's token spellings),
/v1/completions' `suffix` and llama.cpp's /infill on a real server, whose middles are what the in-process engine
generates from the same prompt; llama-server's code-completion stops (n_indent, t_max_predict_ms) and
response_fields."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from helpers import make_random_hf_model
from test_openai import TIMEOUT, Server

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.fim import ExtraFile, FimTokens, infill_prompt, leading_special_tokens
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.openai.infill import MiddleCut, selected

QWEN_FIM = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
            "<|file_sep|>"]
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "import os\n"}]
EXTRA_FILE = ExtraFile("util.py", "import os\n")


class Vocabulary:
    """A tokenizer double: one id per character, `specials` first; `bos` is added with special tokens."""

    def __init__(self, specials: list[str], bos: int | None = None) -> None:
        self.specials, self.bos = {s: i for i, s in enumerate(specials)}, bos

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1000 + ord(c) for c in text]
        return ([self.bos] if add_special_tokens and self.bos is not None else []) + ids


def chars(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]


@pytest.mark.parametrize(("specials", "expected"), [
    (QWEN_FIM, (1, 3, 2, 4, 5, 6)),  # Qwen2.5-Coder
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>"], (0, 2, 1, 3, 4, None)),  # StarCoder
    (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], (0, 1, 2, None, None, None)),  # DeepSeek-Coder
    (["▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"], (0, 2, 1, None, None, None)),  # CodeLlama
    (["<|fim_prefix|>", "<|fim_suffix|>"], None),  # no middle token: no FIM
])
def test_each_familys_tokens_are_found_by_spelling(specials, expected):
    fim = FimTokens.of(Vocabulary(specials))
    assert (fim and (fim.prefix, fim.suffix, fim.middle, fim.pad, fim.repo, fim.file_sep)) == expected


def test_the_prompt_is_llama_cpps_repository_level_layout():
    tok = Vocabulary(QWEN_FIM)
    fim = FimTokens.of(tok)
    got = infill_prompt(tok, fim, "def f", "\nx", [], prompt="(")
    assert got == [5, *chars("myproject\n"), 6, *chars("filename\n"), 1, *chars("def f("), 3, *chars("\nx"), 2]
    with_files = infill_prompt(tok, fim, [7, 8], "", [EXTRA_FILE])
    assert with_files == [5, *chars("myproject\n"), 6, *chars("util.py\n"), *chars("import os\n"), 6,
                          *chars("filename\n"), 1, 7, 8, 3, 2]
    # without repository tokens: each file after a snippet line; BOS first where the tokenizer adds one
    plain = Vocabulary(["<s>", "▁<PRE>", "▁<MID>", "▁<SUF>"], bos=0)
    got = infill_prompt(plain, FimTokens.of(plain), "a", "b", [EXTRA_FILE])
    assert leading_special_tokens(plain) == [0]
    assert got == [0, *chars("\n\n--- snippet ---\n\n"), *chars("import os\n"), 1, *chars("a"), 3, *chars("b"), 2]


def test_n_indent_cuts_the_first_line_indented_less():
    cut = MiddleCut(n_indent=4, t_max_predict_ms=-1)
    assert cut.add(" a + b\n", 0.0) == " a + b\n" and not cut.cut
    assert cut.add("    c\n", 0.1) == "    c\n" and not cut.cut  # as indented: kept
    assert cut.add("\n", 0.2) == "\n" and not cut.cut  # an empty line decides nothing
    assert cut.add("  ", 0.3) == "  " and not cut.cut  # nor does indentation before the line's text
    assert cut.add("print(x)\n", 0.4) == "" and cut.cut  # text at indent 2: that line is cut
    assert cut.text == " a + b\n    c\n\n  "


def test_t_max_predict_ms_stops_once_a_line_has_ended_after_the_time():
    cut = MiddleCut(n_indent=0, t_max_predict_ms=100)
    cut.add("x = 1", 10.0)
    cut.add(" + 2", 10.5)
    assert not cut.cut  # past the time, but no line has ended
    cut.add("\n", 10.6)
    assert cut.cut and cut.text == "x = 1 + 2\n"


def test_response_fields_select_and_lift():
    body = {"content": "x", "timings": {"prompt_n": 3}, "stop": True}
    assert selected(body, ["content", "timings/prompt_n", "nothing", "timings/nothing"]) == {
        "content": "x", "timings/prompt_n": 3}
    assert selected(body, None) is body


# ---- on a server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_engine(tmp_path_factory, engine_from_hf) -> Path:
    """A random Qwen2 (vocabulary 320) with a byte-level BPE tokenizer that has Qwen2.5-Coder's FIM tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = make_random_hf_model("qwen2", tmp_path_factory.mktemp("fim_qwen2"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=QWEN_FIM,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PREFIX + SUFFIX, "import os\n", "def f(x):\n    return x\n"] * 20, trainer)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return engine_from_hf(hf, max_batch_size=4, max_num_tokens=256)


@pytest.fixture(scope="module")
def server(fim_engine):
    s = Server(fim_engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(fim_engine) -> LLM:
    return LLM(fim_engine, RuntimeConfig(num_threads=1))


def middle(local: LLM, prefix, suffix: str, extra=(), max_tokens: int = 8, **sampling) -> tuple[list[int], str]:
    fim = FimTokens.of(local.core.tokenizer)
    ids = infill_prompt(local.core.tokenizer, fim, prefix, suffix, extra)
    (done,) = local.generate([ids], SamplingParams(max_tokens=max_tokens, stop_token_ids=fim.stop_ids, **sampling))
    return ids, done.text


def test_infill_answers_as_llama_server_with_the_engines_middle(server, local):
    ids, text = middle(local, PREFIX, SUFFIX, [EXTRA_FILE])
    code, body = server.post("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
                                         "n_predict": 8, "temperature": 0, "cache_prompt": True,
                                         "samplers": ["top_k", "top_p", "infill"], "t_max_prompt_ms": 500})
    assert code == 200, body
    assert body["content"] == text and body["stop"] is True
    assert body["tokens_evaluated"] == len(ids) and body["tokens_predicted"] == 8 and body["stop_type"] == "limit"
    assert body["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>util.py\nimport os\n<|file_sep|>filename\n"
                              f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    assert body["timings"]["predicted_n"] == 8 and body["timings"]["prompt_ms"] > 0
    assert body["generation_settings"]["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]


def test_infill_streams_the_same_middle_and_selects_fields(server):
    ask = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0}
    _, whole = server.post("/infill", ask)
    request = urllib.request.Request(server.base + "/infill", json.dumps({
        **ask, "stream": True, "response_fields": ["content", "stop", "timings/predicted_n"]}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert all(e["stop"] is False for e in events[:-1])
    assert events[-1] == {"content": "", "stop": True, "timings/predicted_n": 8}


def test_completions_suffix_fills_the_middle(server, local):
    c = server.client()
    _, text = middle(local, PREFIX, SUFFIX, max_tokens=6)
    r = c.completions.create(model="stories", prompt=PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0)
    assert r.choices[0].text == text
    assert r.usage.prompt_tokens == len(infill_prompt(local.core.tokenizer, FimTokens.of(local.core.tokenizer),
                                                      PREFIX, SUFFIX))
    # a FIM end token (here <|file_sep|>, forced) ends the middle as EOS does
    file_sep = local.core.tokenizer.token_to_id("<|file_sep|>")
    r = c.completions.create(model="stories", prompt=PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0,
                             logit_bias={str(file_sep): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/v1/completions", {"prompt": "x", "suffix": "y", "echo": True}, 400, "echo and suffix"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y", "mirostat": 2}, 400, "mirostat"),
    ("/infill", {"input_prefix": "x", "input_suffix": "y", "samplers": ["top_k", "xyz"]}, 400, "xyz"),
    ("/infill", {"input_suffix": "y"}, 400, "input_prefix"),
    ("/infill", {"input_prefix": "x" * 400, "input_suffix": "y", "n_predict": 8}, 400, "max_seq_len"),
])
def test_bad_requests_say_what_is_wrong(server, path, body, status, says):
    code, answer = server.post(path, body)
    assert code == status and says in json.dumps(answer), answer


def test_a_model_without_fim_tokens_says_so(stories_engine):
    s = Server(stories_engine)
    try:
        for path, body in (("/v1/completions", {"prompt": "x", "suffix": "y"}),
                           ("/infill", {"input_prefix": "x", "input_suffix": "y"})):
            code, answer = s.post(path, body)
            assert code == 400 and "no fill-in-the-middle tokens" in answer["error"]["message"], answer
    finally:
        s.stop()
