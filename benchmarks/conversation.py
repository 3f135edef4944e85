"""A multi-turn conversation on trtbuild and on llama.cpp's server, on the same GGUF file, in one run: how long each
turn waits for its first token when its prompt repeats the whole conversation so far.

    python benchmarks/conversation.py --gguf model.gguf [--llama-bin DIR] [--threads 2] [--rounds 3] [--turns 6]
        [--user 128] [--answer 64] [--system 0] [--work DIR] [--json out.json]

Turn t's prompt is turn t-1's prompt, its answer (greedy, `--answer` tokens, end-of-text ignored) and `--user` new
token ids, as a chat client resends its history. What a turn can reuse from the last one is what this measures: for a
model with recurrent layers (Qwen3.5, Granite 4.0-H, Nemotron-H) trtbuild restores the state kept after the last full
block of the last turn (runtime/recurrent_state.py), llama-server continues its slot's sequence. Systems, each in its
own process, one after another, alternated over rounds (this VM's speed drifts):
- trtbuild: EngineCore in process, one sequence at a time (prefix caching and state snapshots on, the defaults);
- trtbuild without snapshots (`--max-state-snapshots 0`): every turn computes its whole prompt, the baseline;
- llama.cpp: `llama-server -np 1` (the conversation keeps its slot), streaming /completion with token-id prompts.
With `--system N`, the turns are instead requests of one N-token system prompt and their own `--user` tokens, one
after another (an assistant's users, or an agent's calls): what they can reuse is the system prompt. Reported: each
turn's time to first token (medians over rounds), the conversation's total time, the prompt tokens
each turn took from its cache, and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from embeddings import free_port  # noqa: E402
from peers import run_timed, wait_healthy  # noqa: E402


def user_tokens(turn: int, n: int, vocab: int) -> list[int]:
    """New user tokens: ordinary ids (1000-30000 of a large vocabulary, the upper three quarters of a small one)."""
    lo, hi = min(1000, vocab // 4), min(30000, vocab)
    return [lo + (7919 * (turn * n + i)) % (hi - lo) for i in range(n)]


def context_tokens(args: argparse.Namespace) -> int:
    return (args.system + args.user + args.answer if args.system else args.turns * (args.user + args.answer)) + 16


def build_engine(gguf: Path, work: Path, args: argparse.Namespace) -> Path:
    engine = work / "engine"
    if not (engine / "config.json").is_file():
        ckpt = work / "ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        run_timed(["trtbuild", "convert", "--model", str(gguf), "--output", str(ckpt)])
        run_timed(["trtbuild", "build", "--checkpoint", str(ckpt), "--output", str(engine), "--max-batch-size", "1",
                   "--max-seq-len", str(context_tokens(args)), "--max-num-tokens", str(args.ubatch)])
        shutil.rmtree(ckpt)
        os.sync()
    return engine


def measure_trtbuild(engine: Path, snapshots: int | None, args: argparse.Namespace) -> list[dict[str, float]]:
    """In this process (`--measure-trtbuild ENGINE --snapshots N`): the conversation through EngineCore."""
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.configs import batch_blocks_needed
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams

    info = read_engine_config(engine)
    # NOTE: a pool of two conversations: the last turn's blocks stay cached while the next turn takes new ones
    blocks = 2 * batch_blocks_needed([g.window for g in info.kv_cache_groups], info.build.tokens_per_block, 1,
                                     context_tokens(args), info.build.max_num_tokens)
    core = EngineCore(engine, RuntimeConfig(num_threads=args.threads, max_batch_size=1, max_state_snapshots=snapshots,
                                            kv_cache_blocks=blocks))
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)

    def turn(prompt: list[int]) -> tuple[list[int], dict[str, float]]:
        request = core.make_request(prompt, params)
        start, first, answer = time.perf_counter(), None, []
        core.add_request(request)
        while core.has_unfinished():
            for out in core.step():
                answer += out.new_token_ids
                first = first or time.perf_counter()
        return answer, {"ttft_s": first - start, "total_s": time.perf_counter() - start,
                        "cached": request.metrics.num_prefix_cached_tokens}

    turn(user_tokens(99, 8, args.vocab))  # NOTE: untimed, as llama.cpp's warm-up: threads and weights ready
    return workload(turn, args)


def workload(turn, args: argparse.Namespace) -> list[dict[str, float]]:
    """The turns, each through `turn(prompt) -> (answer, stats)`: a conversation, or requests of one system prompt."""
    system = user_tokens(1000, args.system, args.vocab)
    prompt, turns = (system if args.system else []) + user_tokens(0, args.user, args.vocab), []
    for t in range(args.turns):
        answer, stats = turn(prompt)
        turns.append({**stats, "prompt": len(prompt)})
        following = user_tokens(t + 1, args.user, args.vocab)
        prompt = system + following if args.system else prompt + answer + following
    return turns


def llama_server(gguf: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    port = free_port()
    proc = subprocess.Popen([str(args.llama_bin / "llama-server"), "-m", str(gguf), "-np", "1", "-c",
                             str(context_tokens(args)), "-ub", str(args.ubatch), "-t", str(args.threads), "--port",
                             str(port), "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)

        def turn(prompt: list[int]) -> tuple[list[int], dict[str, float]]:
            body = {"prompt": prompt, "n_predict": args.answer, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": True, "return_tokens": True, "stream": True}
            request = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            start, first, answer, processed = time.perf_counter(), None, [], 0
            with urllib.request.urlopen(request, timeout=3600) as response:
                for line in response:
                    if not line.startswith(b"data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("tokens"):
                        answer += event["tokens"]
                        first = first or time.perf_counter()
                    processed = event.get("timings", {}).get("prompt_n", processed)
            return answer, {"ttft_s": first - start, "total_s": time.perf_counter() - start,
                            "cached": len(prompt) - processed}

        turn(user_tokens(99, 8, args.vocab))
        return workload(turn, args)
    finally:
        proc.terminate()
        proc.wait()


def trtbuild_run(engine: Path, snapshots: int | None, args: argparse.Namespace) -> list[dict[str, float]]:
    out, _ = run_timed([sys.executable, __file__, "--measure-trtbuild", str(engine), "--threads", str(args.threads),
                        "--turns", str(args.turns), "--user", str(args.user), "--answer", str(args.answer),
                        "--vocab", str(args.vocab), "--system", str(args.system),
                        *(["--snapshots", str(snapshots)] if snapshots is not None else [])])
    return json.loads(out.splitlines()[-1])


def report(rounds: dict[str, list[list[dict[str, float]]]], args: argparse.Namespace) -> dict:
    """Per system: each turn's median TTFT, its cached prompt tokens (first round), the median conversation time."""
    table = {}
    for name, runs in rounds.items():
        table[name] = {
            "ttft_s": [statistics.median(r[t]["ttft_s"] for r in runs) for t in range(args.turns)],
            "cached": [runs[0][t]["cached"] for t in range(args.turns)],
            "prompt": [runs[0][t]["prompt"] for t in range(args.turns)],
            "conversation_s": statistics.median(sum(t["total_s"] for t in r) for r in runs)}
    names = list(table)
    print("turn | prompt | " + " | ".join(f"{n} TTFT s (cached)" for n in names))
    for t in range(args.turns):
        cells = [f"{table[n]['ttft_s'][t]:.2f} ({table[n]['cached'][t]})" for n in names]
        print(f"{t + 1} | {table[names[0]]['prompt'][t]} | " + " | ".join(cells))
    print("conversation s: " + ", ".join(f"{n} {table[n]['conversation_s']:.1f}" for n in names))
    ours = table["trtbuild"]
    for other in names[1:]:
        later = lambda n: sum(table[n]["ttft_s"][1:])  # noqa: E731
        print(f"trtbuild vs {other}: turns 2..{args.turns} TTFT {later(other) / later('trtbuild'):.2f}x faster, "
              f"whole conversation {table[other]['conversation_s'] / ours['conversation_s']:.2f}x faster")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/trtbuild-peers/llama-build/bin")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user", type=int, default=128, help="New tokens of each turn's prompt.")
    p.add_argument("--answer", type=int, default=64, help="Tokens of each answer.")
    p.add_argument("--system", type=int, default=0,
                   help="Tokens of a system prompt every turn starts with instead of the conversation so far.")
    p.add_argument("--ubatch", type=int, default=512, help="Most tokens per step, both systems.")
    p.add_argument("--work", type=Path, default=None, help="Where the engine is built [a temporary folder].")
    p.add_argument("--json", type=Path, default=None, help="Also write every round and the medians here.")
    p.add_argument("--measure-trtbuild", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--snapshots", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_trtbuild:
        print(json.dumps(measure_trtbuild(args.measure_trtbuild, args.snapshots, args)))
        return
    if args.gguf is None or not args.gguf.is_file():
        sys.exit(f"--gguf: give an existing GGUF file (got {args.gguf})")
    engine = build_engine(args.gguf.resolve(), args.work or Path(tempfile.mkdtemp(prefix="trtbuild-conv-")), args)
    from trtbuild.builder.engine_dir import read_engine_config

    args.vocab = read_engine_config(engine).model.vocab_size
    systems = {"trtbuild": lambda: trtbuild_run(engine, None, args),
               "trtbuild, no snapshots": lambda: trtbuild_run(engine, 0, args)}
    if (args.llama_bin / "llama-server").is_file():
        systems["llama.cpp"] = lambda: llama_server(args.gguf, args)
    else:
        print(f"llama.cpp: missing (no llama-server in {args.llama_bin}; ../shared/tools/build-llama-cpp.sh)")
    rounds: dict[str, list] = {name: [] for name in systems}
    for n in range(args.rounds):
        for name in list(systems)[n % len(systems):] + list(systems)[:n % len(systems)]:
            rounds[name].append(systems[name]())
            print(f"round {n + 1}: {name} done", file=sys.stderr)
    table = report(rounds, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                         "medians": table}, indent=1))


if __name__ == "__main__":
    main()
