"""`trtbuild bench`: offered load against an in-process engine or a running server, with latency / throughput stats.

Every request asks for exactly its output length (ignore_eos, max_tokens = output_tokens), so token counts are exact.
Load is a concurrency cap and/or Poisson arrivals; every request has a deadline, so a run always ends by itself.
Baselines (one-at-a-time, another engine such as the fp32 build of a quantized one, HF generate) run in the same
process on the same requests, one system at a time, and are reported as ratios.
"""

from __future__ import annotations

import json
import math
import random
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trtbuild.errors import TrtbuildError

if TYPE_CHECKING:
    from trtbuild.runtime.speculative import SpeculativeConfig

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
    """What a run sends requests to (implementations: bench_baselines.EngineTarget and ServerTarget)."""

    name: str
    vocab_size: int
    special_ids: frozenset[int]
    sizes: dict[str, float | None]  # engine_file_bytes, kv_bytes_per_token, load_s (None for a server)

    def prepare(self, requests: list[BenchRequest]) -> list[BenchRequest]: ...  # tokenize, check limits
    def send(self, request: BenchRequest, timeout: float) -> RequestResult: ...  # thread-safe, never raises
    def begin(self) -> None: ...  # before a run
    def end(self) -> tuple[list[float], dict[str, Any] | None]: ...  # KV usage samples, engine step breakdown
    def close(self) -> None: ...


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


# ---- the whole benchmark --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchOptions:
    engine: Path | None = None
    address: str | None = None
    dataset: Path | None = None
    num_requests: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    seed: int = 0
    concurrency: int | None = None
    request_rate: float = math.inf
    timeout: float = 600.0
    threads: int | None = None
    compare_sequential: bool = False
    compare_hf: Path | None = None
    compare_engine: Path | None = None
    speculative: SpeculativeConfig | None = None  # in-process engine only
    rounds: int = 1  # the engine and its comparisons, alternated; speedups are the medians of the rounds' ratios


SPEEDUPS = ("speedup_vs_sequential", "speedup_vs_engine", "speedup_vs_hf")


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the benchmark (and the asked-for baselines, never at the same time as the engine); returns the report."""
    from trtbuild.runtime.engine import default_threads

    if (opts.engine is None) == (opts.address is None):
        raise TrtbuildError("give exactly one target: --engine DIR (in-process) or --address HOST:PORT (a server)")
    synthetic = (opts.input_len, opts.output_len)
    if opts.dataset is not None and any(x is not None for x in synthetic):
        raise TrtbuildError("--input-len / --output-len make a synthetic dataset; do not combine them with --dataset")
    if opts.dataset is None and (opts.num_requests is None or None in synthetic):
        raise TrtbuildError("give --dataset FILE, or --num-requests, --input-len and --output-len")
    dataset = load_dataset(opts.dataset, opts.num_requests) if opts.dataset is not None else None
    if opts.rounds < 1:
        raise TrtbuildError(f"--rounds must be at least 1, got {opts.rounds}")
    if opts.speculative is not None and opts.engine is None:
        raise TrtbuildError("speculative decoding is a server option: start `trtbuild serve --speculative-tokens N`")
    if opts.compare_engine is not None and opts.engine is None:
        raise TrtbuildError("--compare-engine compares two in-process engines: give --engine DIR too")
    threads = opts.threads or default_threads()
    # NOTE: this VM's speed drifts by 10-30% over seconds, so one pass of each is a coin toss near a target ratio;
    # alternating them in rounds and taking the median ratio samples both under the same conditions.
    reports = []
    for i in range(opts.rounds):
        if opts.rounds > 1:
            log(f"round {i + 1} of {opts.rounds}")
        reports.append(_one_round(opts, dataset, threads, log))
    report = reports[0]
    # NOTE: the process's peak, over every engine and baseline it loaded: run one engine alone to read its own
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if opts.rounds > 1:
        report["rounds"] = [{k: r[k] for k in ("output_throughput", *SPEEDUPS)} for r in reports]
        for key in SPEEDUPS:
            if report[key] is not None:
                report[key] = statistics.median(r[key] for r in reports)
    return report


def _one_round(opts: BenchOptions, dataset: list[BenchRequest] | None, threads: int,
               log: Callable[[str], None]) -> dict[str, Any]:
    """The engine, then each asked-for baseline, one at a time."""
    from trtbuild.runtime.bench_baselines import EngineTarget, ServerTarget

    log(f"loading {opts.engine or opts.address} ...")
    target: Target = (EngineTarget(opts.engine, threads, opts.speculative) if opts.engine is not None
                      else ServerTarget(opts.address))
    report: dict[str, Any] = {"target": target.name, "threads": threads if opts.engine is not None else None,
                              "concurrency": opts.concurrency, "request_rate": opts.request_rate}
    try:
        if dataset is None:
            dataset = synthetic_requests(opts.num_requests, opts.input_len, opts.output_len, target.vocab_size,
                                         sorted(target.special_ids), opts.seed)
        requests = target.prepare(dataset)
        log(f"running {len(requests)} requests ...")
        report.update(_measure(target, requests, opts), **target.sizes)
        report["sequential"] = report["speedup_vs_sequential"] = None
        if opts.compare_sequential:
            log("running the same requests one at a time ...")
            seq = run_load(target, requests, 1, math.inf, opts.timeout, opts.seed)
            report["sequential"] = seq
            report["speedup_vs_sequential"] = report["output_throughput"] / seq["output_throughput"]
    finally:
        target.close()
    report["engine"] = report["speedup_vs_engine"] = None
    if opts.compare_engine is not None:
        log(f"running the same requests on {opts.compare_engine} ...")
        other = EngineTarget(opts.compare_engine, threads, opts.speculative)
        try:
            if other.vocab_size != target.vocab_size:
                raise TrtbuildError(f"--compare-engine {opts.compare_engine} has a vocabulary of {other.vocab_size} "
                                    f"tokens, not {target.vocab_size}: compare engines of the same model.")
            report["engine"] = {"target": other.name, **_measure(other, other.prepare(requests), opts), **other.sizes}
        finally:
            other.close()
        report["speedup_vs_engine"] = report["output_throughput"] / report["engine"]["output_throughput"]
    report["hf"] = report["speedup_vs_hf"] = None
    if opts.compare_hf is not None:
        from trtbuild.runtime.bench_baselines import hf_generate

        log(f"running HF transformers generate() on {opts.compare_hf} ...")
        hf = hf_generate(opts.compare_hf, [r.prompt for r in requests], max(r.output_tokens for r in requests),
                         threads)
        report["hf"] = {k: v for k, v in hf.items() if k != "token_ids"}
        report["speedup_vs_hf"] = report["output_throughput"] / hf["output_throughput"]
    return report


def _measure(target: Target, requests: list[BenchRequest], opts: BenchOptions) -> dict[str, Any]:
    """A warm-up request, then every request under the options' load; refuses a run where all of them failed."""
    token = min(set(range(target.vocab_size)) - target.special_ids)  # a prompt no request starts with
    warmup = target.send(BenchRequest([token] * 8, WARMUP_TOKENS, "warm-up"), opts.timeout)
    if not warmup.ok:
        raise TrtbuildError(f"the warm-up request to {target.name} failed: {warmup.error}")
    result = run_load(target, requests, opts.concurrency, opts.request_rate, opts.timeout, opts.seed)
    if result["completed"] == 0:
        raise TrtbuildError(f"every request to {target.name} failed; the first: {result['first_error']}")
    return result


# ---- output ---------------------------------------------------------------------------------------------------------
def to_json(report: dict[str, Any]) -> str:
    """One strict JSON object: an infinite request rate is "inf", missing statistics are null."""

    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, float) and not math.isfinite(x):
            return "inf" if x == math.inf else None
        return x

    return json.dumps(clean(report))


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{'=' * 24} trtbuild bench {'=' * 24}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label + ':':<30}{value}")

    def stats(name: str) -> str:
        return "  ".join(f"{k} {r[f'{name}_ms_{k}']:.1f}" for k in ("mean", "p50", "p99"))

    row("target", r["target"] + (f" (threads {r['threads']})" if r["threads"] else ""))
    row("load", f"concurrency {r['concurrency'] or 'unlimited'}, request rate {r['request_rate']:g}/s")
    failed = f" (first error: {r['first_error']})" if r["failed"] else ""
    row("requests", f"{r['completed']} completed, {r['failed']} failed{failed}")
    row("duration", f"{r['duration_s']:.2f} s")
    row("input / output tokens", f"{r['total_input_tokens']} / {r['total_output_tokens']} "
                                 f"(output asked: {r['expected_output_tokens']})")
    row("request throughput", f"{r['request_throughput']:.2f} req/s")
    row("output token throughput", f"{r['output_throughput']:.1f} tok/s")
    row("total token throughput", f"{r['total_token_throughput']:.1f} tok/s")
    row("TTFT (ms)", stats("ttft"))
    row("TPOT (ms)", stats("tpot"))
    row("end-to-end latency (ms)", stats("e2e"))
    row("KV cache usage", f"max {r['kv_cache_usage_max']:.1%}  mean {r['kv_cache_usage_mean']:.1%}")
    if r["engine_file_bytes"] is not None:
        row("engine file / KV per token", _sizes(r))
        row("engine start", f"session {r['load_s']:.2f} s, KV pool ({r['kv_pool_bytes'] / 2**30:.2f} GiB) + warm-up "
                            f"step {r['warm_up_s']:.2f} s")
    if r.get("peak_rss_bytes") is not None:
        row("peak RSS (this process)", f"{r['peak_rss_bytes'] / 2**30:.2f} GiB")
    row("preemptions", str(r["preemptions"]))
    row("cached prefix tokens", str(r["cached_prefix_tokens"]))
    if (s := r["engine_steps"]) is not None:
        rest = r["duration_s"] - s["prefill_step_s"] - s["decode_step_s"]
        row("engine steps", f"with prefill {s['prefill_step_s']:.2f} s ({s['prefill_steps']} steps), decode-only "
                            f"{s['decode_step_s']:.2f} s ({s['decode_steps']} steps, mean batch "
                            f"{s['mean_decode_batch']:.1f}), outside steps {rest:.2f} s")
        if s["draft_tokens"]:
            row("speculative drafts", f"{s['accepted_draft_tokens']} of {s['draft_tokens']} accepted "
                                      f"({s['accepted_draft_tokens'] / s['draft_tokens']:.1%})")
    if (seq := r["sequential"]) is not None:
        row("one-at-a-time", f"{seq['output_throughput']:.1f} output tok/s, {seq['duration_s']:.2f} s, "
                             f"TTFT p50 {seq['ttft_ms_p50']:.1f} ms, TPOT p50 {seq['tpot_ms_p50']:.1f} ms"
                             + (f", {seq['cached_prefix_tokens']} cached prefix tokens"
                                if seq["cached_prefix_tokens"] else ""))
        lines.append(f"speedup vs one-at-a-time: {r['speedup_vs_sequential']:.2f}x")
    if (other := r["engine"]) is not None:
        row("compared engine", f"{other['target']}: {other['output_throughput']:.1f} output tok/s, TPOT p50 "
                               f"{other['tpot_ms_p50']:.1f} ms, {_sizes(other)}")
        lines.append(f"vs compared engine: {r['speedup_vs_engine']:.2f}x output tok/s, "
                     f"{other['tpot_ms_p50'] / r['tpot_ms_p50']:.2f}x TPOT p50 speed, "
                     f"{r['engine_file_bytes'] / other['engine_file_bytes']:.2f}x engine file, "
                     f"{r['kv_bytes_per_token'] / other['kv_bytes_per_token']:.2f}x KV bytes per token")
    if (hf := r["hf"]) is not None:
        row("HF generate (batched)", f"{hf['output_throughput']:.1f} output tok/s, {hf['duration_s']:.2f} s, "
                                     f"batch {hf['batch_size']}, {hf['threads']} torch threads")
        lines.append(f"speedup vs HF generate (batched): {r['speedup_vs_hf']:.2f}x")
    if rounds := r.get("rounds"):
        lines.append(f"{len(rounds)} rounds (the numbers above are round 1's; the speedups are the medians):")
        for key in SPEEDUPS:
            if r[key] is not None:
                lines.append(f"  {key.replace('_', ' ')}: " + " ".join(f"{x[key]:.2f}" for x in rounds)
                             + f" (median {r[key]:.2f}x)")
    return "\n".join(lines)


def _sizes(r: dict[str, Any]) -> str:
    return f"{r['engine_file_bytes'] / 1e6:.1f} MB / {r['kv_bytes_per_token']} bytes"
