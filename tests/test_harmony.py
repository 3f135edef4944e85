"""gpt-oss's harmony response format on the OpenAI API: answers split by their channels into reasoning_content,
content and tool calls (whole and streamed in any pieces), the stop tokens <|return|> and <|call|>, earlier turns
given back to the template, and the server answering a scripted model: a byte-level tokenizer with harmony's special
tokens and a template of our own in the style of gpt-oss's, under an engine stand-in whose model writes a given
text (detokenized as the engine core does it, stopping at the request's stop tokens)."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_tool_calls import TIME, WEATHER, _request

from trtbuild.cli_serving import serve
from trtbuild.runtime.async_engine import RequestStream
from trtbuild.runtime.chat import ChatTemplate
from trtbuild.runtime.detokenizer import IncrementalDetokenizer
from trtbuild.runtime.engine_core import RequestOutput
from trtbuild.runtime.tokenizer import Tokenizer
from trtbuild.serving.openai import protocol as api
from trtbuild.serving.openai.answer import ChatAnswer
from trtbuild.serving.openai.app import OpenAIServer, _finish
from trtbuild.serving.openai.harmony import HarmonyParser, call_header, for_template, teaches_harmony
from trtbuild.serving.openai.tool_use import NO_TOOLS, tool_use

SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]
# In the style of gpt-oss's template (not a copy): a system message, a developer message with the tools (each
# description written without asking whether there is one), the earlier calls (after their thinking: `thinking`,
# else the content) ending with <|call|>, the tool results named after the last call, <|return|> after a final
# answer that ends the conversation, <|start|>assistant to generate.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ '// ' + t.function.description }}\n"
    "{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{% set last = namespace(call=none) %}{% for m in messages %}"
    "{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "{% if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking') }}{% endif %}"
    "{% if m.thinking or m.content %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking or m.content }}<|end|>{% endif %}{% set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{% set last.call = call.name %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
    "{% endif %}")

THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>The answer is 4.")
CALL_IN_CHANNEL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                   'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
CALL_AFTER_ROLE = ('<|channel|>analysis<|message|>Weather, so a call.<|end|><|start|>assistant '
                   'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}')
# (answer, reasoning_content, content, calls' (name, arguments))
ANSWERS = [
    (THINK_THEN_ANSWER, "User asks 2+2. Simple.", "The answer is 4.", []),
    ("<|channel|>final<|message|>Hi <there>, a < b.", "", "Hi <there>, a < b.", []),
    (CALL_IN_CHANNEL, "Need the weather.", "", [("get_weather", '{"city": "Paris"}')]),
    (CALL_AFTER_ROLE, "Weather, so a call.", "", [("get_weather", '{"city": "Oslo"}')]),
    (' to=functions.get_time<|channel|>commentary<|constrain|>json<|message|>{"zone": "UTC"}', "", "",
     [("get_time", '{"zone": "UTC"}')]),  # the call first, its recipient right after the generation prompt's role
    ("<|channel|>analysis<|message|>Plan first.<|end|><|start|>assistant<|channel|>commentary<|message|>I will look "
     'it up.<|end|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}',
     "Plan first.", "I will look it up.", [("get_time", "{}")]),  # a preamble is written for the user
    ('<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
     '<|constrain|>json<|message|>{"city": Paris}', "Hmm.", '{"city": Paris}', []),  # malformed: stays text
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa', "", '{"city": "Pa',
     []),  # cut short by max_tokens
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>"
     "assistant<|channel|>final<|message|>c", "a\nb", "c", []),
    ('<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant<|channel|>analysis to=python code'
     '<|message|>print(1)', "Run it.\nprint(1)", "", []),  # a built-in tool's call is chain of thought
    ("<|channel|>analysis<|message|>cut short in the thinking", "cut short in the thinking", "", []),
    ("<|channel|>ana", "", "", []),  # cut short in the header
    ("Plain text, not harmony", "", "Plain text, not harmony", []),
    ('<|channel|>commentary to=functions.get_time<|message|>{"zone": "CET"}<|call|><|start|>functions.get_time '
     'to=assistant<|channel|>commentary<|message|>"12:00"<|end|>', '"12:00"', "",
     [("get_time", '{"zone": "CET"}')]),  # not stopped at <|call|>: what follows is no answer
]


def _calls(calls) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(("answer", "thinking", "content", "calls"), ANSWERS)
def test_answers_split_by_channel_whole_or_in_any_pieces(answer, thinking, content, calls):
    thought, said, called = HarmonyParser().feed(answer, final=True)
    assert (thought, said, _calls(called)) == (thinking, content, calls)
    for size in (1, 2, 3, 5, 8, 13):
        parser, got = HarmonyParser(), ["", "", []]
        for at in range(0, len(answer), size):
            t, c, new = parser.feed(answer[at:at + size], final=at + size >= len(answer))
            assert "<|" not in t + c, (size, t, c)  # a special token split across pieces never leaks as text
            got = [got[0] + t, got[1] + c, got[2] + new]
        assert (got[0], got[1], _calls(got[2])) == (thinking, content, calls), size


def test_without_reasoning_or_tools_the_analysis_and_calls_are_content():
    assert HarmonyParser(reasoning=False).feed(THINK_THEN_ANSWER, True)[:2] == (
        "", "User asks 2+2. Simple.\nThe answer is 4.")
    assert HarmonyParser(calls=False).feed(CALL_IN_CHANNEL, True) == ("Need the weather.", '{"city": "Paris"}', [])


def test_the_template_is_recognized_and_a_named_call_gets_its_header():
    assert teaches_harmony(HARMONY_TEMPLATE) and not teaches_harmony("{{ messages }} <|channel|>")
    assert call_header("get_time") == "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
    assert "harmony" in next(p.type.choices for p in serve.params if p.name == "tool_call_parser")
    message = ChatAnswer(NO_TOOLS, False, harmony=True).message(call_header("f") + "{}")
    assert message == {"role": "assistant", "content": "{}"}  # a call when no tools were offered: content


def test_chat_answers_and_deltas_carry_reasoning_content_and_calls():
    use = tool_use(_request(tools=[WEATHER, TIME]), True, None, frozenset(), harmony=True)
    assert use.keep_special_tokens and use.format is None
    message = ChatAnswer(use, False, harmony=True).message(CALL_AFTER_ROLE)
    assert message["reasoning_content"] == "Weather, so a call." and message["content"] is None
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})
    answer = ChatAnswer(use, False, harmony=True)
    pieces = ["<|channel|>analysis<|mess", "age|>Hm", "m.<|e", "nd|><|start|>assistant<|channel|>commentary to=funct",
              'ions.get_time <|constrain|>json<|message|>{"zone": ', '"UTC"}']
    deltas = [answer.delta(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[:4] == [{"content": ""}, {"reasoning_content": "Hm"}, {"reasoning_content": "m."}, {"content": ""}]
    assert deltas[5]["tool_calls"][0]["index"] == 0 and deltas[5]["tool_calls"][0]["function"]["name"] == "get_time"
    assert _finish("stop", answer.called) == "tool_calls"
    plain = ChatAnswer(NO_TOOLS, None, harmony=True).message(THINK_THEN_ANSWER)  # --reasoning-parser none
    assert plain == {"role": "assistant", "content": "User asks 2+2. Simple.\nThe answer is 4."}


# ---- a tokenizer and template of harmony ------------------------------------------------------------------------
def harmony_model_dir(folder: Path, template: str = HARMONY_TEMPLATE) -> Path:
    """A folder with a byte-level tokenizer (a token a byte, no merges) that has harmony's special tokens, and
    `template` as its chat template; EOS <|return|> as gpt-oss GGUFs have it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = HFTokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory) -> Path:
    return harmony_model_dir(tmp_path_factory.mktemp("harmony") / "model")


def test_generation_stops_at_return_and_at_call(harmony_dir, tmp_path):
    tokenizer = Tokenizer(harmony_dir)
    ids = ChatTemplate.from_engine_dir(harmony_dir).end_of_turn_token_ids
    assert ids == (tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>"))
    # a special token after a call that more text follows (parallel calls, as Kimi's <|tool_call_end|>) ends no turn
    between_calls = ("{% for m in messages %}{% for c in m.tool_calls or [] %}<|start|>"
                     "{{ c.function.arguments | tojson }}<|end|>{% endfor %}{{ m.content }}{% endfor %}<|return|>")
    assert ChatTemplate.from_engine_dir(harmony_model_dir(tmp_path / "between", between_calls)) \
        .end_of_turn_token_ids == (tokenizer.token_to_id("<|return|>"),)


def test_earlier_turns_are_given_to_the_template_as_it_reads_them(harmony_dir):
    template = ChatTemplate.from_engine_dir(harmony_dir)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}
    history = [api.ChatMessage(role="user", content="Weather in Nice?"),
               api.ChatMessage(role="assistant", content=None, reasoning_content="Need a call.", tool_calls=[call]),
               api.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    text = template.render(for_template([m.for_template(i) for i, m in enumerate(history)]), tools=[WEATHER])
    assert text.endswith("<|start|>user<|message|>Weather in Nice?<|end|><|start|>assistant<|channel|>analysis"
                         "<|message|>Need a call.<|end|><|start|>assistant to=functions.get_weather<|channel|>"
                         'commentary json<|message|>{"city": "Nice"}<|call|><|start|>functions.get_weather '
                         'to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant')
    # a preamble and the thinking both given back: joined into the thinking, which the template refuses to have twice
    both = api.ChatMessage(role="assistant", content="Let me look.", reasoning="Need a call.", tool_calls=[call])
    messages = for_template([history[0].for_template(0), both.for_template(1), history[2].for_template(2)])
    assert "<|channel|>analysis<|message|>Need a call.\nLet me look.<|end|>" in template.render(messages)
    with pytest.raises(ValueError, match="Cannot pass both"):
        template.render([history[0].for_template(0), both.for_template(1)])
    reads = ChatTemplate("{% for m in messages %}{{ m.reasoning_content }}|{{ m.thinking }}{% endfor %}")
    assert reads.render([both.for_template(0)]) == "Need a call.|Need a call."  # Qwen3's name, gpt-oss's name
    with pytest.raises(ValueError, match="only assistant messages carry reasoning_content"):
        api.ChatMessage(role="user", content="x", reasoning_content="y").for_template(0)


# ---- the server, over a scripted model -------------------------------------------------------------------------
class ScriptedEngine:
    """An AsyncEngine stand-in whose model writes `answer` to every request: its tokens are detokenized as the
    engine core does (the request's skip_special_tokens honoured), up to the first of the request's stop tokens."""

    def __init__(self, directory: Path, answer: str) -> None:
        tokenizer = Tokenizer(directory)
        self.core = SimpleNamespace(tokenizer=tokenizer, engine=SimpleNamespace(info=SimpleNamespace(path=directory)),
                                    scheduler=SimpleNamespace(config=SimpleNamespace(max_seq_len=4096)), lora_names=(),
                                    lora=SimpleNamespace(max_loras=0, dynamic=False))
        self.max_queue_size, self.on_finished, self.dead = 4, [], False
        self.answer, self.params, self.prompts = answer, [], []

    def submit(self, prompt: list[int], params, lora: str | None = None) -> RequestStream:
        self.params.append(params)
        self.prompts.append(self.core.tokenizer.decode(prompt, skip_special_tokens=False))
        tokenizer = self.core.tokenizer
        stream = RequestStream(self, uuid.uuid4().hex, len(prompt))
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
        ids = tokenizer.encode(self.answer, add_special_tokens=False)
        for n, token in enumerate(ids, start=1):
            stop = token in params.stop_token_ids
            last = stop or n == len(ids) or n == params.max_tokens
            text = "" if stop else detokenizer.add(token) + (detokenizer.flush() if last else "")
            reason = ("length" if n == params.max_tokens and not stop else "stop") if last else None
            stream.put(RequestOutput(stream.request_id, [token], text, last, reason, [], len(prompt), n))
            if last:
                break
        return stream

    def cancel(self, request_id: str) -> None:
        pass


class _Connected:
    async def is_disconnected(self) -> bool:
        return False


def _chat(server: OpenAIServer, **fields) -> dict:
    """The response's JSON; streamed: the chunks' JSON."""
    async def go():
        r = await server.chat(_Connected(), api.ChatCompletionRequest(**fields))
        if not fields.get("stream"):
            return json.loads(r.model_dump_json(exclude_none=True))
        return [json.loads(e[len("data: "):]) async for e in r.body_iterator if e != "data: [DONE]\n\n"]

    return asyncio.run(go())


def _streamed(chunks: list[dict]) -> tuple[str, str, list, str | None]:
    thinking = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
    return thinking, content, calls, next((c["choices"][0].get("finish_reason") for c in chunks[::-1]
                                           if c["choices"] and c["choices"][0].get("finish_reason")), None)


ASK = dict(model="gpt-oss", messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0)


def test_a_server_answers_the_analysis_as_reasoning_content(harmony_dir):
    engine = ScriptedEngine(harmony_dir, THINK_THEN_ANSWER + "<|return|><|start|>user<|message|>more")
    server = OpenAIServer(engine, "gpt-oss")
    try:
        assert server.harmony and server.reasoning
        r = _chat(server, **ASK)
        params = engine.params[-1]
        assert params.skip_special_tokens is False and params.stop_token_ids == ChatTemplate.from_engine_dir(
            harmony_dir).end_of_turn_token_ids
        assert r["choices"][0]["message"] == {"role": "assistant", "reasoning_content": "User asks 2+2. Simple.",
                                              "content": "The answer is 4."}
        assert r["choices"][0]["finish_reason"] == "stop"
        chunks = _chat(server, stream=True, **ASK)
        assert _streamed(chunks) == ("User asks 2+2. Simple.", "The answer is 4.", [], "stop")
        assert all("<|" not in json.dumps(c) for c in chunks)
        skipped = _chat(server, skip_special_tokens=True, **ASK)["choices"][0]["message"]  # asked: no channels
        assert skipped["content"] == "analysisUser asks 2+2. Simple.assistantfinalThe answer is 4."
    finally:
        server.workers.shutdown()
    plain = OpenAIServer(engine, "gpt-oss", reasoning_parser="none")
    try:
        assert _chat(plain, **ASK)["choices"][0]["message"] == {
            "role": "assistant", "content": "User asks 2+2. Simple.\nThe answer is 4."}
    finally:
        plain.workers.shutdown()


def test_a_server_answers_calls_and_stops_at_call(harmony_dir):
    engine = ScriptedEngine(harmony_dir, CALL_AFTER_ROLE + '<|call|><|start|>functions.get_weather to=assistant'
                                                           '<|channel|>commentary<|message|>"made up"<|end|>')
    server = OpenAIServer(engine, "gpt-oss", tool_call_parser="harmony")
    ask = dict(ASK, tools=[WEATHER, TIME])
    try:
        r = _chat(server, **ask)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["reasoning_content"] == "Weather, so a call."
        [call] = choice["message"]["tool_calls"]
        assert (call["type"], call["function"]) == ("function", {"name": "get_weather",
                                                                 "arguments": '{"city": "Oslo"}'})
        thinking, content, calls, finish = _streamed(_chat(server, stream=True, **ask))
        assert (thinking, content, finish) == ("Weather, so a call.", "", "tool_calls")
        assert [(c["index"], c["function"]) for c in calls] == [(0, call["function"])]
        # the history given back renders; a named function's call is written after its header
        history = ask["messages"] + [
            {"role": "assistant", "content": None, "reasoning_content": "Weather, so a call.",
             "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        _chat(server, **dict(ask, messages=history))
        assert engine.prompts[-1].endswith('<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
                                           '<|message|>"sunny"<|end|><|start|>assistant')
        engine.answer = '{"zone": "UTC"}<|call|>'
        named = _chat(server, tool_choice={"type": "function", "function": {"name": "get_time"}}, **ask)
        assert named["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_time",
                                                                             "arguments": '{"zone": "UTC"}'}
        assert engine.prompts[-1].endswith("<|start|>assistant" + call_header("get_time"))
        engine.answer = '{"city": "Oslo"}<|return|>'  # a response_format's JSON: no channels to split
        schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
        assert _chat(server, response_format=schema, **ask)["choices"][0]["message"] == {
            "role": "assistant", "content": '{"city": "Oslo"}'}
        engine.answer = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Oslo}'
        broken = _chat(server, **ask)["choices"][0]
        assert broken["message"] == {"role": "assistant", "content": '{"city": Oslo}'}
        assert broken["finish_reason"] == "stop"
    finally:
        server.workers.shutdown()


def test_run_chat_prints_a_harmony_answer_s_final_channel_and_its_thinking_apart(capsys):
    """`trtbuild run --chat` on a gpt-oss engine: the analysis to stderr, the final answer to stdout, no tokens."""
    from trtbuild.cli_chat import echo_answer
    from trtbuild.serving.openai.harmony import HarmonyParser

    answer = "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    parser = HarmonyParser()
    pieces = [answer[i:i + 5] for i in range(0, len(answer), 5)]
    for i, piece in enumerate(pieces):
        echo_answer(piece, parser, final=i == len(pieces) - 1)
    out, err = capsys.readouterr()
    assert (out, err) == ("4", "Add them.")
    echo_answer("plain <|end|> text", None, final=True)
    assert capsys.readouterr().out == "plain <|end|> text"
