"""A real `trtbuild triton-serve` for tests: the launcher as a subprocess, a tritonclient gRPC stream, and the
tensors of a request as tritonclient inputs (their types from the model's config)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trtbuild.cli import main as cli
from trtbuild.serving.triton_backend import launcher
from trtbuild.serving.triton_backend.tensors import INPUTS

TIMEOUT = 60.0
_TYPES = {t.name: t.data_type.removeprefix("TYPE_").replace("STRING", "BYTES") for t in INPUTS}
_NUMPY = {"BYTES": np.object_, "INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
          "BOOL": np.bool_}


def write_repo(engine: Path, repo: Path, *models: list[str]) -> Path:
    """Skip (saying why) without nvidia-pytriton or tritonclient; else `triton-repo` each model (its extra options)
    into `repo` and make the stub environment (cached; pip installs numpy 1.26 once), so no timeout counts it."""
    try:
        launcher.find_tritonserver()
    except launcher.TritonNotInstalledError as e:
        pytest.skip(str(e))
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed: pip install 'trtbuild[triton]'")
    for extra in models:
        out = CliRunner().invoke(cli, ["triton-repo", "--engine", str(engine), "--output", str(repo), *extra])
        assert out.exit_code == 0, out.output
    launcher.stub_env()
    return repo


class TritonServer:
    """`trtbuild triton-serve` as a subprocess; stdout is read by a thread (the ready line)."""

    def __init__(self, repo: Path, log: Path) -> None:
        self.grpc, self.http, self.metrics_port = launcher.free_ports(3)
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trtbuild.cli", "triton-serve", "--repo", str(repo), "--grpc-port", str(self.grpc),
             "--http-port", str(self.http), "--metrics-port", str(self.metrics_port), "--exit-timeout", "10"],
            stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if "triton-serve: ready" in line:
                self.ready.set()
        self.ready.set()  # exited

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)

    def post(self, path: str, body: dict) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def gauges(self, model: str = "trtbuild") -> dict[str, float]:
        """{"kv_free": ..., "req_active": ...} of one model, from Triton's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=TIMEOUT) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("trtbuild_") and f'model="{model}"' in line:
                kind = line.split('_type="')[1].split('"')[0]
                out[("kv_" if line.startswith("trtbuild_kv") else "req_") + kind] = float(line.split()[-1])
        return out

    def wait_gauges(self, ok: Callable[[dict], bool], model: str = "trtbuild", timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while not ok(g := self.gauges(model)):
            assert time.monotonic() < deadline, f"metrics never reached the expected state: {g}"
            time.sleep(0.01)
        return g



def grpc_inputs(**fields: object) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in fields.items():
        dtype = _TYPES[name]
        array = np.array([value if isinstance(value, list) else [value]], dtype=_NUMPY[dtype])
        if dtype == "BYTES":
            array = np.array([[v.encode() for v in array[0]]], dtype=np.object_)
        inputs.append(grpcclient.InferInput(name, list(array.shape), dtype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


class Stream:
    """One tritonclient gRPC client with a bidirectional stream; responses of its requests arrive on a queue."""

    def __init__(self, server: TritonServer) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str = "trtbuild", **fields: object) -> None:
        self.client.async_stream_infer(model, grpc_inputs(**fields), enable_empty_final_response=True)

    def next(self) -> tuple[object, object]:
        return self.responses.get(timeout=TIMEOUT)

    def collect(self) -> tuple[list[int], str, str, int]:
        """(token ids, text, finish reason, number of responses) up to the FINAL response; raises on an error."""
        tokens, text, reason, n = [], "", "", 0
        while True:
            result, error = self.next()
            if error is not None:
                raise error
            response = result.get_response()
            if response.outputs:
                n += 1
                tokens += result.as_numpy("output_ids").reshape(-1).tolist()
                text += result.as_numpy("text_output").reshape(-1)[0].decode()
                reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if response.parameters["triton_final_response"].bool_param:
                return tokens, text, reason, n

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


