"""Prometheus metrics of the engine loop, named as vLLM names them so that its dashboards work unchanged.

Gauges are read from the engine when scraped; counters and histograms are fed by every finished request, whichever
front end it came from (AsyncEngine.on_finished). Each server has its own registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trtbuild.runtime.async_engine import AsyncEngine
from trtbuild.runtime.engine_core import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        label = {"model_name": model_name}
        core = engine.core

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, list(label), registry=registry).labels(**label).set_function(read)

        gauge("vllm:num_requests_running", "Requests in the running batch.", lambda: len(core.scheduler.running))
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda: len(core.scheduler.waiting))
        gauge("vllm:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (1 = full).",
              lambda: core.kv.pool.usage)
        gauge("vllm:gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (older vLLM name; a CPU pool here).",
              lambda: core.kv.pool.usage)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*label, *labels], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(label), buckets=buckets, registry=registry).labels(**label)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.").labels(**label)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(**label)
        self.success = counter("vllm:request_success", "Finished requests by reason.", ("finished_reason",))
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (recomputed requests).").labels(**label)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.") \
            .labels(**label)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(**label)
        self.drafts = counter("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified.") \
            .labels(**label)
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**label)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              _TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY_BUCKETS)
        self.label = label
        engine.on_finished.append(self.observe)
        if core.lora.max_loras:  # adapters built in, or slots for them
            registry.register(_LoraRequests(engine, model_name))

    def observe(self, output: RequestOutput) -> None:
        """One finished request (on the engine loop's thread)."""
        self.prompt_tokens.inc(output.num_prompt_tokens)
        self.generation_tokens.inc(output.num_output_tokens)
        self.success.labels(**self.label, finished_reason=output.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        self.preemptions.inc(m.num_preemptions)
        self.prefix_queries.inc(output.num_prompt_tokens)
        self.prefix_hits.inc(m.num_prefix_cached_tokens)
        self.drafts.inc(m.num_draft_tokens)
        self.accepted.inc(m.num_accepted_draft_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None and output.num_output_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (output.num_output_tokens - 1))


class _LoraRequests(Collector):
    """vLLM's vllm:lora_requests_info: the adapters of the running and of the waiting requests (comma-separated
    labels, read when scraped) and how many the engine has; its value is the time of the scrape."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.core, self.model_name = engine.core, model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lora = self.core.lora

        def adapters(requests: list) -> str:  # NOTE: list() of the engine loop's containers is atomic under the GIL
            return ",".join(sorted({lora.name_of(r.lora_id) or "" for r in requests if r.lora_id}))

        gauge = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                  labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        gauge.add_metric([self.model_name, adapters(list(self.core.scheduler.running)),
                          adapters(list(self.core.scheduler.waiting)), str(lora.max_loras)], time.time())
        yield gauge
