"""vLLM's /tokenize, /detokenize and /tokenizer_info beside the OpenAI API (serving/openai/tokenize.py), on a real
server over stories260K with a chat template: ids equal the engine's tokenizer and template in process."""

from __future__ import annotations

import json
import urllib.request

import pytest
from test_openai import TEMPLATE, TIMEOUT, Server, with_template

from trtbuild.runtime.chat import ChatTemplate
from trtbuild.runtime.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Lily went to the park"}]


@pytest.fixture(scope="module")
def engine(stories_engine, tmp_path_factory):
    return with_template(stories_engine, tmp_path_factory.mktemp("tokenize") / "engine", TEMPLATE)


@pytest.fixture(scope="module")
def server(engine):
    s = Server(engine, "--api-key", "secret")
    yield s
    s.stop()


def test_tokenize_a_prompt_or_a_conversation_as_the_engine_would(server, engine):
    tokenizer = Tokenizer(engine)
    code, body = server.post("/tokenize", {"prompt": "Once upon a time", "return_token_strs": True})
    ids = tokenizer.encode("Once upon a time")
    assert code == 200 and body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                                    "token_strs": [tokenizer.decode([t], skip_special_tokens=False) for t in ids]}
    assert ids[0] == 1  # BOS, as a completion's prompt gets it
    _, bare = server.post("/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False, "model": "stories"})
    assert bare["tokens"] == ids[1:] and "token_strs" not in bare
    template = ChatTemplate.from_engine_dir(engine)
    _, chat = server.post("/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == template.encode(tokenizer, MESSAGES)  # what /v1/chat/completions would run
    _, history = server.post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert history["tokens"] == template.encode(tokenizer, MESSAGES, add_generation_prompt=False) != chat["tokens"]


def test_detokenize_and_tokenizer_info(server, engine):
    ids = Tokenizer(engine).encode("Lily and Tom")
    assert server.post("/detokenize", {"tokens": ids}) == (200, {"prompt": "<s> Lily and Tom"})
    with urllib.request.urlopen(server.base + "/tokenizer_info", timeout=TIMEOUT) as r:  # no API key needed
        info = json.loads(r.read())
    assert (info["bos_token"], info["eos_token"], info["chat_template"], info["model_max_length"]) == (
        "<s>", "</s>", TEMPLATE, 256)


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one of prompt"),
    ("/tokenize", {}, 400, "exactly one of prompt"),
    ("/tokenize", {"messages": []}, 400, "messages is empty"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
    ("/detokenize", {"tokens": [5, 99999]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenizer_requests_get_openai_errors(server, path, body, status, message):
    code, doc = server.post(path, body)
    assert code == status and message in doc["error"]["message"], doc


def test_an_engine_without_a_template_tokenizes_prompts_but_refuses_messages(stories_engine):
    s = Server(stories_engine)
    try:
        assert s.post("/tokenize", {"prompt": "x"})[0] == 200
        code, doc = s.post("/tokenize", {"messages": MESSAGES})
        assert code == 400 and "no chat template" in doc["error"]["message"]
    finally:
        s.stop()
