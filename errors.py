"""User-facing errors: the CLI prints their message (what was wrong, what to do) without a traceback."""

import click


class TrtbuildError(click.ClickException):
    """An error caused by the user's input or environment, with a message that says how to fix it."""

    exit_code = 2


class CheckpointError(TrtbuildError):
    """A model or checkpoint that is missing, corrupt or unsupported."""


class EngineCompatibilityError(TrtbuildError):
    """An engine that this machine or this trtbuild version cannot load; the message says what to rebuild."""
