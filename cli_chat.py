"""--prompt / --chat handling shared by `trtbuild run` and `trtbuild client`."""

from __future__ import annotations

from pathlib import Path

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
