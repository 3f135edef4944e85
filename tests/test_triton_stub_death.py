"""`trtbuild triton-serve` when the model's Python stub dies: SIGKILL it during streaming requests; the clients get
an error or a closed connection (no hang), the launcher says which stub died and exits non-zero for a supervisor to
restart it, and the stub's /dev/shm region does not remain. Skipped without nvidia-pytriton or tritonclient."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from helpers import STORIES260K, require_shared_models
from triton_helpers import Stream, TritonServer, write_repo

from trtbuild.serving.triton_backend import launcher, watchdog

BOUND_S = 20.0  # the launcher's stub-death grace (5 s) plus its poll and tritonserver's kill, with room to spare


def _child(pid: int) -> int:
    """The one child process of `pid` (the launcher's tritonserver)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = watchdog._stat(int(stat.parent.name))
        if fields and int(fields[1]) == pid:
            return int(stat.parent.name)
    raise AssertionError(f"process {pid} has no child")


def _http_stream(server: TritonServer, events: list[dict], ended: list[str]) -> None:
    """Read an HTTP generate_stream (server-sent events) until it ends; `ended` says how."""
    body = json.dumps({"text_input": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/models/trtbuild/generate_stream",
                                    body.encode(), timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[len(b"data: "):]))
        ended.append("closed")
    except Exception as e:  # an incomplete chunked read when the server is killed
        ended.append(f"error: {e!r}")


def test_a_killed_stub_fails_its_streams_and_the_launcher_exits_nonzero(engine_from_hf, tmp_path):
    require_shared_models()
    engine = engine_from_hf(STORIES260K, max_batch_size=16, max_num_tokens=512)
    repo = write_repo(engine, tmp_path / "repo", ["--threads", "1"])
    server = TritonServer(repo, tmp_path / "server.log")
    try:
        assert server.ready.wait(60) and server.proc.poll() is None, f"{server.lines}\n{server.log.read_text()}"
        [stub] = watchdog.find_stubs(_child(server.proc.pid))
        assert (Path("/dev/shm") / stub.region).exists()
        streams = [Stream(server) for _ in range(4)]
        for s in streams:
            s.send(text_input="Once upon a time", stream=True, max_tokens=240, ignore_eos=True)
        events: list[dict] = []
        ended: list[str] = []
        reader = threading.Thread(target=_http_stream, args=(server, events, ended), daemon=True)
        reader.start()
        for s in streams:  # every request is running: its first token came back
            result, error = s.next()
            assert error is None, error
        deadline = time.monotonic() + 10
        while not events:
            assert time.monotonic() < deadline, ended
            time.sleep(0.01)

        os.kill(stub.pid, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:  # no more tokens, no normal end: an error (the server went away) within the bound
            while True:
                result, error = s.responses.get(timeout=BOUND_S)
                if error is not None:
                    break
                assert result.as_numpy("finish_reason").reshape(-1)[0] != b"length", "the stream ended normally"
        reader.join(BOUND_S)
        assert ended and not reader.is_alive(), "the HTTP stream hangs"
        # NOTE: the last event may be Triton's {"error": ...} for the dead stub: that too is not a normal end
        assert events[-1].get("finish_reason") != "length" or len(events) < 240, "the HTTP stream ended normally"
        assert server.proc.wait(BOUND_S) == launcher.STUB_DIED_EXIT
        assert time.monotonic() - killed < BOUND_S
        for s in streams:
            s.client.close()
    finally:
        server.stop()
    out = "\n".join(server.lines)
    assert f"the Python backend stub of model 'trtbuild' (pid {stub.pid}) was killed by SIGKILL" in out, out
    assert not (Path("/dev/shm") / stub.region).exists(), "the killed stub's shared memory remains"
    assert subprocess.run(["pgrep", "-f", stub.region], capture_output=True).returncode == 1  # no stub left
