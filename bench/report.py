"""`trtbuild bench` output: the report as a table or as one strict JSON object."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from trtbuild.bench.run import SPEEDUPS

if TYPE_CHECKING:
    pass

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
    if r.get("lora") is not None:
        row("LoRA adapter", f"{r['lora']} (every request" + (", on both engines)" if r["engine"] else ")"))
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
        if s["decode_step_s"]:
            host = 1 - s["decode_engine_s"] / s["decode_step_s"]
            row("host share of decode steps", f"{host:.1%} outside the engine call (scheduling, sampling, KV writes, "
                                              f"outputs; mean batch {s['mean_decode_batch']:.1f})")
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
        row("compared engine", f"{other['target']} (threads {other['threads']}): {other['output_throughput']:.1f} "
                               f"output tok/s, TPOT p50 "
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
