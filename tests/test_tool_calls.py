"""Tool calling on the OpenAI API: the formats models write calls in (parsed whole and streamed in any pieces), the
chat template rendering tools and earlier calls, a request's tools / tool_choice, and a real server answering with
calls (stories260K, with a template of our own that writes tools)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import STORIES260K, require_shared_models
from test_openai import Server, greedy, with_template

from trtbuild.errors import ConfigError
from trtbuild.runtime.chat import ChatTemplate
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.detokenizer import IncrementalDetokenizer
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.tokenizer import Tokenizer
from trtbuild.serving.openai import protocol as api
from trtbuild.serving.openai.answer import ChatAnswer
from trtbuild.serving.openai.app import _finish
from trtbuild.serving.openai.tool_calls import FORMATS, ToolCallParser, format_of_template
from trtbuild.serving.openai.tool_use import tool_use

# A template in the hermes style (ours): the tools as JSON, each earlier call in <tool_call> tags, tool results.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools (call as <tool_call>...</tool_call>):{{ '\\n' }}{% for t in tools %}"
    "{{ t | tojson }}{{ '\\n' }}{% endfor %}{% endif %}{% for m in messages %}{{ m['role'] }}: {% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": [
        "UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}

# (format, answer, the user's text, the calls' (name, arguments))
ANSWERS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.\n", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",  # stopped before closing
     [("get_weather", '{"city": "Oslo"}')]),
    ("hermes", "I use <tool_call>no json</tool_call> here", "I use <tool_call>no json</tool_call> here", []),
    ("hermes", "a < b, and <tool nothing", "a < b, and <tool nothing", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]', "",
     [("get_weather", '{"city": "Rome"}')]),
    ("mistral", "Plain [TOOL text", "Plain [TOOL text", []),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "",
     [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zone": "CET"}')]),  # the v11 tokenizers' form
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{broken", "[TOOL_CALLS]get_weather[ARGS]{broken", []),
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|/tool_call|>', "",
     [("get_time", '{"zone": "UTC"}')]),
    ("granite", 'Sure. <|tool_call|>{"name": "get_time", "arguments": {"zone": "UTC"}}', "Sure. ",
     [("get_time", '{"zone": "UTC"}')]),
    ("llama3_json", '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice"}}', "",
     [("get_weather", '{"city": "Nice"}')]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Nice"}}; {"name": "get_time", "parameters": '
                    '{"zone": "CET"}}', "", [("get_weather", '{"city": "Nice"}'), ("get_time", '{"zone": "CET"}')]),
    ("llama3_json", '{"weather": "fine"}', '{"weather": "fine"}', []),
    ("llama3_json", "The weather {is} fine", "The weather {is} fine", []),
]


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("name", "answer", "content", "calls"), ANSWERS)
def test_answers_split_into_text_and_calls_whole_or_in_any_pieces(name, answer, content, calls):
    whole = ToolCallParser(FORMATS[name]).feed(answer, final=True)
    assert (whole[0], _calls(whole[1])) == (content, calls)
    for size in (1, 2, 3, 5, 8):
        parser, text, found = ToolCallParser(FORMATS[name]), "", []
        for at in range(0, len(answer), size):
            delta, new = parser.feed(answer[at:at + size], final=at + size >= len(answer))
            text, found = text + delta, found + new
        assert (text, _calls(found)) == (content, calls), size


def test_text_that_may_open_a_call_is_held_back_until_it_is_clear():
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed("It is <tool") == ("It is ", [])
    assert parser.feed("_call>{") == ("", [])
    assert parser.feed('"name": "get_time", "arguments": {}}</tool_call>')[1][0].name == "get_time"  # at once
    llama = ToolCallParser(FORMATS["llama3_json"])
    assert llama.feed("  ") == ("", []) and llama.feed("Hi") == ("  Hi", []) and llama.feed(" {") == (" {", [])


def test_the_format_is_found_from_the_template():
    assert format_of_template(TOOLS_TEMPLATE).name == "hermes"
    assert format_of_template("{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert format_of_template("{{ tools }} <|tool_call|>").name == "granite"
    assert format_of_template('{{ tools }} "parameters": ...').name == "llama3_json"
    assert format_of_template("{{ messages }}") is None


def test_call_ids_are_what_the_model_s_templates_take_back():
    assert re.fullmatch(r"call_[0-9a-f]{24}", ToolCallParser(FORMATS["hermes"]).feed(ANSWERS[0][1], True)[1][0].id)
    [call] = ToolCallParser(FORMATS["mistral"]).feed(ANSWERS[4][1], True)[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)


def test_a_template_that_names_tools_but_does_not_write_them_is_found_out():
    # as Phi-4-mini's: the tools are read from the system message, where OpenAI clients never put them
    system_tools = ChatTemplate("{% for m in messages %}{% if m.role == 'system' and 'tools' in m %}{{ m.tools }}"
                                "{% endif %}{{ m.content }}{% endfor %}")
    assert not system_tools.renders_tools and ChatTemplate(TOOLS_TEMPLATE).renders_tools


def test_templates_render_tools_earlier_calls_and_their_results():
    template = ChatTemplate(TOOLS_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    assert template.renders_tools
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}
    messages = [api.ChatMessage(role="user", content="Weather?"),
                api.ChatMessage(role="assistant", content=None, tool_calls=[call]),
                api.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    text = template.render([m.for_template(i) for i, m in enumerate(messages)], tools=[WEATHER])
    assert text == (f"<s>tools (call as <tool_call>...</tool_call>):\n{json.dumps(WEATHER)}\nuser: Weather?\n"
                    "assistant: <tool_call>"
                    '{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call>\n</s>tool: sunny\nassistant:')
    assert template.render([messages[0].for_template(0)]) == "<s>user: Weather?\nassistant:"


def test_messages_as_templates_read_them():
    parts = api.ChatMessage(role="developer", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert parts.for_template(0) == {"role": "system", "content": "a\nb"}
    for bad, error in ((api.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}]), "image_url"),
                       (api.ChatMessage(role="assistant"), "content is required"),
                       (api.ChatMessage(role="tool", content="x"), "tool_call_id"),
                       (api.ChatMessage(role="user", content="x", tool_calls=[{"function": {
                           "name": "f", "arguments": "{}"}}]), "only assistant messages")):
        with pytest.raises(ValueError, match=error):
            bad.for_template(3)


def _request(**fields) -> api.ChatCompletionRequest:
    return api.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


def test_tool_use_of_each_tool_choice_and_what_is_refused():
    hermes = FORMATS["hermes"]
    auto = tool_use(_request(tools=[WEATHER]), True, hermes, frozenset())
    assert auto.format is hermes and not auto.forced and auto.tools == [WEATHER] and auto.json_schema is None
    assert not tool_use(_request(tools=[WEATHER], tool_choice="none"), True, hermes, frozenset()).active
    named = tool_use(_request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
        "name": "get_time"}}), True, None, frozenset())
    assert json.loads(named.json_schema) == TIME["function"]["parameters"]
    required = tool_use(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), True,
                        None, frozenset())
    schema = json.loads(required.json_schema)
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    assert tool_use(_request(tools=[WEATHER]), True, FORMATS["mistral"], frozenset({"[TOOL_CALLS]"})) \
        .keep_special_tokens
    refused = [(_request(tool_choice="required"), True, hermes, "tool_choice"),
               (_request(tools=[WEATHER], tool_choice={"function": {"name": "nope"}}), True, hermes, "tool_choice"),
               (_request(tools=[WEATHER]), False, hermes, "tools"),
               (_request(tools=[WEATHER]), True, None, "tool_choice"),
               (_request(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), True,
                hermes, "response_format")]
    for request, renders, fmt, field in refused:
        with pytest.raises(ConfigError) as e:
            tool_use(request, renders, fmt, frozenset())
        assert e.value.field == field


def test_stream_deltas_carry_text_then_indexed_calls_and_finish_with_tool_calls():
    use = tool_use(_request(tools=[WEATHER, TIME], parallel_tool_calls=False), True, FORMATS["hermes"], frozenset())
    answer = ChatAnswer(use, reasoning_inside=None)
    pieces = ["Ok. <tool_", 'call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call><tool_call>',
              '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>']
    deltas = [answer.delta(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert deltas[0] == {"content": "Ok. "}
    calls = deltas[1]["tool_calls"]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_time", {"zone": "UTC"})]
    assert deltas[2] == {} and answer.called  # parallel_tool_calls false: the second call is dropped
    assert _finish("stop", answer.called) == "tool_calls" and _finish("length", answer.called) == "length"
    message = ChatAnswer(use, None).message('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_time"


def test_special_tokens_stay_in_the_text_when_asked(stories_engine):
    tokenizer = Tokenizer(stories_engine)
    eos = tokenizer.token_to_id("</s>")
    ids = [1, 5, *tokenizer.encode("Once upon a time", add_special_tokens=False), eos]
    for skip, expected in ((True, "Once upon a time"), (False, "Once upon a time</s>")):
        detok = IncrementalDetokenizer(tokenizer, ids[:2], SamplingParams(skip_special_tokens=skip))
        text = "".join(detok.add(t) for t in ids[2:]) + detok.flush()
        assert text.lstrip() == expected  # NOTE: "<s>" kept in the prompt keeps the first piece's space
        assert text == tokenizer.decode(ids, skip)[len(tokenizer.decode(ids[:2], skip)):]


# ---- a server answering with calls ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tools_engine(engine_from_hf, tmp_path_factory) -> Path:
    """stories260K with TOOLS_TEMPLATE, 512 tokens long (its vocabulary spells JSON a few characters a token)."""
    require_shared_models()
    return with_template(engine_from_hf(STORIES260K, max_batch_size=8, max_num_tokens=128, max_seq_len=512),
                         tmp_path_factory.mktemp("tools") / "engine", TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tools_server(tools_engine):
    s = Server(tools_engine)
    yield s
    s.stop()


def _stream_calls(chunks) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(text, [(name, arguments)], finish_reason) of a streamed chat, calls assembled by index as clients do."""
    text, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
        finish = choice.finish_reason or finish
    return text, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], finish


def test_a_named_or_required_tool_choice_answers_with_calls(tools_server):
    c = tools_server.client()
    ask = dict(model="stories", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER, TIME], max_tokens=90, temperature=0)
    named = dict(ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = c.chat.completions.create(**named)
    message = r.choices[0].message
    assert message.content is None and r.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 12
    assert _stream_calls(c.chat.completions.create(stream=True, **named)) == ("", [("get_weather", arguments)],
                                                                              "tool_calls")
    required = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **ask)
    assert required.choices[0].finish_reason == "tool_calls"
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments),
                                                                             dict)


def test_auto_answers_text_when_the_model_calls_nothing(tools_server, tools_engine):
    local = LLM(tools_engine, RuntimeConfig(num_threads=1))
    template = ChatTemplate.from_engine_dir(tools_engine)
    messages = [{"role": "user", "content": "Lily went to the park"}]
    prompt = template.encode(local.core.tokenizer, messages, tools=[WEATHER])
    r = tools_server.client().chat.completions.create(model="stories", messages=messages, tools=[WEATHER],
                                                      max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == len(prompt) and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == greedy(local, prompt, 24, template.end_of_turn_token_ids)
    assert r.choices[0].finish_reason != "tool_calls"
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    again = tools_server.client().chat.completions.create(model="stories", messages=history, tools=[WEATHER],
                                                          max_tokens=4, temperature=0)
    converted = [api.ChatMessage(**m).for_template(i) for i, m in enumerate(history)]
    assert again.usage.prompt_tokens == len(template.encode(local.core.tokenizer, converted, tools=[WEATHER]))


def test_auto_parses_the_calls_a_model_writes(tools_engine):
    """A llama3_json server whose answer is made a call by a response_format: the "auto" path end to end."""
    server = Server(tools_engine, "--tool-call-parser", "llama3_json")
    try:
        schema = {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
            "additionalProperties": False}}, "required": ["name", "parameters"], "additionalProperties": False}
        ask = dict(model="stories", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                   max_tokens=48, temperature=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        r = server.client().chat.completions.create(**ask)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        streamed = _stream_calls(server.client().chat.completions.create(stream=True, **ask))
        assert streamed == ("", [("get_weather", json.loads(call.function.arguments))], "tool_calls")
    finally:
        server.stop()
