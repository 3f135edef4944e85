"""Reasoning models on the OpenAI API: the thinking between <think> and </think> split off the answer (whole and
streamed in any pieces), whether an answer starts inside it, chat_template_kwargs, and a real server answering with
reasoning_content (stories260K with a template of our own that opens the thinking unless told not to)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_openai import Server, greedy, with_template
from test_tool_calls import WEATHER, _request

from trtbuild.runtime.chat import ChatTemplate
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.serving.openai.answer import ChatAnswer
from trtbuild.serving.openai.reasoning import ReasoningSplitter, opens_thinking, teaches_reasoning
from trtbuild.serving.openai.tool_calls import FORMATS
from trtbuild.serving.openai.tool_use import NO_TOOLS, tool_use

THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}")

# (starts inside, answer, thinking, content)
ANSWERS = [
    (False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    (True, "hmm, 2+2</think>\n\n4", "hmm, 2+2", "4"),
    (False, "Plain answer", "", "Plain answer"),
    (False, "  <thi", "", "  <thi"),
    (True, "never closes </thin", "never closes </thin", ""),
    (False, "\n<think></think>\n\nx", "", "x"),
]


@pytest.mark.parametrize(("inside", "answer", "thinking", "content"), ANSWERS)
def test_thinking_splits_off_whole_or_in_any_pieces(inside, answer, thinking, content):
    assert ReasoningSplitter(inside).feed(answer, final=True) == (thinking, content)
    for size in (1, 2, 3, 5):
        splitter, got = ReasoningSplitter(inside), ("", "")
        for at in range(0, len(answer), size):
            t, c = splitter.feed(answer[at:at + size], final=at + size >= len(answer))
            got = (got[0] + t, got[1] + c)
        assert got == (thinking, content), size


def test_the_prompt_says_whether_the_answer_starts_inside_the_thinking():
    assert teaches_reasoning(THINK_TEMPLATE) and not teaches_reasoning("{{ messages }}")
    assert opens_thinking("user: x\nassistant:<think>\n") and not opens_thinking("assistant:<think></think>")
    assert not opens_thinking("<think>a</think> user: x assistant:")


def test_the_answer_s_calls_come_after_its_thinking():
    tools = tool_use(_request(tools=[WEATHER]), True, FORMATS["hermes"], frozenset())
    message = ChatAnswer(tools, reasoning_inside=False).message(
        '<think>Weather, so a call.</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
        '</tool_call>')
    assert message["reasoning_content"] == "Weather, so a call." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    answer = ChatAnswer(NO_TOOLS, reasoning_inside=True)
    assert [answer.delta(p, final=i == 2) for i, p in enumerate(["a</th", "ink>", "b"])] == [
        {"reasoning_content": "a"}, {"content": ""}, {"content": "b"}]


def test_template_variables_may_not_replace_the_request_s_own():
    template = ChatTemplate(THINK_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages, variables={"enable_thinking": False}).endswith("<think></think>")
    with pytest.raises(ValueError, match=r"variables \['bos_token', 'messages'\] are set from the request"):
        template.render(messages, variables={"messages": [], "bos_token": "x"})


@pytest.fixture(scope="module")
def think_engine(stories_engine, tmp_path_factory) -> Path:
    return with_template(stories_engine, tmp_path_factory.mktemp("think") / "engine", THINK_TEMPLATE)


def test_a_server_answers_the_thinking_as_reasoning_content(think_engine):
    local = LLM(think_engine, RuntimeConfig(num_threads=1))
    template = ChatTemplate.from_engine_dir(think_engine)
    messages = [{"role": "user", "content": "Lily went to the park"}]
    server = Server(think_engine)
    try:
        client = server.client()
        ask = dict(model="stories", messages=messages, max_tokens=24, temperature=0)
        thinking = greedy(local, template.encode(local.core.tokenizer, messages), 24, template.end_of_turn_token_ids)
        r = client.chat.completions.create(**ask)
        assert r.choices[0].message.reasoning_content == thinking and not r.choices[0].message.content
        chunks = [c for c in client.chat.completions.create(stream=True, **ask) if c.choices]
        assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == thinking
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        off = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **ask)
        prompt = template.render(messages, variables={"enable_thinking": False})
        answer = greedy(local, local.core.tokenizer.encode(prompt, add_special_tokens=False), 24,
                        template.end_of_turn_token_ids)
        assert off.choices[0].message.content == answer and not getattr(off.choices[0].message,
                                                                        "reasoning_content", None)
        status, body = server.post("/v1/chat/completions", {"messages": messages,
                                                             "chat_template_kwargs": {"tools": []}})
        assert status == 400 and "set from the request" in body["error"]["message"]
    finally:
        server.stop()
    plain = Server(think_engine, "--reasoning-parser", "none")
    try:
        r = plain.client().chat.completions.create(model="stories", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == thinking
    finally:
        plain.stop()
