"""The OpenAI-compatible server (`trtbuild serve --http-port`) driven by the official `openai` client and plain
HTTP, against a real server process on loopback, over stories260K with a chat template; outputs are checked against
in-process generation."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai  # a dev dependency (pip install -e '.[dev]'), as the README installs
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trtbuild.runtime.chat import ChatTemplate
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TIMEOUT = 60


def with_template(engine: Path, copy: Path, template: str) -> Path:
    """A copy of the stories260K `engine` at `copy` with the chat `template`, whose turns end with </s> (its
    vocabulary has no <|im_end|>)."""
    shutil.copytree(engine, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    config.update(chat_template=template, bos_token="<s>", eos_token="</s>")
    config_file.write_text(json.dumps(config))
    return copy


@pytest.fixture(scope="module")
def chat_engine(stories_engine, tmp_path_factory) -> Path:
    return with_template(stories_engine, tmp_path_factory.mktemp("openai") / "engine", TEMPLATE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine: Path, *args: str) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(engine),
                                      "--port", "0", "--http-port", str(self.port), "--threads", "1",
                                      "--served-model-name", "stories", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            lines.append(line)
            if "OpenAI API on" in line:
                break
            if not line and self.proc.poll() is not None:
                raise AssertionError("".join(lines))
        else:
            raise AssertionError("".join(lines))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep draining its output
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "unused"):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def scrape(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=TIMEOUT) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        return {s.name: s.value for f in text_string_to_metric_families(self.scrape()) for s in f.samples}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(TIMEOUT)


@pytest.fixture(scope="module")
def server(chat_engine):
    s = Server(chat_engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(chat_engine) -> LLM:
    return LLM(chat_engine, RuntimeConfig(num_threads=1))


def greedy(local: LLM, prompt: str | list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> str:
    return local.generate([prompt], SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_ids))[0].text


def test_completions_match_in_process_generation_streamed_or_not(server, local):
    c = server.client()
    r = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=24, temperature=0)
    assert r.choices[0].text == greedy(local, "Once upon a time", 24)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.completions.create(model="stories", prompt="Once upon a time", max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_a_conversations_next_turn_reports_the_prompt_tokens_read_from_the_cache(server, chat_engine):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's prompt caching field): the next turn's prompt repeats the
    first one, whose full blocks it reads from the prefix cache, streamed or not."""
    from trtbuild.builder.engine_dir import read_engine_config

    block = read_engine_config(chat_engine).build.tokens_per_block
    c = server.client()
    messages = [{"role": "user", "content": "Ben and Sue found a red kite by the old tree near the lake. " * 3}]
    first = c.chat.completions.create(model="stories", messages=messages, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and first.usage.prompt_tokens > 2 * block
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What did they do next?"}]
    second = c.chat.completions.create(model="stories", messages=messages, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % block == 0 and first.usage.prompt_tokens // block * block <= cached < second.usage.prompt_tokens
    chunks = list(c.chat.completions.create(model="stories", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_chat_renders_the_template_and_stops_at_the_end_of_turn(server, local, chat_engine):
    c = server.client()
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Lily went to the park"}]
    r = c.chat.completions.create(model="stories", messages=messages, max_tokens=40, temperature=0)
    template = ChatTemplate.from_engine_dir(chat_engine)
    prompt = template.encode(local.core.tokenizer, messages)
    assert r.choices[0].message.content == greedy(local, prompt, 40, template.end_of_turn_token_ids)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(prompt)
    streamed = c.chat.completions.create(model="stories", messages=messages, max_tokens=40, temperature=0,
                                         stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_seed_n_stop_and_logprobs(server):
    c = server.client()
    ask = dict(model="stories", prompt="Once upon a time", max_tokens=16, temperature=1.0)
    a, b = (c.completions.create(seed=7, **ask).choices[0].text for _ in range(2))
    assert a == b  # a seeded request samples the same tokens every time
    two = c.completions.create(seed=7, n=2, **ask)
    assert [ch.index for ch in two.choices] == [0, 1] and two.choices[0].text == a != two.choices[1].text
    stopped = c.completions.create(model="stories", prompt="Once upon a time", max_tokens=64, temperature=0,
                                   stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    chat = c.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Tom"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)  # greedy: the chosen one is the top one
    forced = c.completions.create(model="stories", prompt=[1, 300], max_tokens=3, temperature=0,
                                  logit_bias={"42": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [server_token(c, 42)] * 3


def test_chat_with_beam_search_answers_every_beam(server, local, chat_engine):
    messages = [{"role": "user", "content": "Lily went to the park"}]
    r = server.client().chat.completions.create(model="stories", messages=messages, max_tokens=12, n=2,
                                                extra_body={"use_beam_search": True})
    template = ChatTemplate.from_engine_dir(chat_engine)
    prompt = template.encode(local.core.tokenizer, messages)
    (want,) = local.generate([prompt], SamplingParams(beam_width=2, max_tokens=12,
                                                      stop_token_ids=template.end_of_turn_token_ids))
    assert [ch.message.content for ch in r.choices] == [b.text for b in want.beams]


def test_response_format_constrains_the_output_to_json(server):
    c = server.client()
    schema = {"type": "object", "properties": {"happy": {"type": "boolean"}}, "required": ["happy"],
              "additionalProperties": False}
    for stream in (False, True):
        ask = dict(model="stories", messages=[{"role": "user", "content": "Was Lily happy?"}], max_tokens=40,
                   temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                                          "schema": schema}})
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **ask)
                           if ch.choices)
        else:
            text = c.chat.completions.create(**ask).choices[0].message.content
        assert isinstance(json.loads(text)["happy"], bool), text
    free = c.chat.completions.create(model="stories", messages=[{"role": "user", "content": "Lily"}], max_tokens=8,
                                     temperature=0, response_format={"type": "json_object"})
    assert free.choices[0].message.content.lstrip().startswith("{")


def server_token(client, token_id: int) -> str:
    """The text the server gives one token id (as its logprobs name it)."""
    r = client.completions.create(model="stories", prompt=[1], max_tokens=1, temperature=0,
                                  logit_bias={str(token_id): 100}, logprobs=0)
    return r.choices[0].logprobs.tokens[0]


BAD = [  # (path, body, status, message)
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1.0}}, 400, "logit_bias keys must be token ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias must be"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias must be token ids below"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be at least 1"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 999}, 400, "max_seq_len"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "unknown_field": 1}, 400, "unknown_field"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "only text content parts are served, not image_url"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "does not write tools into the prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "lists no tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "grammar"}}, 400, "response_format 'grammar'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     400, "json_schema cannot be compiled"),
]


def test_a_body_that_is_not_json_is_a_400(server):
    request = urllib.request.Request(server.base + "/v1/completions", b"{not json",
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    message = json.loads(e.value.read())["error"]["message"]
    assert e.value.code == 400 and "the request body is not valid JSON" in message


@pytest.mark.parametrize(("path", "body", "status", "message"), BAD)
def test_bad_requests_get_openai_errors(server, path, body, status, message):
    code, doc = server.post(path, body)
    assert code == status, doc
    assert message in doc["error"]["message"] and doc["error"]["code"] == status


def test_models_health_and_metrics(server):
    with urllib.request.urlopen(server.base + "/v1/models", timeout=TIMEOUT) as r:
        models = json.loads(r.read())
    assert models["data"][0]["id"] == "stories" and models["data"][0]["max_model_len"] == 256
    with urllib.request.urlopen(server.base + "/health", timeout=TIMEOUT) as r:
        assert r.status == 200
    server.client().completions.create(model="stories", prompt="Once", max_tokens=4, temperature=0)
    m = server.metrics()
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] >= 4
    assert m["vllm:request_success_total"] >= 1 and m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:num_requests_running"] == 0 and 0 <= m["vllm:kv_cache_usage_perc"] <= 1


def test_32_concurrent_streaming_chats_equal_each_alone(server):
    c = server.client()
    prompts = [f"{n} went to the {p}" for n in ("Lily", "Tom", "Sue", "Ben") for p in ("park", "sea", "shop",
                                                                                     "forest", "zoo", "river",
                                                                                     "school", "farm")]

    def chat(prompt: str, stream: bool) -> str:
        ask = dict(model="stories", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        if not stream:
            return c.chat.completions.create(**ask).choices[0].message.content
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **ask)
                       if ch.choices)

    alone = [chat(p, stream=False) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: chat(p, stream=True), prompts))
    assert together == alone


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(server.base + "/v1/completions", body, {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=TIMEOUT)
    response.readline()  # the first event: the request is running
    assert server.metrics()["vllm:num_requests_running"] == 1
    response.close()
    deadline = time.monotonic() + TIMEOUT
    while (m := server.metrics())["vllm:num_requests_running"] or m["vllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m.get('vllm:request_success_total{finished_reason="abort"}', 1) >= 1


def test_api_key_is_required_when_set(chat_engine):
    s = Server(chat_engine, "--api-key", "sekret")
    try:
        code, doc = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert code == 401 and "API key" in doc["error"]["message"]
        assert s.client("sekret").completions.create(model="stories", prompt="x", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="stories", prompt="x", max_tokens=2)
    finally:
        s.stop()


def test_bench_speaks_the_openai_api(server):
    from trtbuild.bench.run import BenchOptions, run_bench

    options = BenchOptions(address=f"127.0.0.1:{server.port}", backend="openai", num_requests=4, input_len=40,
                           output_len=6, concurrency=2)
    r = run_bench(options)
    assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 24
    assert r["target"].startswith("openai server http://127.0.0.1") and r["ttft_ms_mean"] > 0
    assert 0 <= r["kv_cache_usage_max"] <= 1
    # the same requests again: their prompts' full blocks from the server's cache, as its usage reports them
    assert run_bench(options)["cached_prefix_tokens"] > r["cached_prefix_tokens"]
