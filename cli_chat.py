"""--prompt / --chat handling shared by `trtbuild run` and `trtbuild client`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from trtbuild.errors import TrtbuildError


def chat_template(engine_dir: Path, prompt: str | None, chat: str | None, system: str | None):
    """The engine's ChatTemplate for --chat (None for --prompt); one of the two must be given."""
    if (prompt is None) == (chat is None):
        raise click.UsageError("give either --prompt or --chat")
    if chat is None:
        if system is not None:
            raise click.UsageError("--system goes with --chat")
        return None
    from trtbuild.runtime.chat import ChatTemplate

    template = ChatTemplate.from_engine_dir(engine_dir)
    if template is None:
        raise TrtbuildError(f"{engine_dir} has no chat template (tokenizer_config.json 'chat_template' or "
                            "chat_template.jinja), so --chat cannot be used; use --prompt.")
    return template


def chat_messages(chat: str, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": chat}]


def harmony_answer(template: Any) -> Any:
    """A harmony parser (serving/openai/harmony.py) for a gpt-oss chat's answer, else None: its answer is a run of
    channels whose special tokens only the parser should see."""
    from trtbuild.serving.openai.harmony import HarmonyParser, teaches_harmony

    return HarmonyParser() if template is not None and teaches_harmony(template.source) else None


def echo_answer(text: str, harmony: Any, final: bool) -> None:
    """Stream `text` to the terminal; a harmony answer's chain of thought to stderr, its answer to stdout."""
    if harmony is None:
        click.echo(text, nl=False)
    else:
        thinking, content, calls = harmony.feed(text, final=final)
        click.echo(thinking, nl=False, err=True)
        click.echo(content, nl=False)
        for call in calls:
            click.echo(f"\n[tool call] {call.name}({call.arguments})", nl=False)
    sys.stdout.flush()
