"""Watch the Python-backend stubs (`triton_python_backend_stub`) that tritonserver starts, one per model instance.

When a stub dies (SIGKILL, the OOM killer, a crash), tritonserver 2.51 does not restart it: `/v2/health/ready` and
the model's ready endpoint keep answering 200 while every request to the model fails ("Stub process ... is not
healthy"), and requests in flight may hang (or the server aborts on a broken interprocess lock). The dead stub stays
a zombie of tritonserver, and its 1 MiB /dev/shm region is never removed. `StubWatch` notices the death from /proc
(a zombie's exit status is in /proc/<pid>/stat) and `remove` removes what the stubs leave behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = b"triton_python_backend_stub"
CLEAN_EXIT = "exited with code 0"


@dataclass(frozen=True)
class Stub:
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells this process from a later one with the same pid
    model: str  # <repo>/<model>/<version>/model.py
    region: str  # its shared-memory region in /dev/shm


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on; None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def find_stubs(server_pid: int) -> list[Stub]:
    """The running Python stubs that tritonserver `server_pid` started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        pid = int(stat.parent.name)
        fields = _stat(pid)
        try:
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if fields and int(fields[1]) == server_pid and argv[0].endswith(STUB_BINARY) and len(argv) > 2:
            model = Path(argv[1].decode()).parent.parent.name
            found.append(Stub(pid, int(fields[19]), model, argv[2].decode()))
    return found


def how_it_ended(stub: Stub) -> str | None:
    """None while the stub runs; else how it ended, from its zombie's exit status when it is still there."""
    fields = _stat(stub.pid)
    if fields is None or int(fields[19]) != stub.start_time:
        return "ended"
    if fields[0] not in ("Z", "X"):
        return None
    status = int(fields[49]) if len(fields) > 49 else 0  # field 52: the exit status as waitpid reports it
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with code {os.WEXITSTATUS(status)}"


def remove(stubs: list[Stub]) -> None:
    """SIGKILL and reap those of `stubs` still there (after tritonserver has exited), and remove their regions."""
    for stub in stubs:
        fields = _stat(stub.pid)
        if fields is not None and int(fields[19]) == stub.start_time:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stub.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # reparented to the launcher (a subreaper): reap it
                os.waitpid(stub.pid, 0)
        with contextlib.suppress(FileNotFoundError):
            (Path("/dev/shm") / stub.region).unlink()


class StubWatch:
    """The stubs of one tritonserver, seen once it is ready (every model of the repository is loaded by then)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.stubs = find_stubs(server_pid)

    def dead(self) -> tuple[Stub, str] | None:
        """The first stub that has ended, and how; None while all run."""
        for stub in self.stubs:
            if (how := how_it_ended(stub)) is not None:
                return stub, how
        return None

    def remove_all(self) -> None:
        """Once tritonserver has exited: what its stubs left behind (the region of a killed one too)."""
        remove(self.stubs)
