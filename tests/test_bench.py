"""`trtbuild bench` on stories260K: exact token counts and sane statistics in-process and against a real `trtbuild
serve` subprocess, JSONL datasets, the same-run baselines (one-at-a-time, another engine, HF generate) as ratio lines,
and bad input answered by an `Error:` line. Nothing here is timed: the ratios are printed, never asserted."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from helpers import REPO, STORIES260K, require_shared_models

from trtbuild.bench.run import BenchOptions, run_bench
from trtbuild.bench.targets import hf_generate
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.cli import main
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

TIMEOUT = 60.0
KEYS = {"target", "threads", "concurrency", "request_rate", "num_requests", "completed", "failed", "first_error",
        "duration_s", "total_input_tokens", "total_output_tokens", "expected_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean",
        "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_mean", "e2e_ms_p50", "e2e_ms_p99", "kv_cache_usage_max",
        "kv_cache_usage_mean", "preemptions", "cached_prefix_tokens", "engine_steps", "engine_file_bytes",
        "kv_bytes_per_token", "sequential", "speedup_vs_sequential", "engine", "speedup_vs_engine", "hf",
        "speedup_vs_hf", "load_s", "warm_up_s", "kv_pool_bytes", "peak_rss_bytes", "lora"}
RATIO = r"^speedup vs {}: \d+\.\d\dx$"


@pytest.fixture(scope="module")
def engine(engine_from_hf) -> Path:
    require_shared_models()
    return engine_from_hf(STORIES260K, max_batch_size=32, max_num_tokens=512)  # the options test_server uses


def bench(*args: object) -> Result:
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def ok_json(result: Result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)  # stdout is exactly one JSON object (progress goes to stderr)


def assert_sane(r: dict, requests: int, input_len: int | None, output_len: int) -> None:
    assert (r["completed"], r["failed"], r["first_error"]) == (requests, 0, None)
    assert r["total_output_tokens"] == r["expected_output_tokens"] == requests * output_len
    if input_len is not None:
        assert r["total_input_tokens"] == requests * input_len
    for name in ("ttft", "tpot", "e2e"):
        assert 0 < r[f"{name}_ms_p50"] <= r[f"{name}_ms_p99"], name
        assert r[f"{name}_ms_mean"] > 0, name
    assert r["ttft_ms_p99"] <= r["e2e_ms_p99"] and r["ttft_ms_mean"] < r["e2e_ms_mean"]
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert r["request_throughput"] == pytest.approx(requests / r["duration_s"])
    assert 0 <= r["kv_cache_usage_mean"] <= r["kv_cache_usage_max"] <= 1
    assert r["preemptions"] == 0 and r["cached_prefix_tokens"] == 0


def test_synthetic_in_process_counts_percentiles_and_json(engine):
    r = run_bench(BenchOptions(engine=engine, num_requests=12, input_len=20, output_len=16, concurrency=6, threads=1))
    assert_sane(r, 12, 20, 16)
    assert r["kv_cache_usage_max"] > 0 and (r["threads"], r["concurrency"], r["request_rate"]) == (1, 6, math.inf)
    steps = r["engine_steps"]
    assert steps["decode_steps"] > 0 and steps["prefill_steps"] > 0
    assert steps["mean_decode_batch"] >= 2, f"the requests did not overlap: {steps}"  # at most 6 in flight
    assert steps["prefill_step_s"] + steps["decode_step_s"] <= r["duration_s"]
    assert 0 < steps["decode_engine_s"] < steps["decode_step_s"]  # the engine call is part of each step, not all
    assert r["sequential"] is r["hf"] is r["speedup_vs_sequential"] is r["speedup_vs_hf"] is None
    out = ok_json(bench("--engine", engine, "--num-requests", 4, "--input-len", 8, "--output-len", 5, "--threads", 1,
                        "--seed", 3, "--json"))
    assert set(out) == KEYS
    assert_sane(out, 4, 8, 5)
    assert out["request_rate"] == "inf" and out["target"] == f"engine {engine}" and out["lora"] is None


def test_jsonl_dataset_with_text_prompts_and_poisson_arrivals(engine, tmp_path):
    lines = [{"prompt": "Once upon a time", "output_tokens": 7}, {"input_ids": [1, 403, 407], "output_tokens": 5},
             {"prompt": "Lily went to the park", "output_tokens": 9}, {"prompt": "unused", "output_tokens": 3}]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(map(json.dumps, lines[:2])) + "\n\n" + "\n".join(map(json.dumps, lines[2:])) + "\n")
    llm = LLM(engine, RuntimeConfig(num_threads=1))
    prompt_tokens = sum(len(llm.core.make_request(x.get("prompt") or x.get("input_ids"), SamplingParams()).prompt_ids)
                        for x in lines[:3])
    result = bench("--engine", engine, "--dataset", data, "--num-requests", 3, "--request-rate", 200, "--threads", 1)
    assert result.exit_code == 0, (result.output, result.exception)
    text = result.stdout
    assert "requests:                     3 completed, 0 failed" in text
    assert f"input / output tokens:        {prompt_tokens} / 21 (output asked: 21)" in text
    assert "load:                         concurrency unlimited, request rate 200/s" in text
    for label in ("request throughput", "output token throughput", "TTFT (ms)", "TPOT (ms)", "KV cache usage",
                  "preemptions", "engine steps", "host share of decode steps"):
        assert re.search(rf"^{re.escape(label)}:", text, re.M), label
    assert "speedup" not in text


def test_compare_sequential_prints_a_ratio(engine):
    result = bench("--engine", engine, "--num-requests", 6, "--input-len", 12, "--output-len", 10, "--threads", 1,
                   "--concurrency", 6, "--compare-sequential")
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(RATIO.format("one-at-a-time"), result.stdout, re.M), result.stdout
    assert "running the same requests one at a time" in result.stderr
    r = run_bench(BenchOptions(engine=engine, num_requests=4, input_len=12, output_len=6, threads=1,
                               compare_sequential=True))
    seq = r["sequential"]
    assert_sane(seq, 4, 12, 6)  # no prefix reused from the first run: the cache is reset between runs
    assert seq["engine_steps"]["mean_decode_batch"] == 1
    assert r["speedup_vs_sequential"] == pytest.approx(r["output_throughput"] / seq["output_throughput"])


def test_compare_hf_prints_a_ratio_and_does_the_same_work(engine):
    result = bench("--engine", engine, "--num-requests", 4, "--input-len", 8, "--output-len", 8, "--threads", 1,
                   "--compare-hf", STORIES260K)
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(RATIO.format(r"HF generate \(batched\)"), result.stdout, re.M), result.stdout
    assert "batch 4, 1 torch threads" in result.stdout
    # The baseline generates what the engine generates: left-padded batch, greedy, exact length (HF folder or GGUF).
    prompts = ["Once upon a time", "Lily went to the park"]
    expected = [c.token_ids for c in LLM(engine, RuntimeConfig(num_threads=1)).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    for model in (STORIES260K, STORIES260K / "stories260K-f32.gguf"):
        hf = hf_generate(model, prompts, 8, threads=1)
        assert hf["token_ids"] == expected and hf["output_tokens"] == 16 and hf["batch_size"] == 2, model


def test_rounds_alternate_the_runs_and_report_median_ratios(engine):
    """--rounds 3: the engine and its baseline run three times, alternating; each round keeps its own ratio and the
    headline speedup is their median, printed with the rounds."""
    r = run_bench(BenchOptions(engine=engine, num_requests=3, input_len=8, output_len=5, threads=1, concurrency=3,
                               compare_sequential=True, rounds=3))
    assert_sane(r, 3, 8, 5)
    rounds = r["rounds"]
    assert len(rounds) == 3 and rounds[0]["output_throughput"] == r["output_throughput"]
    for x in rounds:
        assert x["speedup_vs_engine"] is None and x["speedup_vs_hf"] is None and x["speedup_vs_sequential"] > 0
    ratios = sorted(x["speedup_vs_sequential"] for x in rounds)
    assert r["speedup_vs_sequential"] == ratios[1]
    result = bench("--engine", engine, "--num-requests", 2, "--input-len", 4, "--output-len", 3, "--threads", 1,
                   "--compare-sequential", "--rounds", 2)
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(r"^  speedup vs sequential: \d+\.\d\d \d+\.\d\d \(median \d+\.\d\dx\)$", result.stdout, re.M)
    assert result.stderr.count("running the same requests one at a time") == 2
    assert "rounds" not in ok_json(bench("--engine", engine, "--num-requests", 1, "--input-len", 4, "--output-len",
                                         2, "--threads", 1, "--json"))
    assert_user_error(bench("--engine", engine, "--num-requests", 1, "--input-len", 4, "--output-len", 2,
                            "--rounds", 0), r"Invalid value for '--rounds'")


def test_compare_engine_runs_the_same_requests_and_prints_size_ratios(engine, tmp_path, llama_engine):
    """The same engine with an int8 KV cache as the compared one: same work, a quarter of the KV bytes per token."""
    from quant_helpers import calibrate, quantize_checkpoint

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert

    convert(STORIES260K, tmp_path / "ckpt")
    amax = calibrate(STORIES260K, list(range(3, 200)))
    kv8 = build_engine(quantize_checkpoint(tmp_path / "ckpt", tmp_path / "kv8", None, "int8", amax),
                       tmp_path / "engine", max_seq_len=256, tokens_per_block=8, max_batch_size=32,
                       max_num_tokens=512)
    r = run_bench(BenchOptions(engine=kv8, num_requests=4, input_len=10, output_len=6, threads=1,
                               compare_engine=engine))
    other = r["engine"]
    assert other["target"] == f"engine {engine}"
    assert_sane(other, 4, 10, 6)
    assert r["kv_bytes_per_token"] * 4 == other["kv_bytes_per_token"] == 5 * 2 * 4 * 8 * 4  # layers, K+V, heads, dim
    assert r["engine_file_bytes"] == read_engine_config(kv8).engine_bytes
    assert r["speedup_vs_engine"] == pytest.approx(r["output_throughput"] / other["output_throughput"])
    text = bench("--engine", kv8, "--num-requests", 2, "--input-len", 8, "--output-len", 4, "--threads", 1,
                 "--compare-engine", engine).stdout
    assert re.search(r"^vs compared engine: \d+\.\d\dx output tok/s, \d+\.\d\dx TPOT p50 speed, \d\.\d\dx engine "
                     r"file, 0\.25x KV bytes per token$", text, re.M), text
    assert re.search(r"^engine file / KV per token: +\d+\.\d MB / 320 bytes$", text, re.M), text
    assert_user_error(bench("--engine", kv8, "--num-requests", 2, "--input-len", 4, "--output-len", 2,
                            "--compare-engine", llama_engine), r"vocabulary of \d+ tokens, not 512")
    assert_user_error(bench("--address", "127.0.0.1:1", "--num-requests", 2, "--input-len", 4, "--output-len", 2,
                            "--compare-engine", engine), r"give --engine DIR too")


def test_bench_against_a_real_server_gives_the_same_token_count(engine, tmp_path, request):
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(engine), "--port", "0",
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=log, text=True)
    request.addfinalizer(lambda: (proc.kill(), proc.wait(TIMEOUT)))
    listening, address = threading.Event(), []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("trtbuild serve listening on "):
                address.append(line.split()[-1])
                listening.set()
        listening.set()  # exited

    threading.Thread(target=read, daemon=True).start()
    assert listening.wait(TIMEOUT) and address, (tmp_path / "serve.log").read_text()
    assert address[0].startswith("127.0.0.1:")
    args = ("--num-requests", 6, "--input-len", 16, "--output-len", 10, "--concurrency", 3, "--json")
    remote = ok_json(bench("--address", address[0], *args))
    local = ok_json(bench("--engine", engine, "--threads", 1, *args))
    assert_sane(remote, 6, 16, 10)
    assert remote["total_output_tokens"] == local["total_output_tokens"] == 60
    assert remote["target"] == f"server {address[0]}" and remote["engine_steps"] is None and remote["threads"] is None
    assert set(remote) == KEYS and remote["engine_file_bytes"] is remote["kv_bytes_per_token"] is None
    assert remote["load_s"] is None and local["load_s"] > 0 and local["peak_rss_bytes"] > 0


def assert_user_error(result: Result, pattern: str) -> None:
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr


def test_bad_input_is_a_click_error(engine, tmp_path):
    synthetic = ("--num-requests", 2, "--input-len", 4, "--output-len", 2)
    assert_user_error(bench("--engine", engine, "--dataset", tmp_path / "nowhere.jsonl"),
                      r"Invalid value for '--dataset'.*does not exist")
    bad = tmp_path / "bad.jsonl"
    for content, pattern in (('{"prompt": "hi", "output_tokens": 4}\n{"prompt": "hi", output_tokens: 4}\n',
                              r"line 2 of .*bad\.jsonl: not JSON"),
                             ('\n\n{"prompt": "hi", "output_tokens": 0}\n', r"line 3 of .*output_tokens must be"),
                             ('{"prompt": "hi", "input_ids": [1], "output_tokens": 2}\n', r"line 1 .*exactly one of"),
                             ('{"input_ids": [], "output_tokens": 2}\n', r"line 1 .*non-empty"),
                             ('["hi", 4]\n', r"line 1 .*expected an object"),
                             ('{"prompt": "hi", "max_tokens": 2}\n', r"line 1 .*unknown keys \['max_tokens'\]"),
                             ("\n", r"holds no requests")):
        bad.write_text(content)
        assert_user_error(bench("--engine", engine, "--dataset", bad), pattern)
    assert_user_error(bench("--engine", engine, "--address", "127.0.0.1:1", *synthetic), r"exactly one target")
    assert_user_error(bench(*synthetic), r"exactly one target: --engine DIR .* or --address")
    assert_user_error(bench("--engine", engine, "--num-requests", 2, "--input-len", 4), r"give --dataset FILE, or")
    bad.write_text('{"prompt": "hi", "output_tokens": 2}\n')
    assert_user_error(bench("--engine", engine, "--dataset", bad, "--output-len", 2), r"do not combine")
    assert_user_error(bench("--engine", engine, "--num-requests", 1, "--input-len", 250, "--output-len", 10),
                      r"synthetic request 0: 250 prompt \+ 10 output tokens exceed the engine's max_seq_len 256")
    assert_user_error(bench("--engine", engine, *synthetic, "--timeout", 1e-6),
                      r"warm-up request to engine .* failed: timed out")
    assert_user_error(bench("--engine", engine, *synthetic, "--concurrency", 0), r"Invalid value for '--concurrency'")
    assert_user_error(bench("--address", "127.0.0.1:1", *synthetic, "--kv-cache-blocks", 8),
                      r"--kv-cache-blocks sizes an in-process engine's pool.*trtbuild serve --kv-cache-blocks")


def test_kv_cache_blocks_sizes_the_in_process_pool(engine):
    """`--kv-cache-blocks N`: the engine's pool holds exactly N blocks (peers.py sizes it as llama.cpp's context)."""
    from trtbuild.builder.engine_dir import read_engine_config

    out = ok_json(bench("--engine", engine, "--num-requests", 3, "--input-len", 8, "--output-len", 4, "--threads", 1,
                        "--kv-cache-blocks", 9, "--json"))
    assert_sane(out, 3, 8, 4)
    assert out["kv_pool_bytes"] == 9 * read_engine_config(engine).kv_cache_bytes_per_block


def test_speculative_decoding_reports_accepted_drafts(engine, tmp_path):
    """A prompt the story model continues by repeating itself: prompt lookup drafts get accepted, and the decode
    steps carry one sampled token per sequence plus drafts (not counted as prefill)."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "Tom had a big red ball. Tom had a big red ball. Tom", "output_tokens": 60}))
    result = bench("--engine", engine, "--dataset", data, "--threads", 1, "--speculative-tokens", 4, "--json")
    r = ok_json(result)
    steps = r["engine_steps"]
    assert r["target"].endswith("(ngram drafts 4)") and r["total_output_tokens"] == 60
    assert 0 < steps["accepted_draft_tokens"] <= steps["draft_tokens"]
    assert steps["prefill_steps"] == 1 and steps["mean_decode_batch"] == 1
    assert steps["steps"] == 60 - steps["accepted_draft_tokens"]  # every accepted draft saves one step
    text = bench("--engine", engine, "--dataset", data, "--threads", 1, "--speculative-tokens", 4).stdout
    assert re.search(r"^speculative drafts: +\d+ of \d+ accepted \(\d+\.\d%\)$", text, re.M), text
    refused = bench("--address", "127.0.0.1:1", "--dataset", data, "--speculative-tokens", 2)
    assert refused.exit_code != 0 and "trtbuild serve --speculative-tokens" in refused.output
    # the engine drafting for itself (--draft-engine): every draft is accepted, so each step yields K + 1 tokens
    r = ok_json(bench("--engine", engine, "--dataset", data, "--threads", 1, "--speculative-tokens", 4,
                      "--draft-engine", engine, "--json"))
    steps = r["engine_steps"]
    assert r["target"].endswith("(draft_model drafts 4)") and r["total_output_tokens"] == 60
    assert steps["accepted_draft_tokens"] == steps["draft_tokens"] and steps["steps"] == 1 + 59 // 5 + 1


@pytest.mark.parametrize(("llama", "why"), [("absent", "missing: llama.cpp (no llama-bench"),
                                            ("sigill", "(exit 132)")])
def test_peers_benchmark_smoke_reports_trtbuild_and_a_missing_peer(llama, why, tmp_path):
    """benchmarks/peers.py in its CI mode: trtbuild measured from the GGUF file, llama.cpp reported missing: absent,
    or dying on an illegal instruction (a native build using AMX where the VM does not enable it), with what to do."""
    require_shared_models()
    gguf = STORIES260K / "stories260K-f32.gguf"
    bin_dir = tmp_path / "bin"
    if llama == "sigill":
        bin_dir.mkdir()
        for tool in ("llama-bench", "llama-batched-bench"):
            (bin_dir / tool).write_text("#!/bin/sh\nkill -ILL $$\n")
            (bin_dir / tool).chmod(0o755)
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers.py"), "--gguf", str(gguf), "--smoke",
                          "--threads", "1", "--llama-bin", str(bin_dir), "--work", str(tmp_path / "w"),
                          "--json", str(tmp_path / "peers.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| decode_tok_s |" in out.stdout and why in out.stdout
    assert (llama == "sigill") == ("rebuild it without AMX" in out.stdout)
    medians = json.loads((tmp_path / "peers.json").read_text())["medians"]
    assert set(medians) == {"trtbuild"}
    assert all(value > 0 for value in medians["trtbuild"].values()), medians


@pytest.mark.parametrize(("system", "prompts", "cached"), [(0, [20, 52, 84], [0, 16, 48]), (20, [40] * 3, [0, 16, 16])])
def test_conversation_benchmark_reports_each_turn(system, prompts, cached, tmp_path):
    """benchmarks/conversation.py with tiny lengths and no llama-server: each turn's prompt repeats the last one and
    its answer (or, with --system, starts with the same system prompt), and takes them from the cache (this Llama's
    prefix blocks of 16; a recurrent model's kept states)."""
    require_shared_models()
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "conversation.py"), "--gguf",
                          str(STORIES260K / "stories260K-f32.gguf"), "--turns", "3", "--user", "20", "--answer", "12",
                          "--system", str(system), "--rounds", "1", "--threads", "1", "--llama-bin",
                          str(tmp_path / "bin"), "--work", str(tmp_path / "w"), "--json", str(tmp_path / "c.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama.cpp: missing" in out.stdout and "trtbuild vs trtbuild, no snapshots" in out.stdout
    medians = json.loads((tmp_path / "c.json").read_text())["medians"]
    assert (medians["trtbuild"]["prompt"], medians["trtbuild"]["cached"]) == (prompts, cached)


def test_step_profile_splits_a_decode_step_by_op_type(engine):
    """benchmarks/step_profile.py: ONNX Runtime's profile of decode steps (CpuEngine(profile_prefix=...)), per op
    type, with the attention op among them."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_profile.py"), str(engine), "--batch", "2",
                          "--context", "8", "--steps", "2", "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"^step [\d.]+ ms, in session.run [\d.]+ ms$", out.stdout, re.M), out.stdout
    assert re.search(r"^  PagedAttention +[\d.]+ ms +\d+ nodes$", out.stdout, re.M), out.stdout


def test_step_profile_by_node_folds_layer_numbers(engine):
    """`--by-node`: one line per node name with its layer number as `*`, so each layer's linears are told apart."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_profile.py"), str(engine), "--batch", "2",
                          "--context", "8", "--steps", "2", "--threads", "1", "--by-node"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    layers = read_engine_config(engine).model.num_hidden_layers
    assert re.search(rf"^  transformer\.layers\.\*\.attention\.paged +[\d.]+ ms +{layers} nodes$", out.stdout,
                     re.M), out.stdout
    assert not re.search(r"layers\.\d", out.stdout), out.stdout
