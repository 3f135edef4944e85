"""`trtbuild bench --address URL --backend openai`: any OpenAI-compatible server (`trtbuild serve --http-port`,
llama.cpp's `llama-server`, `vllm serve`) as a bench target, through streaming /v1/completions with the standard
library's HTTP client. KV usage is sampled from /metrics where the server exports vLLM's `kv_cache_usage_perc`."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

from trtbuild.bench.targets import check_adapter
from trtbuild.bench.workload import BenchRequest, KVSampler, RequestResult
from trtbuild.errors import TrtbuildError

SAMPLE_S = 0.05
# NOTE: the API does not tell a model's vocabulary size; every tokenizer has these ids, so synthetic prompts use them
SAFE_VOCAB = 256
_KV_USAGE = re.compile(r"^vllm:(?:kv|gpu)_cache_usage_perc(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


class OpenAITarget:
    """Every request's `model` is the server's first model (its base), or LoRA adapter `lora`, which /v1/models must
    list with a `parent` (as trtbuild and vLLM list adapters)."""

    def __init__(self, address: str, api_key: str | None = None, ready_timeout: float = 30.0,
                 lora: str | None = None) -> None:
        self.base = (address if "://" in address else f"http://{address}").rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"}
                                                               if api_key else {})
        try:
            models = self._get("/v1/models", ready_timeout)["data"]
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise TrtbuildError(f"cannot reach an OpenAI-compatible server at {self.base} ({e}); start one, e.g. "
                                "`trtbuild serve --engine <dir> --http-port 8000`") from None
        self.model = models[0]["id"]
        adapters = [m.get("id") for m in models if isinstance(m, dict) and m.get("parent")]
        check_adapter(lora, adapters, f"the server at {self.base}", "/v1/models lists none (no model with a parent)")
        self.request_model = lora or self.model
        self.max_seq_len = models[0].get("max_model_len")
        self.name, self.vocab_size, self.special_ids = f"openai server {self.base} ({self.model})", SAFE_VOCAB, set()
        self.sizes: dict[str, float | None] = dict.fromkeys(
            ("engine_file_bytes", "kv_bytes_per_token", "kv_pool_bytes", "load_s", "warm_up_s"))
        self._sampler: KVSampler | None = None

    def _get(self, path: str, timeout: float) -> Any:
        request = urllib.request.Request(self.base + path, headers=self.headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if path != "/metrics" else body.decode()

    def prepare(self, requests: list[BenchRequest]) -> list[BenchRequest]:
        for r in requests:
            if self.max_seq_len and isinstance(r.prompt, list) and len(r.prompt) + r.output_tokens > self.max_seq_len:
                raise TrtbuildError(f"{r.where}: {len(r.prompt)} prompt + {r.output_tokens} output tokens exceed the "
                                    f"server's max_model_len {self.max_seq_len}")
        return requests

    def send(self, request: BenchRequest, timeout: float) -> RequestResult:
        body = {"model": self.request_model, "prompt": request.prompt, "max_tokens": request.output_tokens,
                "stream": True, "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
        start, result, first = time.perf_counter(), RequestResult(True), True
        try:
            req = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(), self.headers)
            with urllib.request.urlopen(req, timeout=timeout) as response:
                for line in response:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return RequestResult(False, error=str(event["error"].get("message")))
                    if first and any(c.get("text") for c in event.get("choices", [])):
                        result.ttft, first = time.perf_counter() - start, False
                    if usage := event.get("usage"):
                        result.prompt_tokens = usage.get("prompt_tokens", 0)
                        result.output_tokens = usage.get("completion_tokens", 0)
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        except urllib.error.HTTPError as e:
            return RequestResult(False, error=f"HTTP {e.code}: {e.read()[:200]!r}")
        except (OSError, ValueError) as e:
            return RequestResult(False, error=str(e))
        result.latency = time.perf_counter() - start
        return result

    def begin(self) -> None:
        def read() -> float | None:  # None: this server exports no KV usage (then no samples)
            try:
                found = _KV_USAGE.search(self._get("/metrics", 5.0))
            except urllib.error.HTTPError:  # no /metrics here
                return None
            return float(found.group(1)) if found else None

        self._sampler = KVSampler(read, SAMPLE_S, (OSError, ValueError))

    def end(self) -> tuple[list[float], dict[str, Any] | None]:
        return self._sampler.stop() if self._sampler is not None else [], None

    def close(self) -> None:
        pass
