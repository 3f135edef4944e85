"""`trtbuild bench`: offered load against an in-process engine or a running server, with latency / throughput stats.

Every request asks for exactly its output length (ignore_eos, max_tokens = output_tokens), so token counts are exact.
Load is a concurrency cap and/or Poisson arrivals; every request has a deadline, so a run always ends by itself.
Baselines (one-at-a-time, another engine such as the fp32 build of a quantized one, HF generate) run in the same
process on the same requests, one system at a time, and are reported as ratios.
`lora` runs every request, the compared engine's too, under one LoRA adapter of the engine (the report names it).
"""

from __future__ import annotations

import math
import resource
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtbuild.bench.openai_target import OpenAITarget
from trtbuild.bench.targets import EngineTarget, ServerTarget, check_adapter, hf_generate
from trtbuild.bench.workload import (
    WARMUP_TOKENS,
    BenchRequest,
    Target,
    load_dataset,
    run_load,
    synthetic_requests,
)
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.errors import TrtbuildError

if TYPE_CHECKING:
    from trtbuild.runtime.speculative import SpeculativeConfig

# ---- the whole benchmark --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchOptions:
    engine: Path | None = None
    address: str | None = None
    backend: str = "grpc"  # of --address: "grpc" (`trtbuild serve`) or "openai" (any OpenAI-compatible server)
    api_key: str | None = None  # of --address, if the server has one
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
    kv_cache_blocks: int | None = None  # in-process engines' KV pool [None: the runtime's default]
    lora: str | None = None  # every request (and --compare-engine's) runs under this LoRA adapter [None: the base]
    lora_path: str | None = None  # loaded first as `lora` into a slot of each in-process engine (--max-loras)


SPEEDUPS = ("speedup_vs_sequential", "speedup_vs_engine", "speedup_vs_hf")


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the benchmark (and the asked-for baselines, never at the same time as the engine); returns the report."""
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
    if opts.lora_path is not None and opts.engine is None:
        raise TrtbuildError("a server loads its LoRA adapters itself (`trtbuild serve --lora-modules NAME=PATH`, "
                            "POST /v1/load_lora_adapter): pass --lora NAME")
    if opts.lora is not None and opts.lora_path is None and opts.compare_engine is not None:  # before the first run
        check_adapter(opts.lora, read_engine_config(opts.compare_engine).build.lora_names,
                      f"--compare-engine {opts.compare_engine} (run under the same adapter)")
    if opts.lora is not None and opts.compare_hf is not None:
        raise TrtbuildError(f"--compare-hf runs the HF base model, without the LoRA adapter {opts.lora!r}: its "
                            "speedup would compare different models. Drop --lora or --compare-hf.")
    if opts.kv_cache_blocks is not None and opts.engine is None:
        raise TrtbuildError("--kv-cache-blocks sizes an in-process engine's pool; a server's is set where it starts "
                            "(`trtbuild serve --kv-cache-blocks N`)")
    # NOTE: engines get --threads as given: None lets each use its own default (the autotuned count, if any);
    # the HF baseline gets the same number of threads as the engine would by default
    threads = opts.threads
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


def _one_round(opts: BenchOptions, dataset: list[BenchRequest] | None, threads: int | None,
               log: Callable[[str], None]) -> dict[str, Any]:
    """The engine, then each asked-for baseline, one at a time."""
    log(f"loading {opts.engine or opts.address} ...")
    target: Target = (EngineTarget(opts.engine, threads, opts.speculative, opts.kv_cache_blocks, opts.lora,
                                   opts.lora_path)
                      if opts.engine is not None
                      else OpenAITarget(opts.address, opts.api_key, lora=opts.lora) if opts.backend == "openai"
                      else ServerTarget(opts.address, api_key=opts.api_key, lora=opts.lora))
    report: dict[str, Any] = {"target": target.name, "lora": opts.lora, "threads": getattr(target, "threads", None),
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
        other = EngineTarget(opts.compare_engine, threads, opts.speculative, opts.kv_cache_blocks, opts.lora,
                             opts.lora_path)
        try:
            if other.vocab_size != target.vocab_size:
                raise TrtbuildError(f"--compare-engine {opts.compare_engine} has a vocabulary of {other.vocab_size} "
                                    f"tokens, not {target.vocab_size}: compare engines of the same model.")
            report["engine"] = {"target": other.name, "threads": other.threads,
                                **_measure(other, other.prepare(requests), opts), **other.sizes}
        finally:
            other.close()
        report["speedup_vs_engine"] = report["output_throughput"] / report["engine"]["output_throughput"]
    report["hf"] = report["speedup_vs_hf"] = None
    if opts.compare_hf is not None:
        from trtbuild.runtime.engine import default_threads

        log(f"running HF transformers generate() on {opts.compare_hf} ...")
        hf = hf_generate(opts.compare_hf, [r.prompt for r in requests], max(r.output_tokens for r in requests),
                         threads or default_threads())
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
