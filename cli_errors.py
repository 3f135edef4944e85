"""The one place where the CLI turns errors into user errors: an invalid config field becomes its flag.

Configs and the runtime validate without knowing about flags: a `ConfigError` names the field (`max_batch_size must
be ...`), a request that cannot run raises ValueError with what is wrong. `TrtbuildCommandGroup` (the `trtbuild`
group) catches both around every command and prints one `Error:` line, so commands carry no error plumbing.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

import click

from trtbuild.errors import ConfigError, TrtbuildError

log = logging.getLogger(__name__)

# Config fields whose flag is not the field's own name (the others are found among the command's options).
FLAG_OF_FIELD = {
    "num_threads": "--threads",
    "enable_prefix_caching": "--no-prefix-caching",
    "num_speculative_tokens": "--speculative-tokens",
    "draft_engine_dir": "--draft-engine",
    "shared_input_scales": "--fuse-shared-scales",
    "fuse": "--no-fuse",
}


def flag_of(command: click.Command | None, field: str) -> str:
    """How the user spelled config field `field` on `command`'s command line (the field itself when no flag sets it)."""
    for param in command.params if command is not None else ():
        if param.name == field and isinstance(param, click.Option):
            return max(param.opts, key=len)
    return FLAG_OF_FIELD.get(field, field)


class TrtbuildCommandGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ConfigError as e:
            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            raise TrtbuildError(f"{flag_of(command, e.field)} {e.problem}") from None
        except TrtbuildError:
            raise
        except ValueError as e:  # NOTE: UnicodeDecodeError is one too: commands read their text files themselves
            log.info("the error, with its traceback (shown with -v):", exc_info=True)
            raise TrtbuildError(str(e)) from None
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.info("the error, with its traceback (shown with -v):", exc_info=True)
            raise TrtbuildError(disk_full_message(e)) from None


def disk_full_message(e: OSError) -> str:
    where = f" writing {e.filename}" if e.filename else ""
    return (f"the disk is full{where} ({e.strerror}). `convert`, `quantize` and `build` remove their partial "
            "output, `verify` its temporary directory. Free space and run the command again: from an 8B Q4_K_M "
            "GGUF, `convert` writes a 7.3 GB checkpoint and `build` needs 16 GB while it runs for a 5.3 GB "
            "engine; `trtbuild verify` builds its reference in the temporary directory (11 GB there; set TMPDIR "
            "to put it elsewhere).")
