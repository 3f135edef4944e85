"""Speculative decoding with a draft model on trtbuild and on llama.cpp's server, the same target and draft GGUF files,
batch 1, in one run: decode speed without drafts, with the target drafting for itself (every draft right for trtbuild:
the machinery's cost and gain at full acceptance) and with the target's first `--draft-layers` layers as the draft (a
draft that costs what a real one does; random weights make it a poor guesser).

    python benchmarks/speculative_peers.py --gguf model.gguf [--draft-layers 4] [--speculative-tokens 4]
        [--llama-bin DIR] [--threads 2] [--rounds 3] [--prompt 64] [--output 96] [--work DIR]

For a model with recurrent layers (Qwen3.5, Granite 4.0-H) trtbuild keeps the state from before each step's drafts and
restores it on a rejection (runtime/recurrent_state.py); llama-server checkpoints its recurrent state per step and
decodes the accepted drafts again. Each system runs in its own process, one after another, alternated over rounds;
llama-server with `--spec-type draft-simple --spec-draft-n-max K`, greedy, end-of-text ignored, token-id prompts.
Reported: decode tokens per second after the first token (medians), drafts accepted, ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from embeddings import free_port  # noqa: E402
from peers import run_timed, wait_healthy  # noqa: E402


def cut_layers(src: Path, dst: Path, layers: int) -> None:
    """A GGUF of `src`'s first `layers` blocks (its embeddings, final norm and head kept), quantized as they are."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value, kind = field.contents(), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if field.name == f"{arch}.block_count":
            value = layers
        elif sub is not None and len(value) == total:  # a value per layer
            value = value[:layers]
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def build_engine(gguf: Path, engine: Path, args: argparse.Namespace) -> Path:
    if not (engine / "config.json").is_file():
        ckpt = engine.with_name(engine.name + "-ckpt")
        run_timed(["trtbuild", "convert", "--model", str(gguf), "--output", str(ckpt)])
        run_timed(["trtbuild", "build", "--checkpoint", str(ckpt), "--output", str(engine), "--max-batch-size", "1",
                   "--max-seq-len", str(args.prompt + args.output + 32)])
    return engine


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1000, min(30000, vocab), size=args.prompt).tolist() for _ in range(args.requests)]


def measure_trtbuild(engine: Path, draft: Path | None, args: argparse.Namespace) -> list[dict]:
    """In this process (`--measure-trtbuild ENGINE [--measure-draft DRAFT]`): the requests through EngineCore."""
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.engine_core import EngineCore
    from trtbuild.runtime.sampling import SamplingParams
    from trtbuild.runtime.speculative import SpeculativeConfig

    spec = SpeculativeConfig(args.speculative_tokens, method="draft_model", draft_engine_dir=str(draft)) \
        if draft else None
    core = EngineCore(engine, RuntimeConfig(num_threads=args.threads, max_batch_size=1, speculative=spec))
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    results = []
    for i, prompt in enumerate([prompts(args, core.vocab_size)[0][:8]] + prompts(args, core.vocab_size)):
        request = core.make_request(prompt, params)
        core.add_request(request)
        first, n = None, 0
        while core.has_unfinished():
            for out in core.step():
                n += len(out.new_token_ids)
                first = first or time.perf_counter()
        if i:  # NOTE: the first request is an untimed warm-up, as llama-server's
            results.append({"decode_tok_s": (n - 1) / (time.perf_counter() - first),
                            "drafted": request.metrics.num_draft_tokens,
                            "accepted": request.metrics.num_accepted_draft_tokens})
    return results


def trtbuild_run(engine: Path, draft: Path | None, args: argparse.Namespace) -> list[dict]:
    out, _ = run_timed([sys.executable, __file__, "--measure-trtbuild", str(engine), "--threads", str(args.threads),
                        "--prompt", str(args.prompt), "--output", str(args.output), "--requests", str(args.requests),
                        "--speculative-tokens", str(args.speculative_tokens),
                        *(["--measure-draft", str(draft)] if draft else [])])
    return json.loads(out.splitlines()[-1])


def llama_server(gguf: Path, draft: Path | None, vocab: int, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    spec = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.speculative_tokens),
            "-td", str(args.threads)] if draft else []
    proc = subprocess.Popen([str(args.llama_bin / "llama-server"), "-m", str(gguf), "-np", "1", "-c",
                             str(args.prompt + args.output + 32), "-t", str(args.threads), "--port", str(port),
                             "--no-webui", *spec], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        results = []
        for i, prompt in enumerate([prompts(args, vocab)[0][:8]] + prompts(args, vocab)):
            body = {"prompt": prompt, "n_predict": args.output, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False}
            request = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as response:
                timings = json.loads(response.read())["timings"]
            if i:
                results.append({"decode_tok_s": timings["predicted_per_second"],
                                "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)})
        return results
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path)
    p.add_argument("--draft-layers", type=int, default=4)
    p.add_argument("--speculative-tokens", type=int, default=4)
    p.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/trtbuild-peers/llama-build/bin")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=96)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--work", type=Path, default=None, help="Where the engines are built [a temporary folder].")
    p.add_argument("--measure-trtbuild", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--measure-draft", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure_trtbuild:
        print(json.dumps(measure_trtbuild(args.measure_trtbuild, args.measure_draft, args)))
        return
    if args.gguf is None or not args.gguf.is_file():
        sys.exit(f"--gguf: give an existing GGUF file (got {args.gguf})")
    if not (args.llama_bin / "llama-server").is_file():
        sys.exit(f"no llama-server in {args.llama_bin}: build it with ../shared/tools/build-llama-cpp.sh")
    work = args.work or Path(tempfile.mkdtemp(prefix="trtbuild-spec-"))
    work.mkdir(parents=True, exist_ok=True)
    cut = work / f"draft-{args.draft_layers}-layers.gguf"
    if not cut.is_file():
        cut_layers(args.gguf, cut, args.draft_layers)
    engine, draft = build_engine(args.gguf, work / "target", args), build_engine(cut, work / "draft", args)
    from trtbuild.builder.engine_dir import read_engine_config

    vocab = read_engine_config(engine).model.vocab_size
    systems = {"trtbuild": lambda: trtbuild_run(engine, None, args),
               "trtbuild, self-draft": lambda: trtbuild_run(engine, engine, args),
               f"trtbuild, {args.draft_layers}-layer draft": lambda: trtbuild_run(engine, draft, args),
               "llama.cpp": lambda: llama_server(args.gguf, None, vocab, args),
               "llama.cpp, self-draft": lambda: llama_server(args.gguf, args.gguf, vocab, args),
               f"llama.cpp, {args.draft_layers}-layer draft": lambda: llama_server(args.gguf, cut, vocab, args)}
    rounds: dict[str, list] = {name: [] for name in systems}
    for n in range(args.rounds):
        for name in list(systems)[n % len(systems):] + list(systems)[:n % len(systems)]:
            rounds[name].append(systems[name]())
            print(f"round {n + 1}: {name} {statistics.median(r['decode_tok_s'] for r in rounds[name][-1]):.1f} "
                  "tok/s", file=sys.stderr, flush=True)
    speed = {name: statistics.median(r["decode_tok_s"] for run in runs for r in run) for name, runs in rounds.items()}
    print(f"\n| system | decode tok/s (median of {args.rounds} rounds x {args.requests}) | vs its plain decode | "
          "drafts accepted |")
    print("|---|---|---|---|")
    for name, runs in rounds.items():
        plain = speed["trtbuild" if name.startswith("trtbuild") else "llama.cpp"]
        drafted, accepted = sum(r["drafted"] for r in runs[0]), sum(r["accepted"] for r in runs[0])
        print(f"| {name} | {speed[name]:.1f} | {speed[name] / plain:.2f}x | "
              f"{f'{accepted} of {drafted}' if drafted else '-'} |")
    for kind in ("", ", self-draft", f", {args.draft_layers}-layer draft"):
        print(f"trtbuild{kind} vs llama.cpp{kind}: {speed['trtbuild' + kind] / speed['llama.cpp' + kind]:.2f}x")


if __name__ == "__main__":
    main()
