"""Soak and fuzz a real `trtbuild serve` (gRPC + OpenAI HTTP) with mixed load, then check what it returned.

    python benchmarks/soak.py --engine <engine dir> [--duration 600] [--concurrency 16] [--kv-cache-blocks 64]
        [--speculative-tokens K]

Workers keep the server busy for --duration seconds, each picking at random: a gRPC stream run to its end, a gRPC
stream cancelled after a few tokens, an OpenAI completion streamed over HTTP (half of them dropped mid-stream), or a
bad request (from BAD_REQUESTS, each expecting its error). A small KV pool (--kv-cache-blocks) forces preemptions.
Requests are greedy, so afterwards every completed stream is checked token for token against the same request sent
alone. At the end the KV pool must be full again, no request unfinished, and the server's RSS near its start (after
warm-up). Prints a one-screen report; exits 1 when any check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from trtbuild.serving.grpc.client import GenerationClient

PROMPTS = [f"{n} went to the {p}" for n in ("Lily", "Tom", "Sue", "Ben", "Max") for p in ("park", "sea", "shop",
                                                                                         "forest", "zoo")]
# (how it is sent, body, what the answer must contain): every one must be refused, never crash the server
BAD_REQUESTS = [
    ("grpc", dict(prompt="Once", top_p=0.0), "INVALID_ARGUMENT"),
    ("grpc", dict(prompt="Once", max_tokens=0), "INVALID_ARGUMENT"),
    ("grpc", dict(prompt=[1, 10**9]), "INVALID_ARGUMENT"),
    ("grpc", dict(prompt=""), "INVALID_ARGUMENT"),
    ("grpc", dict(prompt="x" * 2_000_000), "INVALID_ARGUMENT"),
    ("grpc", b"\xff\xff\xff\xff not a GenerateRequest", "INVALID_ARGUMENT"),
    ("http", {"prompt": "Once", "temperature": -1}, "400"),
    ("http", {"prompt": "Once", "logit_bias": {"a": 1}}, "400"),
    ("http", {"prompt": "Once", "max_tokens": 10**6}, "400"),
    ("http", {"messages": [{"role": "wizard", "content": "x"}]}, "400"),
    ("http", {"prompt": "Once", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
              "model": None}, "400"),
    ("raw", b"{not json", "400"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.http_port = args, free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(args.engine), "--port", "0",
             "--http-port", str(self.http_port), "--threads", str(args.threads), "--kv-cache-blocks",
             str(args.kv_cache_blocks), "--served-model-name", "soak",
             *(["--speculative-tokens", str(args.speculative_tokens)] if args.speculative_tokens else [])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        address = None
        for line in self.proc.stdout:
            if m := re.search(r"listening on (\S+)", line):
                address = m.group(1)
            if "OpenAI API on" in line:
                break
        if address is None:
            sys.exit("the server did not start:\n" + self.proc.stdout.read())
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        self.client = GenerationClient(address, timeout=60)
        self.client.wait_ready(60)
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.completed: list[tuple[tuple, list[int]]] = []  # (request key, token ids)
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    # ---- actions ------------------------------------------------------------------------------------------------
    def grpc_stream(self, rng: random.Random, cancel: bool) -> None:
        prompt, n = rng.choice(PROMPTS), rng.randint(4, 48)
        tokens, stream = [], self.client.generate_stream(prompt, max_tokens=n, ignore_eos=True, timeout=120)
        for response in stream:
            tokens += response.token_ids
            if cancel and len(tokens) >= n // 3:
                stream.cancel()
                self.count("grpc cancelled")
                return
        self.done(("grpc", prompt, n), tokens, "grpc completed")

    def http_stream(self, rng: random.Random, drop: bool) -> None:
        prompt, n = rng.choice(PROMPTS), rng.randint(4, 48)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
                "logprobs": 0}
        request = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        tokens = []
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += [t for t in (choice.get("logprobs") or {}).get("tokens", [])]
                    if drop and len(tokens) >= n // 3:
                        self.count("http dropped")
                        return  # closing the connection aborts the request
        self.done(("http", prompt, n), tokens, "http completed")

    def send_bad(self, how: str, body) -> tuple[str, str]:
        """(status, message) the server answers a bad request with ("success" if it does not refuse it)."""
        if how == "grpc":
            try:
                if isinstance(body, bytes):  # not a protobuf message at all
                    raw = self.client.channel.unary_unary("/trtbuild.v1.Generation/Generate")  # no serializers
                    raw(body, timeout=60)
                else:
                    self.client.generate(body["prompt"], timeout=60, **{k: v for k, v in body.items()
                                                                         if k != "prompt"})
            except grpc.RpcError as e:
                return e.code().name, e.details()
            return "success", ""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
        try:
            urllib.request.urlopen(urllib.request.Request(self.base + path, data,
                                                          {"Content-Type": "application/json"}), timeout=60)
        except urllib.error.HTTPError as e:
            return str(e.code), json.loads(e.read())["error"]["message"]
        return "success", ""

    def bad_requests_table(self) -> str:
        rows = ["| sent over | request | status | message |", "|---|---|---|---|"]
        for how, body, _ in BAD_REQUESTS:
            status, message = self.send_bad(how, dict(body) if isinstance(body, dict) else body)
            shown = str(body) if len(str(body)) < 90 else str(body)[:60] + f"... ({len(str(body))} characters)"
            rows.append(f"| {how} | `{shown}` | {status} | {message.replace('|', '/')} |")
        return "\n".join(rows)

    def bad(self, rng: random.Random) -> None:
        how, body, expected = rng.choice(BAD_REQUESTS)
        got, _ = self.send_bad(how, body)
        if got != expected:
            self.fail(f"bad request {how} {str(body)[:60]}: expected {expected}, got {got or 'success'}")
        self.count("bad requests refused")

    # ---- bookkeeping --------------------------------------------------------------------------------------------
    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] += 1

    def done(self, key: tuple, tokens: list, what: str) -> None:
        with self.lock:
            self.completed.append((key, tokens))
            self.counts[what] += 1

    def fail(self, message: str) -> None:
        with self.lock:
            self.failures.append(message)

    def worker(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            action = rng.random()
            try:
                if action < 0.35:
                    self.grpc_stream(rng, cancel=False)
                elif action < 0.5:
                    self.grpc_stream(rng, cancel=True)
                elif action < 0.85:
                    self.http_stream(rng, drop=rng.random() < 0.5)
                else:
                    self.bad(rng)
            except Exception as e:  # an action that fails unexpectedly is a finding, not a crash of the soak
                self.fail(f"{type(e).__name__}: {str(e)[:200]}")

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        self.grpc_stream(random.Random(0), cancel=False)  # warm-up, then the RSS baseline
        rss_start = rss_bytes(self.proc.pid)
        start = time.monotonic()
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(lambda i: self.worker(a.seed + i, start + a.duration), range(a.concurrency)))
        elapsed = time.monotonic() - start
        mismatches = self.check_against_alone()
        deadline = time.monotonic() + 30
        while (stats := self.client.stats()).num_unfinished or stats.kv_free_blocks != stats.kv_total_blocks:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        rss_end = rss_bytes(self.proc.pid)
        leaked = stats.num_unfinished or stats.kv_free_blocks != stats.kv_total_blocks
        rss_ok = rss_end <= max(rss_start * a.rss_tolerance, rss_start + (64 << 20))
        print(f"soak: {elapsed:.0f} s, {a.concurrency} workers, KV pool {stats.kv_total_blocks} blocks, "
              f"{stats.num_preemptions} preemptions, {stats.num_finished} requests finished")
        for what, n in sorted(self.counts.items()):
            print(f"  {what:<24}{n}")
        print(f"  finish reasons          {dict(stats.finish_reasons)}")
        if a.speculative_tokens:
            drafted, accepted = self.draft_counts()
            print(f"drafts:                   {accepted} of {drafted} accepted")
        print(f"checked against alone:    {len(self.completed)} streams, {mismatches} mismatches")
        print(f"KV pool after:            {stats.kv_free_blocks}/{stats.kv_total_blocks} free, "
              f"{stats.num_unfinished} unfinished -> {'LEAK' if leaked else 'ok'}")
        print(f"server RSS:               {rss_start / 2**20:.0f} MiB after warm-up, {rss_end / 2**20:.0f} MiB after "
              f"-> {'ok' if rss_ok else 'GREW'}")
        for failure in self.failures[:10]:
            print(f"failure: {failure}")
        ok = not mismatches and not leaked and rss_ok and not self.failures and len(self.completed) > 0
        print("soak: PASS" if ok else "soak: FAIL")
        return 0 if ok else 1

    def draft_counts(self) -> tuple[int, int]:
        """Draft tokens verified and accepted so far, from the OpenAI server's Prometheus metrics."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as response:
            text = response.read().decode()

        def total(name: str) -> int:
            return int(sum(float(m) for m in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M)))

        return total("vllm:spec_decode_num_draft_tokens"), total("vllm:spec_decode_num_accepted_tokens")

    def check_against_alone(self) -> int:
        """Each distinct completed request, sent again alone (greedy): its tokens must be the same every time."""
        alone: dict[tuple, list] = {}
        mismatches = 0
        for key, tokens in self.completed:
            if key not in alone:
                how, prompt, n = key
                if how == "grpc":
                    alone[key] = list(self.client.generate(prompt, max_tokens=n, ignore_eos=True, timeout=120)
                                      .token_ids)
                else:
                    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
                    request = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(),
                                                     {"Content-Type": "application/json"})
                    with urllib.request.urlopen(request, timeout=120) as r:
                        alone[key] = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
            if tokens != alone[key]:
                mismatches += 1
                self.fail(f"{key}: {len(tokens)} tokens differ from the request alone")
        return mismatches

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of mixed load.")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-cache-blocks", type=int, default=64, help="A small pool, for preemption pressure.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-tokens", type=int, default=0, help="Prompt-lookup drafts per step (0: none).")
    p.add_argument("--rss-tolerance", type=float, default=1.25, help="RSS after / after warm-up allowed.")
    p.add_argument("--bad-requests-table", action="store_true", help="Only print each bad request's answer.")
    args = p.parse_args()
    soak = Soak(args)
    try:
        if args.bad_requests_table:
            print(soak.bad_requests_table())
            return
        code = soak.run()
    finally:
        soak.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
