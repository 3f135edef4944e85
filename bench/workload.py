"""Benchmark workloads: requests from a dataset or synthetic, an offered load (concurrency cap, Poisson
arrivals, a deadline per request) sent to a `Target`, and the latency / throughput summary of a run."""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trtbuild.errors import TrtbuildError

if TYPE_CHECKING:
    pass

WARMUP_TOKENS = 2


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    output_tokens: int
    where: str  # "line 3 of data.jsonl" or "synthetic request 3", for error messages


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # send -> first token, seconds
    latency: float = 0.0  # send -> last token
    preemptions: int = 0
    cached_tokens: int = 0
    error: str = ""


# ---- datasets -------------------------------------------------------------------------------------------------------
def load_dataset(path: Path, limit: int | None = None) -> list[BenchRequest]:
    """JSON lines {"prompt": str | "input_ids": [int], "output_tokens": int >= 1}; blank lines are skipped."""
    requests: list[BenchRequest] = []
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"line {number} of {path}"
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrtbuildError(f"{where}: not JSON ({e.msg})") from None
            requests.append(_dataset_request(doc, where))
            if limit is not None and len(requests) == limit:
                break
    if not requests:
        raise TrtbuildError(f"{path} holds no requests; write one JSON object per line")
    return requests


def _dataset_request(doc: object, where: str) -> BenchRequest:
    if not isinstance(doc, dict):
        raise TrtbuildError(f"{where}: expected an object like {{\"prompt\": \"...\", \"output_tokens\": 64}}")
    unknown = set(doc) - {"prompt", "input_ids", "output_tokens"}
    if unknown:
        raise TrtbuildError(f"{where}: unknown keys {sorted(unknown)}; use prompt or input_ids, and output_tokens")
    out = doc.get("output_tokens")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise TrtbuildError(f"{where}: output_tokens must be an integer >= 1, got {out!r}")
    if ("prompt" in doc) == ("input_ids" in doc):
        raise TrtbuildError(f"{where}: give exactly one of prompt (text) and input_ids (token ids)")
    prompt = doc.get("prompt", doc.get("input_ids"))
    text_ok = isinstance(prompt, str) and prompt != ""
    ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not (text_ok if "prompt" in doc else ids_ok):
        raise TrtbuildError(f"{where}: prompt must be non-empty text, input_ids a non-empty list of token ids >= 0")
    return BenchRequest(prompt, out, where)


def synthetic_requests(num: int, input_len: int, output_len: int, vocab_size: int, avoid: Sequence[int],
                       seed: int = 0) -> list[BenchRequest]:
    """`num` prompts of exactly `input_len` random token ids from [0, vocab_size), none of them in `avoid`."""
    banned = set(avoid)
    allowed = [t for t in range(vocab_size) if t not in banned]
    rng = random.Random(seed)
    return [BenchRequest(rng.choices(allowed, k=input_len), output_len, f"synthetic request {i}") for i in range(num)]


# ---- running a load -------------------------------------------------------------------------------------------------
class Target(Protocol):
    """What a run sends requests to (implementations: targets.EngineTarget and ServerTarget)."""

    name: str
    vocab_size: int
    special_ids: frozenset[int]
    sizes: dict[str, float | None]  # engine_file_bytes, kv_bytes_per_token, load_s (None for a server)

    def prepare(self, requests: list[BenchRequest]) -> list[BenchRequest]: ...  # tokenize, check limits
    def send(self, request: BenchRequest, timeout: float) -> RequestResult: ...  # thread-safe, never raises
    def begin(self) -> None: ...  # before a run
    def end(self) -> tuple[list[float], dict[str, Any] | None]: ...  # KV usage samples, engine step breakdown
    def close(self) -> None: ...


class KVSampler:
    """Samples a server's KV-cache usage on a thread during a run: `read()` returns it, or None when the server
    cannot tell (sampling stops); exceptions in `errors` skip one sample."""

    def __init__(self, read: Callable[[], float | None], every_s: float,
                 errors: tuple[type[BaseException], ...] = ()) -> None:
        self.samples: list[float] = []
        self._done = threading.Event()

        def sample() -> None:
            while True:
                try:
                    value = read()
                    if value is None:
                        return
                    self.samples.append(value)
                except errors:
                    pass
                if self._done.wait(every_s):
                    return

        self._thread = threading.Thread(target=sample, name="bench-kv-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        self._done.set()
        self._thread.join()
        return self.samples


def run_load(target: Target, requests: list[BenchRequest], concurrency: int | None, request_rate: float,
             timeout: float, seed: int = 0) -> dict[str, Any]:
    """Send every request (at most `concurrency` in flight, Poisson arrivals at `request_rate` per second; inf: all at
    once) and summarize. Each request ends within `timeout` seconds of being sent, so the run ends by itself."""
    rng = random.Random(seed)
    target.begin()
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(concurrency or len(requests), len(requests))), "bench") as pool:
        futures = []
        for i, r in enumerate(requests):
            if i and math.isfinite(request_rate):
                time.sleep(rng.expovariate(request_rate))
            futures.append(pool.submit(target.send, r, timeout))
        results = [f.result() for f in futures]
    duration = time.perf_counter() - start
    kv, steps = target.end()
    return summarize(results, duration, kv, steps, sum(r.output_tokens for r in requests))


def _stats(values: list[float], scale: float = 1000.0) -> tuple[float, float, float]:
    if not values:
        return (math.nan,) * 3  # type: ignore[return-value]
    import numpy as np

    v = np.asarray(values) * scale
    return float(v.mean()), float(np.percentile(v, 50)), float(np.percentile(v, 99))


def summarize(results: list[RequestResult], duration: float, kv: list[float], steps: dict[str, Any] | None,
              expected_output_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None), "duration_s": duration,
        "total_input_tokens": inp, "total_output_tokens": out, "expected_output_tokens": expected_output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
    }
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("e2e", [r.latency for r in ok])):
        summary.update(zip((f"{name}_ms_mean", f"{name}_ms_p50", f"{name}_ms_p99"), _stats(values), strict=True))
    summary["kv_cache_usage_max"] = max(kv, default=0.0)
    summary["kv_cache_usage_mean"] = sum(kv) / len(kv) if kv else 0.0
    summary["preemptions"] = sum(r.preemptions for r in ok)
    summary["cached_prefix_tokens"] = sum(r.cached_tokens for r in ok)
    summary["engine_steps"] = steps
    return summary
