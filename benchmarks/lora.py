"""A LoRA adapter in trtbuild against the same adapter in llama.cpp, on the same GGUF base and the same adapter file,
in one run (llama.cpp applies `--lora` adapters at run time; trtbuild builds them into the engine, builder/lora.py).

    python benchmarks/lora.py --gguf base.gguf [--adapter adapter.gguf | --rank 16] [--llama-bin DIR] [--threads 2]
        [--rounds 3] [--prompt 128] [--gen 128] [--parallel 16] [--slots N] [--no-llama] [--work DIR] [--json out.json]

Without `--adapter`, a random rank-`--rank` adapter of every linear of every layer is written as llama.cpp's
convert_lora_to_gguf.py writes one (float16 A / B, alpha 2 x rank). Measured: batch-1 decode (`--gen` tokens after
a `--prompt`-token prompt, tok/s) and `--parallel` concurrent requests of `--prompt` + `--gen` tokens (output tok/s
over the whole run, prefill included), for:
  trtbuild: an engine without the adapter; the engine with it, requests under it; the same engine, requests
            under no adapter (what adapters built in cost the base model's requests);
  llama.cpp: without `--lora` and with it: llama-completion for batch-1 decode, llama-server's slots for the
             concurrent requests (llama-bench takes no adapter and llama-batched-bench ignores `--lora`);
  with `--slots N`, trtbuild's engine with N LoRA slots of rank `--rank` (`--max-loras`, builder/lora_slots.py),
             the adapter loaded into one at start: requests under it, and under none (`--no-llama`: without the
             llama.cpp configurations, e.g. where it is not built).
Every configuration runs in its own process, rounds alternate them, and the table gives medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from peers import batched_context, run_timed, step_tokens, wait_healthy  # noqa: E402

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def make_adapter(base: Path, out: Path, rank: int, seed: int = 0) -> Path:
    """A random rank-`rank` LoRA adapter GGUF of every linear of the base model's layers."""
    import gguf

    reader = gguf.GGUFReader(base)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 2.0 * rank)
    for name, (rows, cols) in sorted((n, s) for n, s in shapes.items()
                                     if n.endswith(".weight") and n.split(".")[-2] in LINEARS):
        w.add_tensor(name + ".lora_a", (rng.standard_normal((rank, cols)) / np.sqrt(cols)).astype(np.float16))
        w.add_tensor(name + ".lora_b", (rng.standard_normal((rows, rank)) * 0.01).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build(gguf: Path, adapter: Path | None, work: Path, args: argparse.Namespace, slots: int = 0) -> Path:
    engine = work / (f"engine_slots{slots}" if slots else "engine_lora" if adapter else "engine")
    if (engine / "config.json").is_file():
        return engine
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        run_timed(["trtbuild", "convert", "--model", str(gguf), "--output", str(ckpt)])
    run_timed(["trtbuild", "build", "--checkpoint", str(ckpt), "--output", str(engine), "--max-batch-size",
               str(args.parallel), "--max-seq-len", str(max(256, args.prompt + args.gen)), "--max-num-tokens",
               str(step_tokens(args)), *(["--lora", f"adapter={adapter}"] if adapter and not slots else []),
               *(["--max-loras", str(slots), "--max-lora-rank", str(args.rank)] if slots else [])])
    return engine


def measure(engine: Path, lora: str | None, part: str, args: argparse.Namespace) -> dict[str, float]:
    """In this process: `single`, batch-1 decode after one prompt; `parallel`, the concurrent requests. A slot
    engine first loads `args.adapter` as `adapter`."""
    from trtbuild.builder.engine_dir import read_engine_config
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams

    seqs = args.parallel if part == "parallel" else 1
    per_block = read_engine_config(engine).build.tokens_per_block
    blocks = seqs * -(-(args.prompt + args.gen + 1) // per_block)  # every request's whole lifetime, as llama.cpp's
    core = EngineCore(engine, RuntimeConfig(num_threads=args.threads, max_batch_size=seqs, enable_prefix_caching=False,
                                            kv_cache_blocks=blocks))
    if core.lora.dynamic:
        core.load_lora(core.lora.prepare("adapter", args.adapter))
    vocab = core.vocab_size
    prompts = [[(7 * i + 3 * s) % (vocab - 10) + 5 for i in range(args.prompt)] for s in range(seqs)]
    extra = 1 if part == "single" else 0  # single: the prefill step's token is not counted, as llama's T_TG
    for p in prompts:
        core.add_request(core.make_request(p, SamplingParams(max_tokens=args.gen + extra, ignore_eos=True),
                                           lora=lora))
    if part == "single":
        core.step()
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    seconds = time.perf_counter() - start
    key = "parallel_output_tok_s" if part == "parallel" else "decode_tok_s"
    return {key: seqs * args.gen / seconds}


def trtbuild_round(engine: Path, lora: str | None, args: argparse.Namespace) -> dict[str, float]:
    result = {}
    for part in ("single", "parallel"):
        out, _ = run_timed([sys.executable, __file__, "--measure", str(engine), "--lora", lora or "", "--part", part,
                            "--threads", str(args.threads), "--prompt", str(args.prompt), "--gen", str(args.gen),
                            "--parallel", str(args.parallel), *(["--adapter", str(args.adapter)] if args.adapter
                                                                  else [])])
        result.update(json.loads(out.splitlines()[-1]))
    return result


def llama_single(gguf: Path, adapter: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """Batch-1 decode with llama-completion, which applies `--lora` (llama-bench takes none and llama-batched-bench
    ignores it): a prompt of about `--prompt` tokens, then `--gen` tokens."""
    import subprocess

    lora = ["--lora", str(adapter)] if adapter else []
    # NOTE: " a" is one token in the BPE vocabularies (its merge comes first); the count is checked below
    cmd = [str(args.llama_bin / "llama-completion"), "-m", str(gguf), "-p", "a" + " a" * (args.prompt - 1),
           "-n", str(args.gen), "--ignore-eos", "-no-cnv", "-c", str(args.prompt + args.gen + 64), "-t",
           str(args.threads), "-ub", str(args.ubatch), *lora]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-completion failed (exit {out.returncode}): {out.stderr[-500:]}")
    # common_perf_print: prompt eval time = 497.32 ms / 128 tokens (...)
    # common_perf_print:        eval time = 4953.29 ms / 127 runs (... ms per token, 25.6 tokens per second)
    prompt = int(re.findall(r"prompt eval time = .*? / +(\d+) tokens", out.stderr)[-1])
    if abs(prompt - args.prompt) > 2:
        raise RuntimeError(f"llama-completion's prompt is {prompt} tokens, not about {args.prompt}")
    return {"decode_tok_s": float(re.findall(r" eval time = .*?([\d.]+) tokens per second", out.stderr)[-1])}


def llama_parallel(gguf: Path, adapter: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """`--parallel` concurrent requests to llama-server (`-np` slots, `--lora` applied to every request), each
    `--prompt` token ids then `--gen` tokens; output tok/s over the whole run, prefill included."""
    import socket
    import subprocess
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lora = ["--lora", str(adapter)] if adapter else []
    server = subprocess.Popen([str(args.llama_bin / "llama-server"), "-m", str(gguf), "-np", str(args.parallel),
                               "-c", str(batched_context(args)), "-t", str(args.threads), "-ub", str(args.ubatch),
                               "--port", str(port), "--no-webui", *lora],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, server)
        vocab = args.vocab

        def one(s: int) -> None:
            body = {"prompt": [(7 * i + 3 * s) % (vocab - 10) + 5 for i in range(args.prompt)],
                    "n_predict": args.gen, "ignore_eos": True, "temperature": 0, "cache_prompt": False}
            request = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as r:
                assert json.loads(r.read())["tokens_predicted"] == args.gen

        start = time.perf_counter()
        with ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(one, range(args.parallel)))
        return {"parallel_output_tok_s": args.parallel * args.gen / (time.perf_counter() - start)}
    finally:
        server.terminate()
        server.wait(60)


def llama_round(gguf: Path, adapter: Path | None, args: argparse.Namespace) -> dict[str, float]:
    return {**llama_single(gguf, adapter, args), **llama_parallel(gguf, adapter, args)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--adapter", type=Path, default=None, help="A LoRA adapter GGUF [a random one of --rank].")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/trtbuild-peers/llama-build/bin")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--ubatch", type=int, default=512)
    p.add_argument("--slots", type=int, default=0, help="Also an engine of this many LoRA slots (--max-loras).")
    p.add_argument("--no-llama", action="store_true", help="Leave llama.cpp out.")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lora", default="", help=argparse.SUPPRESS)
    p.add_argument("--part", choices=["single", "parallel"], default="single", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.lora or None, args.part, args)))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="trtbuild-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    adapter = args.adapter = args.adapter or make_adapter(args.gguf, work / f"adapter-r{args.rank}.gguf", args.rank)
    plain, adapted = build(args.gguf, None, work, args), build(args.gguf, adapter, work, args)
    slotted = build(args.gguf, adapter, work, args, args.slots) if args.slots else None
    args.vocab = json.loads((plain / "config.json").read_text())["model_config"]["vocab_size"]
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    configs = {"trtbuild": lambda: trtbuild_round(plain, None, args),
               "trtbuild+lora": lambda: trtbuild_round(adapted, "adapter", args),
               "trtbuild+lora, base requests": lambda: trtbuild_round(adapted, None, args)}
    if slotted is not None:
        configs[f"trtbuild {args.slots} slots+lora"] = lambda: trtbuild_round(slotted, "adapter", args)
        configs[f"trtbuild {args.slots} slots, base requests"] = lambda: trtbuild_round(slotted, None, args)
    if not args.no_llama:
        configs["llama.cpp"] = lambda: llama_round(args.gguf, None, args)
        configs["llama.cpp+lora"] = lambda: llama_round(args.gguf, adapter, args)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, run in configs.items():
            rounds[name].append(run())
            print(f"round {r + 1} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rounds.items()}
    print(f"{args.gguf.name} + {adapter.name}, {args.threads} threads, medians of {args.rounds} rounds")
    print(f"| | batch-1 decode tok/s | {args.parallel} concurrent, output tok/s |")
    print("|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m['decode_tok_s']:.1f} | {m['parallel_output_tok_s']:.1f} |")
    ratio = lambda a, b, k: medians[a][k] / medians[b][k]  # noqa: E731
    for k, what in (("decode_tok_s", "batch-1 decode"), ("parallel_output_tok_s", f"{args.parallel} concurrent")):
        parts = [f"adapter cost (with / without): trtbuild {ratio('trtbuild+lora', 'trtbuild', k):.2f}",
                 "trtbuild's base requests on the adapted engine "
                 f"{ratio('trtbuild+lora, base requests', 'trtbuild', k):.2f}"]
        if not args.no_llama:
            parts = [f"trtbuild+lora / llama.cpp+lora {ratio('trtbuild+lora', 'llama.cpp+lora', k):.2f}x",
                     *parts, f"llama.cpp {ratio('llama.cpp+lora', 'llama.cpp', k):.2f}"]
        if slotted is not None:
            parts += [f"{args.slots} slots / built in, under the adapter "
                      f"{ratio(f'trtbuild {args.slots} slots+lora', 'trtbuild+lora', k):.2f}, base requests "
                      f"{ratio(f'trtbuild {args.slots} slots, base requests', 'trtbuild', k):.2f}"]
        print(f"{what}: " + "; ".join(parts))
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
