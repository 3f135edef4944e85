"""/v1/completions' batches of prompts and `echo` (serving/openai/completions.py), on a real server over
stories260K: the prompt's logprobs are the in-process engine's prompt_logprobs (themselves checked against Hugging
Face in test_prompt_logprobs.py), as lm-evaluation-harness asks for them."""

from __future__ import annotations

import time

import pytest
from test_openai import Server

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

CONTEXTS = ["Once upon a time, there was a", "The little dog ran to the"]


@pytest.fixture(scope="module")
def server(stories_engine):
    s = Server(stories_engine)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def local(stories_engine) -> LLM:
    return LLM(stories_engine, RuntimeConfig(num_threads=1))


def test_the_loglikelihood_request_of_lm_evaluation_harness(server, local):
    """lm-eval's `local-completions` model scores a continuation: token-id prompts in a batch, echo, logprobs=1,
    max_tokens=1, and sums token_logprobs[ctxlen:-1]; a continuation is greedy when each token's logprob is the
    largest of its top_logprobs."""
    ids = [local.core.tokenizer.encode(text + " little girl") for text in CONTEXTS]
    code, body = server.post("/v1/completions", {"model": "stories", "prompt": ids, "temperature": 0,
                                                 "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert code == 200, body
    want = local.generate(ids, SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice, prompt, done in zip(body["choices"], ids, want, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [None] + [p.logprob for p in done.prompt_logprobs[1:]] + [done.logprobs[0].logprob]
        assert lp["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-5)
        for token, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert len(top) == 1 and max(top.values()) >= token
        assert choice["text"].startswith(local.core.tokenizer.decode(prompt))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 2,
                             "total_tokens": sum(map(len, ids)) + 2,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # echo scores every prompt token


def test_echo_with_max_tokens_0_returns_the_prompt_alone_scored(server, local):
    c = server.client()
    r = c.completions.create(model="stories", prompt=CONTEXTS[0], max_tokens=0, echo=True, logprobs=2)
    (choice,) = r.choices
    ids = local.core.tokenizer.encode(CONTEXTS[0])
    (done,) = local.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert choice.text == CONTEXTS[0] and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([p.logprob for p in done.prompt_logprobs[1:]],
                                                               abs=1e-5)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)


def test_batched_text_prompts_with_n_and_echo_streamed_or_not(server, local):
    c = server.client()
    ask = dict(model="stories", prompt=CONTEXTS, max_tokens=8, temperature=0, n=2, echo=True)
    r = c.completions.create(**ask)
    greedy = [d.text for d in local.generate(CONTEXTS, SamplingParams(max_tokens=8))]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]  # prompt i's j-th sample is choice i * n + j
    assert [ch.text for ch in r.choices] == [CONTEXTS[i] + greedy[i] for i in (0, 0, 1, 1)]
    streamed = {}
    for chunk in c.completions.create(stream=True, **ask):
        for ch in chunk.choices:
            streamed.setdefault(ch.index, []).append(ch.text)
    assert [streamed[i][0].startswith(CONTEXTS[i // 2]) for i in range(4)] == [True] * 4
    assert ["".join(streamed[i]) for i in range(4)] == [ch.text for ch in r.choices]


def test_streamed_echo_logprobs_equal_the_whole_answers(server):
    c = server.client()
    ask = dict(model="stories", prompt=CONTEXTS[1], max_tokens=6, temperature=0, echo=True, logprobs=0)
    whole = c.completions.create(**ask).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in c.completions.create(stream=True, **ask):
        lp = chunk.choices[0].logprobs
        tokens += lp.tokens
        values += lp.token_logprobs
        offsets += lp.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values[0] is None and values[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-6)


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens 0 generates nothing"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5, 6], []]}, "prompt 1 of the batch is empty"),
    ({"prompt": [[1, 5], [1, 99999]]}, "outside the vocabulary"),
    ({"prompt": ["a", "b"], "max_tokens": 999}, "max_seq_len"),
])
def test_bad_batches_get_a_400_and_leave_nothing_running(server, body, message):
    code, doc = server.post("/v1/completions", body)
    assert code == 400 and message in doc["error"]["message"], doc
    deadline = time.monotonic() + 5  # a batch's prompts submitted before the bad one are cancelled
    while (busy := server.metrics()["vllm:num_requests_running"] + server.metrics()["vllm:num_requests_waiting"]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert busy == 0


def test_use_beam_search_returns_n_beams_as_choices(server, local):
    """vLLM's use_beam_search: n is the beam width; each prompt's beams are its choices, best first."""
    c = server.client()
    r = c.completions.create(model="stories", prompt=CONTEXTS, max_tokens=10, n=3,
                             extra_body={"use_beam_search": True, "length_penalty": 0.5})
    want = local.generate(CONTEXTS, SamplingParams(beam_width=3, max_tokens=10, length_penalty=0.5))
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [b.text for done in want for b in done.beams]
    assert [ch.finish_reason for ch in r.choices] == [b.finish_reason.value for done in want for b in done.beams]
    assert r.usage.completion_tokens == sum(len(b.token_ids) for done in want for b in done.beams)
    for body, message in [({"use_beam_search": True, "stream": True}, "use_beam_search answers once"),
                          ({"length_penalty": 2.0}, "length_penalty ranks beams"),
                          ({"use_beam_search": True, "temperature": 0.5}, "temperature cannot be set with beam_width"),
                          ({"use_beam_search": True, "n": 64}, "beam_width must be")]:
        code, doc = server.post("/v1/completions", {"prompt": "x", "n": 2, **body})
        assert code == 400 and message in doc["error"]["message"], doc
