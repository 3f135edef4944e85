"""Speculative decoding A/B: the same greedy requests without drafts, with prompt lookup (n-gram) drafts and with a
draft engine, at batch 1 (one request at a time) and N concurrent, in alternating rounds; prints medians and ratios.

    python benchmarks/speculative.py --engine engines/smollm2 --draft-engine engines/smollm2-8layers \\
        --speculative-tokens 4 --rounds 3 --threads 2

Workloads (--workload): `copy` asks the model to copy a paragraph (the docstrings of stdlib modules, as the prompt
lookup section of docs/performance.md), `story` asks for new text (short story openings), where prompt lookup
finds little to copy. Every configuration's tokens are compared with the first's (no drafts): greedy outputs should be
identical, except where the engine's own arithmetic differs between a 1-token and a k-token step (int4 weights
compute through per-row int8 activations whose kernels differ by batch shape): the table counts the requests whose
tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.speculative import SpeculativeConfig

MODULES = ["json", "csv", "argparse", "pathlib", "textwrap", "heapq", "bisect", "shutil", "zipfile", "logging",
           "random", "string", "shlex", "base64", "hashlib", "fnmatch"]
STORIES = ["Once upon a time, in a small village by the sea, there lived", "The robot opened its eyes and",
           "It was the coldest winter anyone could remember. The children", "Dear diary, today I learned that",
           "The old map showed a path through the forest to", "When the spaceship landed in the field, the farmer",
           "My grandmother always told me that the secret to happiness", "In the year 3000, cities float above",
           "The cat sat on the windowsill and watched", "Nobody believed Sam when he said that the lake",
           "The recipe for the perfect pancake starts with", "At the top of the mountain, the climbers found",
           "The library was closed, but the light on the third floor", "Every morning, the baker on Elm Street",
           "The detective looked at the muddy footprints and", "Once there was a little tree that wanted to"]


def prompts(workload: str, n: int) -> list[str]:
    if workload == "story":
        return STORIES[:n]
    out = []
    for m in MODULES[:n]:
        doc = " ".join((importlib.import_module(m).__doc__ or "").split())[:600]
        out.append(f"Text: {doc}\n\nThe same text, copied exactly:\nText: {doc[:40]}")
    return out


def run(core: EngineCore, texts: list[str], params: SamplingParams, concurrency: int) -> dict:
    """Requests kept `concurrency` in flight until all finish: wall seconds, output tokens, drafts, tokens."""
    pending = [core.make_request(t, params) for t in texts]
    order = {r.request_id: i for i, r in enumerate(pending)}
    tokens: list[list[int]] = [[] for _ in texts]
    drafted = accepted = in_flight = 0
    start = time.perf_counter()
    while pending or core.has_unfinished():
        while pending and in_flight < concurrency:
            core.add_request(pending.pop(0))
            in_flight += 1
        for out in core.step():
            tokens[order[out.request_id]] += out.new_token_ids
            if out.finished:
                in_flight -= 1
                drafted += out.metrics.num_draft_tokens
                accepted += out.metrics.num_accepted_draft_tokens
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, tokens=tokens, output=sum(map(len, tokens)), drafted=drafted, accepted=accepted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--draft-engine", type=Path, required=True)
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--workload", choices=["copy", "story"], default="story")
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--batch1-requests", type=int, default=4, help="requests run one at a time")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    k = args.speculative_tokens
    configs = {"off": None, "ngram": SpeculativeConfig(k),
               "draft": SpeculativeConfig(k, method="draft_model", draft_engine_dir=str(args.draft_engine))}
    cores = {name: EngineCore(args.engine, RuntimeConfig(num_threads=args.threads, speculative=spec))
             for name, spec in configs.items()}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    cases = {"batch 1": (prompts(args.workload, args.batch1_requests), 1),
             f"{args.concurrency} concurrent": (prompts(args.workload, args.concurrency), args.concurrency)}
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for case, (texts, concurrency) in cases.items():
            for name, core in cores.items():  # alternating: every round runs each configuration once
                got = run(core, texts, params, concurrency)
                off = results[(case, "off")][0]["tokens"] if name != "off" else got["tokens"]
                got["same"] = sum(a == b for a, b in zip(got["tokens"], off, strict=True))
                results.setdefault((case, name), []).append(got)
                print(f"round {r + 1} {case:>14} {name:>5}: {got['output'] / got['seconds']:7.1f} tok/s", flush=True)
    print(f"\n| {args.workload} | configuration | output tok/s (median of {args.rounds}) | vs off | drafts accepted "
          "| same tokens as off |")
    print("|---|---|---|---|---|---|")
    for case, (texts, _) in cases.items():
        for name in configs:
            runs = results[(case, name)]
            rate = statistics.median(g["output"] / g["seconds"] for g in runs)
            ratio = statistics.median(g["output"] / g["seconds"] / (o["output"] / o["seconds"])
                                      for g, o in zip(runs, results[(case, "off")], strict=True))
            d, a = runs[0]["drafted"], runs[0]["accepted"]
            acc = f"{a} of {d} ({a / d:.0%})" if d else "-"
            print(f"| {case} | {name} | {rate:.1f} | {ratio:.2f}x | {acc} | {runs[0]['same']} of {len(texts)} |")
    draft = cores["draft"].proposer
    print(f"\ndraft engine steps: {draft.num_steps}; tokens from its prefix cache: {draft.num_prefix_cached_tokens}")


if __name__ == "__main__":
    main()
