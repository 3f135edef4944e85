"""User-facing errors: the CLI prints their message (what was wrong, what to do) without a traceback."""

import click


class TrtbuildError(click.ClickException):
    """An error caused by the user's input or environment, with a message that says how to fix it."""

    exit_code = 2


class CheckpointError(TrtbuildError):
    """A model or checkpoint that is missing, corrupt or unsupported."""


class EngineCompatibilityError(TrtbuildError):
    """An engine that this machine or this trtbuild version cannot load; the message says what to rebuild."""


class VerificationError(TrtbuildError):
    """An engine whose outputs differ from its reference beyond tolerance (`trtbuild verify`)."""

    exit_code = 1


class ConfigError(TrtbuildError, ValueError):
    """An invalid value of one config field, raised by the config that validates it.

    Configs do not know where a value came from, so the message names the field (`max_batch_size must be at least
    1, got 0`); each front end shows it in its own spelling: the CLI as the flag (`--max-batch-size ...`, see
    cli_errors.py), gRPC as INVALID_ARGUMENT naming the field. It is a ValueError, so callers that validate input
    (servers) catch it with the other invalid-argument errors.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")
