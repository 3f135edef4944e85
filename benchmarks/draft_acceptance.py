"""What verifying speculative drafts costs and gains at a chosen acceptance, apart from how good any draft model is:
batch-1 greedy requests without drafts, then with scripted drafts cut from those answers: of each step's K drafts the
first `right` are the answer's next tokens and the one after is wrong (right = K: every draft accepted, the most a
draft can give; right = 0: none, what a useless draft costs). On a model with recurrent layers each verifying step
also keeps the state from before its drafts, and each rejection copies it back and computes the accepted drafts again
in the next step (runtime/recurrent_state.py): compare its ratios with an attention-only engine's.

    python benchmarks/draft_acceptance.py --engine engines/qwen35 --engine engines/qwen25 --rounds 3 --threads 2

Configurations alternate within each round; the table has medians, tokens per second of the whole generation (prefill
included, the same in every configuration) and whether the tokens equal those without drafts. `--step-times` prints
instead the engine's step time for one sequence of 1, 5 and 7 new tokens after a 128-token prompt (logits for up to 5
of them, as a verifying step), with and without a state checkpoint after its first token, and what restoring a
checkpoint costs: the parts of a verifying step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.speculative import Proposer, SpeculativeConfig


class ScriptedDrafts(Proposer):
    """The first `right` drafts of a step are the known answer's next tokens, the next one is wrong."""

    def __init__(self, answers: dict[str, list[int]], right: int, vocab_size: int) -> None:
        self.answers, self.right, self.vocab_size = answers, right, vocab_size

    def propose_batch(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        out = []
        for request, limit in zip(requests, max_tokens, strict=True):
            truth = self.answers[request.request_id][request.num_output_tokens:]
            wrong = [(truth[self.right] + 1) % self.vocab_size] if self.right < len(truth) else []
            out.append((truth[:self.right] + wrong)[:limit])
        return out


def generate(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[float, dict, int, int]:
    """The requests one at a time: seconds, answers by request id, drafts accepted and drafted."""
    answers, accepted, drafted = {}, 0, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        request = core.make_request(prompt, params, request_id=f"r{i}")
        core.add_request(request)
        answers[request.request_id] = []
        while core.has_unfinished():
            for out in core.step():
                answers[out.request_id] += out.new_token_ids
        accepted += request.metrics.num_accepted_draft_tokens
        drafted += request.metrics.num_draft_tokens
    return time.perf_counter() - start, answers, accepted, drafted


def step_times(engine: Path, threads: int, repeats: int = 15) -> None:
    """Median engine step times (`--step-times`, see the module docstring)."""
    from trtbuild.runtime.engine import SequenceChunk, in_every_group
    from trtbuild.runtime.recurrent_state import DRAFT_CHECKPOINT, StateCopy

    core = EngineCore(engine, RuntimeConfig(num_threads=threads, speculative=SpeculativeConfig(4)))
    e = core.engine
    groups, stride = len(e.kv.groups), e.kv.num_blocks // len(e.kv.groups)
    blocks = list(range(1, 160 // e.info.build.tokens_per_block + 2))
    ids = np.random.default_rng(0).integers(10, 1000, size=140).tolist()
    recurrent = getattr(e, "states", None) is not None

    def step(tokens: list[int], start: int, logits: int, keep: int = 0) -> float:
        chunk = SequenceChunk(0, tokens, start, logits, blocks, state_slot=0, state_checkpoint=keep)
        begin = time.perf_counter()
        e.step(in_every_group([chunk], groups, stride))
        return time.perf_counter() - begin

    step(ids[:128], 0, 1)
    for n in (1, 5, 7):
        plain = statistics.median(step(ids[128:128 + n], 128, min(n, 5)) for _ in range(repeats))
        line = f"{n} tokens: {plain * 1e3:.1f} ms"
        if recurrent:
            kept = statistics.median(step(ids[128:128 + n], 128, min(n, 5), keep=1) for _ in range(repeats))
            line += f", keeping a state checkpoint {kept * 1e3:.1f} ms"
        print(line)
    if recurrent:
        copies = []
        for _ in range(repeats):
            begin = time.perf_counter()
            e.copy_states([StateCopy(0, DRAFT_CHECKPOINT, save=False)])
            copies.append(time.perf_counter() - begin)
        print(f"restoring a checkpoint ({e.states.states[0].nbytes / 2**20:.0f} MiB): "
              f"{statistics.median(copies) * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, action="append", required=True, help="an engine dir (repeatable)")
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-times", action="store_true", help="print step times instead (see above)")
    args = ap.parse_args()
    if args.step_times:
        for engine in args.engine:
            print(engine.name)
            step_times(engine, args.threads)
        return
    k = args.speculative_tokens
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for engine in args.engine:
        plain = EngineCore(engine, RuntimeConfig(num_threads=args.threads))
        drafted = EngineCore(engine, RuntimeConfig(num_threads=args.threads, speculative=SpeculativeConfig(k)))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(10, plain.vocab_size - 10, size=args.prompt_len).tolist() for _ in range(args.requests)]
        _, answers, _, _ = generate(plain, prompts, params)  # NOTE: also the warm-up
        rights = (k, k // 2, 0)
        times: dict[str, list[float]] = {"off": [], **{f"{r} of {k}": [] for r in rights}}
        counts, same = {}, {}
        for r in range(args.rounds):
            seconds, _, _, _ = generate(plain, prompts, params)
            times["off"].append(seconds)
            for right in rights:
                drafted.proposer = ScriptedDrafts(answers, right, drafted.vocab_size)
                seconds, got, acc, total = generate(drafted, prompts, params)
                name = f"{right} of {k}"
                times[name].append(seconds)
                counts[name], same[name] = (acc, total), got == answers
            print(f"round {r + 1} {engine.name}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()),
                  flush=True)
        tokens = args.requests * args.output_len
        for name, runs in times.items():
            ratio = statistics.median(o / t for o, t in zip(times["off"], runs, strict=True))
            acc, total = counts.get(name, (0, 0))
            rows.append(f"| {engine.name} | {name if name == 'off' else name + ' right'} | "
                        f"{acc} of {total} | {tokens / statistics.median(runs):.1f} | {ratio:.2f}x | "
                        f"{'-' if name == 'off' else 'yes' if same[name] else 'NO'} |")
    print(f"\n| engine | drafts a step (K = {k}) | drafts accepted | output tok/s (median of {args.rounds}) | "
          "vs off | same tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
