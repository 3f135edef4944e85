"""trtbuild against its CPU peers on the same GGUF file, in one run: llama.cpp (`llama-bench`,
`llama-batched-bench`) and ONNX Runtime GenAI (its model builder on the HF folder, when it is installed).

    python benchmarks/peers.py --gguf model.gguf [--hf-dir hf/] [--llama-bin ~/.cache/trtbuild-peers/llama-build/bin]
        [--threads 2] [--rounds 3] [--prompt 128] [--gen 128] [--parallel 16] [--ubatch 512] [--work /tmp/peers]
        [--depth 0] [--json out.json]

Measured, like llama-bench: prefill of one `--prompt`-token prompt (tok/s; its time is the TTFT), batch-1 decode of
`--gen` tokens (tok/s), and `--parallel` concurrent requests of `--prompt` + `--gen` tokens (output tok/s over the
whole run, prefill included), plus each system's peak RSS. With `--depth D`, batch-1 decode runs after a D-token
context (`llama-bench -d D`; trtbuild: a D-token prompt first), where attention reads D keys a token. trtbuild runs
the engine built from the GGUF as it is (its quantized tensors stay quantized, its build options the defaults), with
KV pools of the tokens llama.cpp's contexts hold. Every system runs in its own process, one after another; rounds
alternate the systems (this VM's speed drifts) and the table gives medians and trtbuild / peer ratios. A peer that
is not there is reported as missing. Both run steps of at most `--ubatch` tokens (llama.cpp's n_ubatch). `--smoke`
is a seconds-long run for CI (tiny lengths, one round).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = ("prefill_tok_s", "decode_tok_s", "parallel_output_tok_s", "ttft_ms", "peak_rss_mib")
LOWER_IS_BETTER = {"ttft_ms", "peak_rss_mib"}


class CommandFailed(RuntimeError):
    pass


def wait_healthy(base: str, proc: subprocess.Popen) -> None:
    """Wait until the HTTP server at `base` (llama-server, `trtbuild serve --http-port`) answers /health with 200."""
    import urllib.request

    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {proc.args}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server never became healthy: {proc.args}")


def run_timed(cmd: list[str], cwd: Path | None = None) -> tuple[str, int]:
    """(stdout, peak RSS in bytes) of a command run under /usr/bin/time; CommandFailed with its output if it fails."""
    out = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", *cmd], capture_output=True, text=True, cwd=cwd)
    if out.returncode:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        raise CommandFailed(f"{Path(cmd[0]).name} ... failed (exit {out.returncode}): {' / '.join(tail)}")
    rss = [line for line in out.stderr.splitlines() if line.startswith("PEAK_RSS_KB ")]
    return out.stdout, int(rss[-1].split()[1]) * 1024 if rss else 0


# ---- trtbuild -------------------------------------------------------------------------------------------------------
def build_trtbuild(gguf: Path, work: Path, args: argparse.Namespace) -> Path:
    engine = work / "engine"
    if (engine / "config.json").is_file():
        return engine
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    for cmd in (["convert", "--model", str(gguf), "--output", str(ckpt)],
                ["build", "--checkpoint", str(ckpt), "--output", str(engine), "--max-batch-size", str(args.parallel),
                 "--max-seq-len", str(max(256, single_context(args))),
                 "--max-num-tokens", str(step_tokens(args))]):
        run_timed(["trtbuild", *cmd])
    shutil.rmtree(ckpt)
    # NOTE: write the build's gigabytes back now, not during the first measured round: that round was the slowest
    # of every 1.5B F16 run (decode 6.9 and 7.6 tok/s against 9.6-13.5 in later rounds)
    os.sync()
    return engine


def measure_trtbuild(engine: Path, part: str, args: argparse.Namespace) -> dict[str, float]:
    """In this process (run by `--measure-trtbuild ENGINE --part single|parallel`), through EngineCore: `single`,
    prefill and batch-1 decode of one sequence (as llama-bench); `parallel`, the concurrent requests (as
    llama-batched-bench)."""
    from trtbuild.bench.run import BenchOptions, run_bench
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.configs import batch_blocks_needed
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams

    # NOTE: the KV pools hold what llama.cpp's contexts hold (llama-bench: one prompt + its output; the batched run:
    # `batched_context`), so that peak RSS compares like with like; the runtime's default pool is twice a full batch.
    # Models mixing sliding and full layers hold, as llama.cpp's, only the window of their sliding layers' K/V.
    info = read_engine_config(engine)
    windows, per_block = [g.window for g in info.kv_cache_groups], info.build.tokens_per_block
    blocks = lambda tokens, seqs: batch_blocks_needed(windows, per_block, seqs, tokens,  # noqa: E731
                                                      info.build.max_num_tokens)
    if part == "parallel":
        slack = -(-(batched_context(args) - args.parallel * (args.prompt + args.gen)) // per_block)
        parallel = run_bench(BenchOptions(engine=engine, num_requests=args.parallel, input_len=args.prompt,
                                          output_len=args.gen, concurrency=args.parallel, threads=args.threads,
                                          kv_cache_blocks=blocks(args.prompt + args.gen, args.parallel) + slack))
        return {"parallel_output_tok_s": parallel["output_throughput"]}
    core = EngineCore(engine, RuntimeConfig(num_threads=args.threads, max_batch_size=1, enable_prefix_caching=False,
                                            kv_cache_blocks=blocks(single_context(args), 1)))
    vocab = core.vocab_size
    tokens = lambda n: [(7 * i + 3) % (vocab - 10) + 5 for i in range(n)]  # noqa: E731
    prompt = tokens(args.prompt)

    def prefill() -> float:
        core.add_request(core.make_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        return time.perf_counter() - start

    # NOTE: one untimed prefill first, as llama-bench's warm-up run: a model near the machine's memory (gpt-oss-20b
    # beside llama.cpp's 21 GB) otherwise pays for faulting its weights back in from disk in the timed one
    prefill()
    prefill_s = prefill()
    # batch-1 decode: a `depth`-token (at least 1) prompt, then `gen` tokens; the prompt's steps are not counted
    core.add_request(core.make_request(tokens(max(1, args.depth)),
                                       SamplingParams(max_tokens=args.gen + 1, ignore_eos=True)))
    while not any(out.new_token_ids for out in core.step()):
        pass
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": args.prompt / prefill_s, "ttft_ms": prefill_s * 1e3, "decode_tok_s": args.gen / decode_s}


def trtbuild_round(engine: Path, args: argparse.Namespace) -> dict[str, float]:
    """The two parts in a process each, as llama.cpp's two tools run; peak RSS is the larger of the two."""
    result, peak = {}, 0
    for part in ("single", "parallel"):
        out, rss = run_timed([sys.executable, __file__, "--measure-trtbuild", str(engine), "--part", part,
                              "--threads", str(args.threads), "--prompt", str(args.prompt), "--gen", str(args.gen),
                              "--parallel", str(args.parallel), "--depth", str(args.depth)])
        result.update(json.loads(out.splitlines()[-1]))
        peak = max(peak, rss)
    return {**result, "peak_rss_mib": peak / 2**20}


def step_tokens(args: argparse.Namespace) -> int:
    """The engine's max_num_tokens: the prompt in one step (at least 256 tokens), but no more than `--ubatch`, the
    tokens of llama.cpp's steps. NOTE: a step's working memory grows with its tokens (Gemma 3 1B: peak RSS 1016
    MiB in 512-token steps, 1332 MiB in 2048-token ones, prefill 4% faster), so the two compare at equal steps."""
    return min(max(args.prompt, 256), args.ubatch)


def single_context(args: argparse.Namespace) -> int:
    """KV tokens of the one-sequence runs: the prompt, or the decode's context and its first token, and the output."""
    return max(args.prompt, args.depth + 1) + args.gen


# ---- llama.cpp ------------------------------------------------------------------------------------------------------
def batched_context(args: argparse.Namespace) -> int:
    """KV tokens of the concurrent run: every request's prompt and output, and a little slack."""
    return args.parallel * (args.prompt + args.gen) + 64


def llama_round(gguf: Path, bin_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    threads = ["-t", str(args.threads), "-ub", str(args.ubatch)]
    out, rss = run_timed([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(args.prompt), "-n", str(args.gen),
                          "-r", "1", "-o", "json", *threads])
    tests = json.loads(out)
    prefill = next(t["avg_ts"] for t in tests if t["n_prompt"] == args.prompt and t["n_gen"] == 0)
    decode = next(t["avg_ts"] for t in tests if t["n_gen"] == args.gen and t["n_prompt"] == 0)
    if args.depth:  # NOTE: its own run: `-d` would put the prefill after the context too
        out, rss_d = run_timed([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(args.gen),
                                "-d", str(args.depth), "-r", "1", "-o", "json", *threads])
        decode, rss = json.loads(out)[0]["avg_ts"], max(rss, rss_d)
    ctx = batched_context(args)
    table, rss_b = run_timed([str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-npp",
                              str(args.prompt), "-ntg", str(args.gen), "-npl", str(args.parallel), *threads])
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = [r for r in table.splitlines() if re.match(r"^\|\s*\d", r)][-1].strip("|").split("|")
    total_s = float(row[8])
    return {"prefill_tok_s": prefill, "ttft_ms": args.prompt / prefill * 1e3, "decode_tok_s": decode,
            "parallel_output_tok_s": args.parallel * args.gen / total_s, "peak_rss_mib": max(rss, rss_b) / 2**20}


# ---- ONNX Runtime GenAI -------------------------------------------------------------------------------------------
def build_ortgenai(hf_dir: Path, work: Path, args: argparse.Namespace) -> Path:
    """Its model builder on the HF folder, at `--ortgenai-precision`, with this run's thread count."""
    out = work / f"ortgenai-{args.ortgenai_precision}"
    if not (out / "genai_config.json").is_file():
        # NOTE: run from `work`: from the repository root, its quantization.py would shadow a module of the builder
        run_timed([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", hf_dir.name, "-i", str(hf_dir),
                   "-o", str(out), "-p", args.ortgenai_precision, "-e", "cpu", "-c", str(work / "ortgenai-cache")],
                  cwd=work)
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = args.threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


def measure_ortgenai(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """In this process (run by `--measure-ortgenai`): the same three measurements through og.Generator."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    vocab = json.loads((model_dir / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = np.array([(7 * i + 3) % (vocab - 10) + 5 for i in range(args.prompt)], dtype=np.int32)

    def generator(batch: int, length: int) -> og.Generator:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length, min_length=length, batch_size=batch, do_sample=False)
        return og.Generator(model, params)

    g = generator(1, args.prompt + 1)
    start = time.perf_counter()
    g.append_tokens(prompt[None])
    prefill_s = time.perf_counter() - start
    del g
    g = generator(1, args.gen + 1)
    g.append_tokens(prompt[None, :1])
    start = time.perf_counter()
    while not g.is_done():
        g.generate_next_token()
    decode_s = time.perf_counter() - start
    del g
    g = generator(args.parallel, args.prompt + args.gen)
    start = time.perf_counter()
    g.append_tokens(np.repeat(prompt[None], args.parallel, axis=0))
    while not g.is_done():
        g.generate_next_token()
    parallel_s = time.perf_counter() - start
    return {"prefill_tok_s": args.prompt / prefill_s, "ttft_ms": prefill_s * 1e3, "decode_tok_s": args.gen / decode_s,
            "parallel_output_tok_s": args.parallel * args.gen / parallel_s}


def ortgenai_round(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--measure-ortgenai", str(model_dir), "--threads", str(args.threads),
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--parallel", str(args.parallel)]
    out, rss = run_timed(cmd)
    return {**json.loads(out.splitlines()[-1]), "peak_rss_mib": rss / 2**20}


# ---- the run --------------------------------------------------------------------------------------------------------
def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {system: {m: statistics.median(r[m] for r in runs) for m in METRICS} for system, runs in rounds.items()}


def table(medians: dict[str, dict[str, float]], missing: dict[str, str], args: argparse.Namespace) -> str:
    peers = [p for p in medians if p != "trtbuild"]
    head = ["metric", "trtbuild", *peers, *(f"trtbuild vs {p}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in METRICS:
        cells = [m, *(f"{medians[s][m]:.1f}" for s in ("trtbuild", *peers))]
        for p in peers:  # > 1 means trtbuild is better, whichever way the metric points
            ratio = medians[p][m] / medians["trtbuild"][m] if m in LOWER_IS_BETTER else medians["trtbuild"][m] / \
                medians[p][m]
            cells.append(f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    for peer, why in missing.items():
        lines.append(f"missing: {peer} ({why})")
    depth = f" after a {args.depth}-token context" if args.depth else ""
    lines.append(f"({args.rounds} round(s), medians; {args.threads} threads; prompt {args.prompt}, generate "
                 f"{args.gen}{depth}, {args.parallel} concurrent, steps of at most {step_tokens(args)} tokens; "
                 "ratios > 1: trtbuild better)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--hf-dir", type=Path, default=None, help="HF folder of the same model (ONNX Runtime GenAI).")
    p.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/trtbuild-peers/llama-build/bin")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--depth", type=int, default=0, help="Tokens of context before the batch-1 decode.")
    p.add_argument("--ubatch", type=int, default=512,
                   help="Most tokens per step: llama.cpp's -ub (its default), the trtbuild engine's max_num_tokens.")
    p.add_argument("--work", type=Path, default=None, help="Where the engine is built [a temporary folder].")
    p.add_argument("--json", type=Path, default=None, help="Also write every round and the medians here.")
    p.add_argument("--smoke", action="store_true", help="Seconds-long run for CI: tiny lengths, one round.")
    p.add_argument("--ortgenai-precision", default="int4", choices=["int4", "fp16", "fp32"],
                   help="ONNX Runtime GenAI's model builder precision (match the GGUF's).")
    p.add_argument("--measure-trtbuild", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", choices=["single", "parallel"], default="single", help=argparse.SUPPRESS)
    p.add_argument("--measure-ortgenai", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_trtbuild:
        print(json.dumps(measure_trtbuild(args.measure_trtbuild, args.part, args)))
        return
    if args.measure_ortgenai:
        print(json.dumps(measure_ortgenai(args.measure_ortgenai, args)))
        return
    if args.gguf is None or not args.gguf.is_file():
        sys.exit(f"--gguf: give an existing GGUF file (got {args.gguf})")
    if args.smoke:
        args.rounds, args.prompt, args.gen, args.parallel = 1, 16, 8, 4
    work = args.work or Path(tempfile.mkdtemp(prefix="trtbuild-peers-"))
    try:
        engine = build_trtbuild(args.gguf.resolve(), work, args)
    except CommandFailed as e:
        sys.exit(f"trtbuild could not build an engine from {args.gguf}: {e}")
    systems = {"trtbuild": lambda: trtbuild_round(engine, args)}
    missing: dict[str, str] = {}
    if (args.llama_bin / "llama-bench").is_file() and (args.llama_bin / "llama-batched-bench").is_file():
        systems["llama.cpp"] = lambda: llama_round(args.gguf, args.llama_bin, args)
    else:
        missing["llama.cpp"] = f"no llama-bench / llama-batched-bench in {args.llama_bin}; build them with " \
                               "../shared/tools/build-llama-cpp.sh"
    if importlib.util.find_spec("onnxruntime_genai") is None:
        missing["onnxruntime-genai"] = "not installed (pip install onnxruntime-genai onnx_ir)"
    elif args.hf_dir is None:
        missing["onnxruntime-genai"] = "no --hf-dir: its model builder needs the HF folder"
    else:
        try:
            ortgenai = build_ortgenai(args.hf_dir.resolve(), work, args)
            systems["onnxruntime-genai"] = lambda: ortgenai_round(ortgenai, args)
        except CommandFailed as e:
            missing["onnxruntime-genai"] = str(e)
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    for n in range(args.rounds):
        for name, measure in list(systems.items()):
            try:
                rounds[name].append(measure())
            except CommandFailed as e:
                if name == "trtbuild":
                    raise
                missing[name] = str(e)  # a peer that cannot run this model is reported, not fatal
                if name == "llama.cpp" and "(exit 132)" in missing[name]:  # SIGILL
                    missing[name] += ("; a native build may use instructions (AMX) this VM does not enable: rebuild "
                                      "it without AMX (docs/performance.md, \"Float16 KV pools read in place\")")
                del systems[name], rounds[name]
                continue
            print(f"round {n + 1}/{args.rounds} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                                    rounds[name][-1].items()), file=sys.stderr)
    medians = summarize(rounds)
    print(table(medians, missing, args))
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "medians": medians, "missing": missing}, indent=2))
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
