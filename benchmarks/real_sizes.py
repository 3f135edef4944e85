"""Convert, build, load and decode a real-size model three ways, measuring each stage; check fp32 logits against
transformers. Input: the folder `make_real_size_model.py` writes (hf/ + model-Q4_K_M.gguf).

    python benchmarks/real_sizes.py --model-dir /work/models/qwen1p5b --work /work/models/runs [--threads 2]

Each trtbuild command runs in its own process under /usr/bin/time, so its wall time and peak RSS are its own.
Batch-1 decode is `trtbuild bench --concurrency 1` (output tok/s, engine load time), alternated over --rounds and
reported as medians, since this VM's speed drifts. Prints a markdown table and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

BUILDS = {  # name -> (source, convert options)
    "fp32": ("hf", []),  # a bf16 checkpoint; the CPU engine computes in fp32
    "weight-only int8": ("hf", ["--weight-only", "int8"]),
    "weight-only int4": ("hf", ["--weight-only", "int4"]),
    "GGUF Q4_K/Q6_K as is": ("gguf", []),
}


# batch-1 decode is measured: a small batch and step keep the warm-up step and the KV pool small
BUILD_OPTIONS = ["--max-batch-size", "4", "--max-num-tokens", "512", "--max-seq-len", "2048"]


def timed(cmd: list[str], log: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one command; fails loudly with its log."""
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], stdout=f, stderr=subprocess.STDOUT).returncode
    last = [line for line in log.read_text().splitlines() if line.startswith("TIME ")][-1].split()
    if rc:
        sys.exit(f"{' '.join(cmd)} failed (exit {rc}); see {log}")
    return float(last[1]), int(last[2]) * 1024


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def bench(engine: Path, threads: int, log: Path) -> dict:
    out = subprocess.run(["trtbuild", "bench", "--engine", str(engine), "--num-requests", "2", "--input-len", "32",
                          "--output-len", "32", "--concurrency", "1", "--threads", str(threads), "--json"],
                         capture_output=True, text=True)
    log.write_text(out.stdout + out.stderr)
    if out.returncode:
        sys.exit(f"bench of {engine} failed; see {log}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def logits_check(hf_dir: Path, engine: Path, threads: int) -> float:
    """Max |engine - transformers| over the logits of a 6-token prompt, both in fp32."""
    import torch
    import transformers

    from trtbuild.runtime.engine import CpuEngine, SequenceChunk

    ids = [11, 220, 1001, 57, 9, 300]
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    del model
    got = CpuEngine(engine, num_threads=threads, num_blocks=4).step([SequenceChunk(0, ids, 0, len(ids), [0])])
    return float(np.abs(got - ref).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--builds", nargs="*", default=list(BUILDS))
    args = ap.parse_args()
    sources = {"hf": args.model_dir / "hf", "gguf": args.model_dir / "model-Q4_K_M.gguf"}
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for name in args.builds:
        source, options = BUILDS[name]
        slug = name.replace(" ", "_").replace("/", "_")
        ckpt, engine = args.work / f"ckpt-{slug}", args.work / f"engine-{slug}"
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(engine, ignore_errors=True)
        r = results[name] = {}
        r["convert_s"], r["convert_rss"] = timed(["trtbuild", "convert", "--model", str(sources[source]), "--output",
                                                  str(ckpt), *options], args.work / f"convert-{slug}.log")
        r["checkpoint_bytes"] = dir_bytes(ckpt)
        r["build_s"], r["build_rss"] = timed(["trtbuild", "build", "--checkpoint", str(ckpt), "--output",
                                              str(engine), *BUILD_OPTIONS], args.work / f"build-{slug}.log")
        r["engine_bytes"] = dir_bytes(engine)
        print(f"{name}: built", json.dumps(r), flush=True)
        shutil.rmtree(ckpt)
    for i in range(args.rounds):  # alternate the engines, round by round
        for name in args.builds:
            slug = name.replace(" ", "_").replace("/", "_")
            b = bench(args.work / f"engine-{slug}", args.threads, args.work / f"bench-{slug}-{i}.log")
            results[name].setdefault("rounds", []).append(
                {k: b[k] for k in ("output_throughput", "tpot_ms_p50", "load_s", "warm_up_s", "kv_pool_bytes",
                                   "peak_rss_bytes")})
    for name in args.builds:  # the README's main job on each engine: text in, text out
        slug = name.replace(" ", "_").replace("/", "_")
        out = subprocess.run(["trtbuild", "run", "--engine", str(args.work / f"engine-{slug}"), "--prompt",
                              "The capital of France is", "--max-tokens", "8", "--threads", str(args.threads)],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"trtbuild run on {name} failed:\n{out.stderr[-2000:]}")
        results[name]["generated"] = out.stdout.strip()
    if "fp32" in args.builds:
        results["fp32"]["max_abs_logit_diff_vs_transformers"] = logits_check(
            sources["hf"], args.work / "engine-fp32", args.threads)
    (args.work / "results.json").write_text(json.dumps(results, indent=2))
    print("| build | convert s / peak RSS | checkpoint | build s / peak RSS | engine | session load s | batch-1 decode "
          "tok/s | TPOT p50 ms | run peak RSS (KV pool) |")
    print("|---|---|---|---|---|---|---|---|---|")
    gb = 1e9
    for name, r in results.items():
        med = {k: statistics.median(x[k] for x in r["rounds"]) for k in r["rounds"][0]}
        print(f"| {name} | {r['convert_s']:.0f} s / {r['convert_rss'] / gb:.2f} GB | "
              f"{r['checkpoint_bytes'] / gb:.2f} GB | {r['build_s']:.0f} s / {r['build_rss'] / gb:.2f} GB | "
              f"{r['engine_bytes'] / gb:.2f} GB | "
              f"{med['load_s']:.1f} | {med['output_throughput']:.2f} | {med['tpot_ms_p50']:.0f} | "
              f"{med['peak_rss_bytes'] / gb:.2f} GB ({med['kv_pool_bytes'] / gb:.2f} GB) |")
    if "fp32" in results:
        print(f"fp32 max |logit - transformers| = {results['fp32']['max_abs_logit_diff_vs_transformers']:.2e}")
    for name, r in results.items():
        print(f"{name} generates (random weights): {r['generated']!r}")


if __name__ == "__main__":
    main()
