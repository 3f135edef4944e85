"""Embeddings from trtbuild's server against llama.cpp's (llama-server --embedding --pooling last), on the same GGUF
file, over the same OpenAI /v1/embeddings requests, in one run.

    python benchmarks/embeddings.py --gguf model.gguf --llama-bin DIR [--threads 2] [--rounds 3] [--inputs 64]
        [--tokens 128] [--singles 8] [--work DIR] [--json out.json]

trtbuild builds the file as it is with `--task embed` (last-token pooling, L2-normalized, as llama.cpp's
`--pooling last` and its /v1/embeddings' normalization). Each round starts one server, then the other (alternating
which first), and times on it: one request of `--inputs` inputs of `--tokens` token ids each (input tokens per
second), and `--singles` requests of one input in turn (median latency). The first round also checks that both give
the same vectors: the smallest cosine similarity over the batch's inputs is printed (both quantize activations for the
quantized dot products, so it is near but not exactly 1). Medians over the rounds, and ratios.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from peers import wait_healthy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as r:
        return json.loads(r.read())


def serve(name: str, args: argparse.Namespace, engine: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if name == "trtbuild":
        cmd = [sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(engine), "--port", "0", "--http-port",
               str(port), "--threads", str(args.threads)]
    else:
        cmd = [str(args.llama_bin / "llama-server"), "-m", str(args.gguf), "--embedding", "--pooling", "last",
               "-np", "16", "-c", str(16 * (args.tokens + 16)), "-b", "2048", "-ub", "2048", "-t", str(args.threads),
               "--port", str(port), "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc)
    return proc, base


def measure(base: str, inputs: list[list[int]], args: argparse.Namespace) -> tuple[dict[str, float], np.ndarray]:
    """NOTE: the warm-up, the batch and the single requests have inputs of their own: none is in a prefix cache."""
    url = base + "/v1/embeddings"
    warm_up, batch, singles = inputs[:1], inputs[1 : 1 + args.inputs], inputs[1 + args.inputs :]
    post(url, {"input": warm_up})
    start = time.perf_counter()
    data = post(url, {"input": batch})["data"]
    batch_s = time.perf_counter() - start
    vectors = np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])], dtype=np.float64)
    latencies = []
    for x in singles:
        start = time.perf_counter()
        post(url, {"input": [x]})
        latencies.append(time.perf_counter() - start)
    return {"batch_input_tok_s": len(inputs) * args.tokens / batch_s,
            "single_latency_ms": 1000 * statistics.median(latencies)}, vectors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--llama-bin", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--singles", type=int, default=8)
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert
    from trtbuild.configs import ModelConfig

    work = args.work or Path(tempfile.mkdtemp(prefix="embed-bench-"))
    engine = work / "engine"
    if not (engine / "config.json").is_file():
        convert(args.gguf, work / "ckpt")
        build_engine(work / "ckpt", engine, task="embed", max_seq_len=args.tokens + 16, max_batch_size=16,
                     max_num_tokens=2048)
    vocab = ModelConfig.load(work / "ckpt" / "config.json").vocab_size
    rng = np.random.default_rng(0)
    inputs = rng.integers(100, min(vocab, 32000) - 100, size=(1 + args.inputs + args.singles, args.tokens)).tolist()
    names = ["trtbuild", "llama.cpp"]
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    vectors: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            proc, base = serve(name, args, engine)
            try:
                numbers, vectors[name] = measure(base, inputs, args)
            finally:
                proc.terminate()
                proc.wait(60)
            results[name].append(numbers)
            print(f"round {r + 1} {name}: {numbers}", flush=True)
    cosine = float(np.min(np.sum(vectors["trtbuild"] * vectors["llama.cpp"], axis=1)
                          / np.linalg.norm(vectors["trtbuild"], axis=1) / np.linalg.norm(vectors["llama.cpp"], axis=1)))
    med = {n: {k: statistics.median(x[k] for x in results[n]) for k in results[n][0]} for n in names}
    summary = {"model": str(args.gguf), "inputs": args.inputs, "tokens": args.tokens, "threads": args.threads,
               "rounds": args.rounds, "min_cosine": round(cosine, 5), "medians": med,
               "batch_ratio": round(med["trtbuild"]["batch_input_tok_s"] / med["llama.cpp"]["batch_input_tok_s"], 2),
               "single_latency_ratio": round(med["llama.cpp"]["single_latency_ms"]
                                             / med["trtbuild"]["single_latency_ms"], 2)}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
