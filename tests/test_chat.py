"""Chat templates (runtime/chat.py): rendered as transformers' apply_chat_template renders them, the template's
sources (tokenizer_config.json string or list form, chat_template.jinja), end-of-turn detection, errors, and
`trtbuild run --chat` / `trtbuild client --chat` on stories260K with a template written into its engine directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import STORIES260K, TINYSTORIES656K, require_shared_models
from test_cli import assert_ok, assert_user_error, invoke

from trtbuild.errors import TrtbuildError
from trtbuild.runtime.chat import ChatMessage, ChatTemplate
from trtbuild.runtime.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama 2 style: BOS written by the template, the answer followed by " </s>", a system message folded into the first
# user turn, and raise_exception for a conversation that does not alternate.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = '' %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 %}{% set content = system_message + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# stories260K knows no <|im_end|>: its turns end with EOS (</s>).
STORY_CHAT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
              "{{ message['content'] + eos_token }}{% else %}{{ message['content'] + '\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'Once upon a time' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Tell me a story."}],
]


def model_dir(tmp_path: Path, template: object = None, source: Path = STORIES260K, **config: object) -> Path:
    """A folder with `source`'s tokenizer files, `template` as tokenizer_config.json's chat_template (if not None)."""
    require_shared_models()
    out = tmp_path / "model"
    out.mkdir(parents=True)
    shutil.copy(source / "tokenizer.json", out)
    doc = json.loads((source / "tokenizer_config.json").read_text()) | config
    if template is not None:
        doc["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("template", [CHATML, LLAMA2])
def test_render_and_encode_match_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    folder = model_dir(tmp_path, template)
    chat = ChatTemplate.from_engine_dir(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    tokenizer = Tokenizer(folder)
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert chat.render(messages, add_generation_prompt=add) == expected
            assert chat.render([ChatMessage(**m) for m in messages], add) == expected
            if template == CHATML:  # NOTE: for text after a special token (LLAMA2's "<s>[INST]"), transformers 5's
                # LlamaTokenizer replaces tokenizer.json's Metaspace prepend_scheme "always" by "first" (legacy=False)
                ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add, return_dict=False)
                assert chat.encode(tokenizer, messages, add) == list(ids)
    if template == LLAMA2:  # the template writes BOS once; encoding must not add another
        ids = chat.encode(tokenizer, CONVERSATIONS[0])
        assert ids[0] == tokenizer.token_to_id("<s>") and ids.count(ids[0]) == 1


def test_template_sources(tmp_path):
    assert ChatTemplate.from_engine_dir(model_dir(tmp_path / "none")) is None
    assert ChatTemplate.from_engine_dir(tmp_path) is None  # no tokenizer files at all
    listed = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    chat = ChatTemplate.from_engine_dir(model_dir(tmp_path / "list", listed))
    assert chat.render([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate.from_engine_dir(model_dir(tmp_path / "no_default", listed[:1])) is None
    # chat_template.jinja wins over tokenizer_config.json; bos_token given as {"content": ...} (older transformers)
    folder = model_dir(tmp_path / "jinja", "ignored", bos_token={"content": "<s>", "special": True})
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert ChatTemplate.from_engine_dir(folder).render([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_transformers_globals_and_filters(tmp_path):
    template = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}"
                "{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}")
    chat = ChatTemplate(template)
    messages = [{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "y"}]
    assert chat.render(messages) == '[{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "y"}]|4|y'


def test_errors_are_one_line_value_errors(tmp_path):
    chat = ChatTemplate(LLAMA2, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ValueError, match=r"^chat template: Conversation roles must alternate") as e:
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^chat template: .*\S") as e:
        ChatTemplate("{% for m in messages %}{{ m.content }}")  # no endfor
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"message role 'robot' is not supported"):
        chat.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"message role 'function' is not supported"):
        ChatMessage("function", "x")
    with pytest.raises(ValueError, match=r"only assistant messages carry tool_calls"):
        ChatMessage("user", "x", ({"type": "function", "function": {"name": "f", "arguments": {}}},))
    with pytest.raises(ValueError, match=r"must have a role and a content"):
        chat.render([{"role": "user"}])
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(TrtbuildError, match=r"tokenizer_config.json is not valid"):  # as a corrupt tokenizer.json
        ChatTemplate.from_engine_dir(tmp_path)


def test_end_of_turn_tokens(tmp_path):
    """The special token right after the assistant's answer, else EOS; no tokenizer: unknown."""
    stories = Tokenizer(STORIES260K) if STORIES260K.is_dir() else require_shared_models()
    eos = stories.token_to_id("</s>")
    assert ChatTemplate.from_engine_dir(model_dir(tmp_path / "llama2", LLAMA2)).end_of_turn_token_ids == (eos,)
    assert ChatTemplate.from_engine_dir(model_dir(tmp_path / "story", STORY_CHAT)).end_of_turn_token_ids == (eos,)
    # ChatML on a vocabulary without <|im_end|>: falls back to EOS
    assert ChatTemplate.from_engine_dir(model_dir(tmp_path / "chatml", CHATML)).end_of_turn_token_ids == (eos,)
    # a turn end that is a special token but not EOS (tinystories-656K: <|end_story|> is EOS, <|start_story|> BOS)
    turn_end = "{% for m in messages %}{{ m.content + bos_token + '\n' }}{% endfor %}"
    folder = model_dir(tmp_path / "656k", turn_end, source=TINYSTORIES656K)
    assert ChatTemplate.from_engine_dir(folder).end_of_turn_token_ids == (Tokenizer(folder).token_to_id(
        "<|start_story|>"),)
    assert ChatTemplate(CHATML).end_of_turn_token_ids == ()


@pytest.fixture(scope="module")
def chat_engine(stories_engine, tmp_path_factory) -> Path:
    """The stories260K engine with STORY_CHAT in its tokenizer_config.json."""
    engine = tmp_path_factory.mktemp("chat") / "engine"
    shutil.copytree(stories_engine, engine)
    config = json.loads((engine / "tokenizer_config.json").read_text())
    (engine / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": STORY_CHAT}))
    return engine


def expected_answer(engine: Path, messages: list[dict], max_tokens: int) -> tuple[str, list[int]]:
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    chat = ChatTemplate.from_engine_dir(engine)
    llm = LLM(engine, RuntimeConfig(num_threads=1, max_batch_size=1))
    ids = chat.encode(llm.core.tokenizer, messages)
    done = llm.generate([ids], SamplingParams(max_tokens=max_tokens, stop_token_ids=chat.end_of_turn_token_ids))[0]
    return done.text, done.token_ids


def test_run_chat(chat_engine, stories_engine, monkeypatch):
    messages = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Lily has a dog."}]
    text, tokens = expected_answer(chat_engine, messages, 60)
    result = invoke("run", "--engine", chat_engine, "--chat", "Lily has a dog.", "--system", "A story.",
                    "--max-tokens", 60)
    assert_ok(result)
    assert result.stdout == text + "\n" and "Lily has a dog" not in text  # the answer only, not the prompt
    # stories260K rarely ends a story this soon: make a token it writes the turn's end, to see the run stop there
    turn_end = tokens[len(tokens) // 2]
    monkeypatch.setattr(ChatTemplate, "end_of_turn_token_ids", property(lambda self: (turn_end,)))
    short_text, short_tokens = expected_answer(chat_engine, messages, 60)
    assert short_tokens == tokens[: tokens.index(turn_end) + 1]
    result = invoke("run", "--engine", chat_engine, "--chat", "Lily has a dog.", "--system", "A story.",
                    "--max-tokens", 60)
    assert_ok(result)
    assert result.stdout == short_text + "\n" and len(short_text) < len(text)  # stopped, the stop token not shown
    assert short_text == Tokenizer(chat_engine).decode(short_tokens[:-1]) != Tokenizer(chat_engine).decode(short_tokens)


def test_run_chat_bad_input(chat_engine, stories_engine):
    assert_user_error(invoke("run", "--engine", stories_engine, "--chat", "hi"), r"has no chat template .*use --prompt")
    assert_user_error(invoke("run", "--engine", chat_engine, "--chat", "hi", "--prompt", "hi"),
                      r"either --prompt or --chat")
    assert_user_error(invoke("run", "--engine", chat_engine), r"either --prompt or --chat")
    assert_user_error(invoke("run", "--engine", chat_engine, "--prompt", "hi", "--system", "x"),
                      r"--system goes with --chat")


def test_client_chat(chat_engine):
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.serving.grpc.server import GenerationServer

    text, _ = expected_answer(chat_engine, [{"role": "user", "content": "Tom went out."}], 60)
    assert_user_error(invoke("client", "--address", "127.0.0.1:1", "--chat", "hi"), r"--chat needs --engine-dir")
    server = GenerationServer(port=0, max_queue_size=4)
    try:
        server.load(chat_engine, RuntimeConfig(num_threads=1))
        for stream in ((), ("--no-stream",)):
            result = invoke("client", "--address", server.address, "--engine-dir", chat_engine, "--chat",
                            "Tom went out.", "--max-tokens", 60, *stream)
            assert_ok(result)
            assert result.stdout == text + "\n"
    finally:
        server.stop()
