"""Run the OpenAI-compatible app (app.py) with uvicorn on a thread of the `trtbuild serve` process, beside gRPC."""

from __future__ import annotations

import threading
import time

from trtbuild.errors import TrtbuildError
from trtbuild.runtime.async_engine import AsyncEngine


class HttpServer:
    """uvicorn serving the OpenAI API over `engine` on host:port until `stop()` (port 0 picks one: see `.port`)."""

    def __init__(self, engine: AsyncEngine, host: str, port: int, model_name: str, api_key: str | None = None,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto", ready_timeout: float = 30.0) -> None:
        import uvicorn

        from trtbuild.serving.openai.app import OpenAIServer

        self.openai = OpenAIServer(engine, model_name, api_key, tool_call_parser, reasoning_parser)
        self._server = uvicorn.Server(uvicorn.Config(self.openai.app, host=host, port=port, log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, name="trtbuild-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TrtbuildError(f"cannot serve HTTP on {host}:{port}; is the port in use?")
            time.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        self.address = f"http://{host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10.0)
        self.openai.workers.shutdown(wait=False, cancel_futures=True)
