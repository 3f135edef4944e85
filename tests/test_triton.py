"""Triton Inference Server: `trtbuild triton-repo` writes the model repository, `trtbuild triton-serve` runs the real
tritonserver bundled in nvidia-pytriton on loopback, and tritonclient (gRPC streaming) and plain HTTP (generate,
generate_stream) drive it; outputs are checked against in-process greedy generation (`LLM`) of each request alone.
Server tests are skipped, saying why, when nvidia-pytriton or tritonclient is not installed."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import STORIES260K, alone, require_shared_models
from triton_helpers import TIMEOUT, Stream, TritonServer, grpc_inputs, write_repo

from trtbuild.cli import main as cli
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.speculative import SpeculativeConfig
from trtbuild.serving.triton_backend import launcher
from trtbuild.serving.triton_backend.repository import runtime_options
from trtbuild.serving.triton_backend.tensors import INPUTS, check_output_len, parse_request

PROMPTS = [f"{n} went to the {p}" for n in ("Lily", "Tom", "Sue", "Ben") for p in ("park", "sea", "shop", "forest")]
LONG = dict(max_tokens=240, ignore_eos=True)


# ---- without a server -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(engine_from_hf) -> Path:
    require_shared_models()
    return engine_from_hf(STORIES260K, max_batch_size=16, max_num_tokens=512)


def test_triton_repo_writes_a_python_model_with_runtime_parameters(engine, tmp_path):
    run = CliRunner().invoke
    out = run(cli, ["triton-repo", "--engine", str(engine), "--output", str(tmp_path), "--no-decoupled",
                    "--kv-cache-blocks", "64", "--policy", "guaranteed_no_evict", "--no-prefix-caching",
                    "--max-batch-size", "8", "--threads", "1", "--speculative-tokens", "3"])
    assert out.exit_code == 0, out.output
    config = (tmp_path / "trtbuild" / "config.pbtxt").read_text()
    model_py = (tmp_path / "trtbuild" / "1" / "model.py").read_text()
    assert "from trtbuild.serving.triton_backend.model import TritonPythonModel" in model_py
    for line in ('backend: "python"', "max_batch_size: 8", "decoupled: false", "dynamic_batching { }"):
        assert line in config, line
    assert all(f'name: "{t.name}"' in config for t in INPUTS)
    params = re.findall(r'parameters: \{ key: "(\w+)", value: \{ string_value: "(.*)" \} \}', config)
    engine_dir, runtime = runtime_options({k: {"string_value": v} for k, v in params})  # as model.py reads them
    assert engine_dir == engine.resolve()
    assert runtime == RuntimeConfig(kv_cache_blocks=64, policy="guaranteed_no_evict", enable_prefix_caching=False,
                                    max_batch_size=8, num_threads=1, speculative=SpeculativeConfig(3))
    assert [k for k, _ in params] == ["engine_dir", *RuntimeConfig().to_parameters()]  # one name per knob
    again = run(cli, ["triton-repo", "--engine", str(engine), "--output", str(tmp_path)])
    assert again.exit_code == 2 and "already exists" in again.output
    big = run(cli, ["triton-repo", "--engine", str(engine), "--output", str(tmp_path), "--model-name", "b",
                    "--max-batch-size", "64"])
    assert big.exit_code == 2 and "exceeds the engine's build limit 16" in big.output


def test_runtime_config_round_trips_through_parameters():
    full = RuntimeConfig(kv_cache_memory=0.25, kv_cache_blocks=7, policy="guaranteed_no_evict",
                         enable_prefix_caching=False, max_batch_size=3, max_num_tokens=96, max_prefill_chunk=32,
                         max_queue_size=9, num_threads=2, warm_up=False,
                         speculative=SpeculativeConfig(4, prompt_lookup_max=3, prompt_lookup_min=2))
    draft = RuntimeConfig(speculative=SpeculativeConfig(3, method="draft_model", draft_engine_dir="/engines/draft"))
    for config in (full, draft, RuntimeConfig()):
        assert RuntimeConfig.from_parameters(config.to_parameters()) == config
    assert RuntimeConfig.from_parameters({"max_batch_size": "", "num_speculative_tokens": "0"}) == RuntimeConfig()
    for params, message in (({"max_batch_size": "many"}, "max_batch_size must be a number"),
                            ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be true or false"),
                            ({"batch_scheduler_policy": "x"}, "batch_scheduler_policy is not a runtime option"),
                            ({"max_queue_size": "0"}, "max_queue_size must be at least 1")):
        with pytest.raises(ValueError, match=message):
            runtime_options({k: {"string_value": v} for k, v in {"engine_dir": "/e", **params}.items()})


def test_tensors_map_to_sampling_params():
    one = lambda v, t: np.array([[v]], dtype=t)  # noqa: E731 - [batch 1, 1]
    parsed = parse_request({"input_ids": np.array([[5, 6, 7, 0]], np.int32), "input_lengths": one(3, np.int32),
                            "request_output_len": one(9, np.int32), "end_id": one(13, np.int32),
                            "stop_words": np.array([[b"", b"."]], object), "random_seed": one(7, np.uint64),
                            "streaming": one(True, bool), "return_log_probs": one(True, bool)}, vocab_size=512)
    p = parsed.params
    assert (parsed.prompt_ids, p.max_tokens, p.stop_token_ids, p.ignore_eos, p.stop, p.seed, p.logprobs) == (
        [5, 6, 7], 9, (13,), True, (".",), 7, 0)
    assert parsed.stream and parsed.return_log_probs
    with pytest.raises(ValueError, match="end_id must be a token id in"):
        parse_request({"text_input": np.array([[b"x"]], object), "end_id": one(512, np.int32)}, vocab_size=512)
    with pytest.raises(ValueError, match="stop_words must be UTF-8 text"):
        parse_request({"text_input": np.array([[b"x"]], object), "stop_words": np.array([[b"\xff"]], object)})
    huge = parse_request({"text_input": np.array([[b"x"]], object), "max_tokens": one(2**40, np.int64)})
    assert (huge.params.max_tokens, huge.max_tokens_input) == (2**40, "max_tokens")  # whole, not wrapped
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 250\] .* got 1099511627776"):
        check_output_len(huge, prompt_len=6, max_seq_len=256)
    with pytest.raises(ValueError, match="batch size must be 1"):
        parse_request({"text_input": np.array([[b"x"], [b"y"]], object)})
    lora = {"text_input": np.array([[b"x"]], object), "lora_name": np.array([[b"sql"]], object)}
    assert parse_request(lora, lora_names=("sql", "poem")).lora == "sql"
    assert parse_request({**lora, "lora_name": np.array([[b""]], object)}, lora_names=()).lora is None  # the base
    with pytest.raises(ValueError, match="lora_name: this engine has no LoRA adapter 'sql'; it was built without"):
        parse_request(lora, lora_names=())


def test_triton_serve_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "PYTRITON_PACKAGE", "no_such_pytriton_package")
    out = CliRunner().invoke(cli, ["triton-serve", "--repo", str(tmp_path)])
    assert out.exit_code == 2 and "tritonserver not found" in out.output and "pip install" in out.output


# ---- a real server --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(engine, tmp_path_factory, request) -> TritonServer:
    repo = write_repo(engine, tmp_path_factory.mktemp("triton_repo"), ["--threads", "1"],
                      ["--model-name", "trtbuild_sync", "--no-decoupled", "--threads", "1"])
    shm_before = sorted(os.listdir("/dev/shm"))
    server = TritonServer(repo, tmp_path_factory.mktemp("triton_logs") / "server.log")
    request.addfinalizer(server.stop)
    assert server.ready.wait(TIMEOUT) and server.proc.poll() is None, f"{server.lines}\n{server.log.read_text()}"
    server.shm_before = shm_before
    return server


@pytest.fixture(scope="module")
def llm(engine) -> LLM:
    return LLM(engine, RuntimeConfig(num_threads=1))


def test_16_concurrent_grpc_streams_equal_each_request_alone(server, llm):
    expected = [alone(llm, p, max_tokens=40) for p in PROMPTS]
    running, done = [], threading.Event()

    def watch() -> None:
        while not done.wait(0.01):
            running.append(server.gauges().get("req_running", 0))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    streams = [Stream(server) for _ in PROMPTS]  # 16 clients, one inflight batch
    barrier = threading.Barrier(len(PROMPTS))

    def one(i: int) -> tuple:
        barrier.wait(TIMEOUT)
        streams[i].send(text_input=PROMPTS[i], max_tokens=40, stream=True)
        return streams[i].collect()

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(one, range(len(PROMPTS))))
    finally:
        done.set()
        watcher.join(TIMEOUT)
        for s in streams:
            s.close()
    for prompt, (tokens, text, reason), (got, got_text, got_reason, n) in zip(PROMPTS, expected, results, strict=True):
        assert (got, got_text, got_reason) == (tokens, text, reason), prompt
        assert n == len(tokens)  # streamed: one response per token
    assert max(running) >= 8, f"the requests did not run batched: {running}"
    server.wait_gauges(lambda g: g["kv_free"] == g["kv_max"] and g["req_active"] == 0)


def test_http_generate_and_generate_stream_equal_the_runtime(server, llm):
    prompt = "Once upon a time"
    tokens, text, reason = alone(llm, prompt, max_tokens=30)
    status, body = server.post("/v2/models/trtbuild/generate_stream", {"text_input": prompt, "max_tokens": 30,
                                                                        "stream": True, "return_log_probs": True})
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) == len(tokens)
    ids = [e["output_ids"] for e in events]  # one token per event (a scalar in the JSON)
    assert (ids, "".join(e["text_output"] for e in events), events[-1]["finish_reason"]) == (tokens, text, reason)
    assert all(e["output_log_probs"] <= 0 for e in events)
    assert events[-1]["cum_log_probs"] == pytest.approx(sum(e["output_log_probs"] for e in events), rel=1e-5)
    prompt_ids = llm.core.tokenizer.encode(prompt)
    for model in ("trtbuild", "trtbuild_sync"):  # one response; the input is in the output unless excluded
        status, body = server.post(f"/v2/models/{model}/generate", {"text_input": prompt, "max_tokens": 30})
        out = json.loads(body)
        assert status == 200 and (out["text_output"], out["output_ids"], out["finish_reason"]) == (
            prompt + text, prompt_ids + tokens, reason)
        assert out["sequence_length"] == len(prompt_ids) + len(tokens)
        status, body = server.post(f"/v2/models/{model}/generate", {"input_ids": prompt_ids, "request_output_len": 30,
                                                                    "exclude_input_in_output": True})
        assert status == 200 and (json.loads(body)["output_ids"], json.loads(body)["text_output"]) == (tokens, text)
    cases = [dict(stop_words=["."], max_tokens=60), dict(end_id=269, min_tokens=2, bad_words=["Lily"]),
             dict(temperature=0.9, top_k=40, top_p=0.9, random_seed=7, max_tokens=30)]
    for case in cases:  # non-decoupled: requests sent together join one execute() (the dynamic batcher's)
        with ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(lambda p, case=case: server.post("/v2/models/trtbuild_sync/generate", {
                "text_input": p, "exclude_input_in_output": True, **case}), PROMPTS[:4]))
        sampling = {{"stop_words": "stop", "random_seed": "seed", "end_id": "stop_token_ids"}.get(k, k): v
                    for k, v in case.items()}
        if "stop_token_ids" in sampling:
            sampling.update(stop_token_ids=[sampling["stop_token_ids"]], ignore_eos=True)
        for p, (status, body) in zip(PROMPTS[:4], bodies, strict=True):
            exp_tokens, exp_text, exp_reason = alone(llm, p, **sampling)
            out = json.loads(body)
            assert status == 200 and (out["output_ids"], out["text_output"], out["finish_reason"]) == (
                exp_tokens, exp_text, exp_reason), case
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http}/v2/models/trtbuild_sync/stats", timeout=TIMEOUT) as r:
        stats = json.load(r)["model_stats"][0]
    assert stats["execution_count"] < stats["inference_count"], stats  # some execute() calls got several requests


def test_a_cancelled_stream_stops_and_frees_its_kv_blocks(server):
    before = server.gauges()
    load = [Stream(server) for _ in range(7)]  # other long requests keep the batch busy while one is cancelled
    victim = Stream(server)
    try:
        for s in load:
            s.send(text_input="Once upon a time", stream=True, **LONG)
        victim.send(text_input="Tom went to the sea", stream=True, **LONG)
        result, error = victim.next()
        assert error is None and result.as_numpy("output_ids").size == 1
        server.wait_gauges(lambda g: g["kv_used"] > 0 and g["req_active"] == 8)  # running: they hold blocks
        victim.client.stop_stream(cancel_requests=True)
        server.wait_gauges(lambda g: g["req_cancelled"] == before["req_cancelled"] + 1)
        assert [s.collect()[2] for s in load] == ["length"] * 7  # the others were not disturbed
    finally:
        for s in [*load, victim]:
            s.close()
    # NOTE: a worker counts its request as completed just after the engine lets it go (and an earlier test's last
    # counts may land after `before` was read): wait until all 8 are counted, with the pool full and nothing active.
    server.wait_gauges(lambda g: g["kv_free"] == g["kv_max"] and g["req_active"] == 0
                       and g["req_completed"] >= before["req_completed"] + 8)
    status, body = server.post("/v2/models/trtbuild/generate", {"text_input": "Once upon a time", **LONG})
    assert status == 200 and json.loads(body)["finish_reason"] == "length"  # the full pool serves a long request


BAD = [  # (inputs, message) over gRPC streaming and HTTP generate
    (dict(text_input="Once", top_p=0.0), "top_p must be in (0, 1]"),
    (dict(text_input=""), "text_input is empty"),
    (dict(max_tokens=4), "send exactly one of text_input (text) and input_ids (token ids), got neither"),
    (dict(text_input="Once", input_ids=[1, 2]), "got both"),
    (dict(text_input="Once", max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(text_input="Once", temperature=-1.0), "temperature must be a number >= 0"),
    (dict(text_input="Once", end_id=9999), "end_id must be a token id in [0, 512)"),
    (dict(text_input="Once", beam_width=2), "beam_width must be 1: this backend returns one sequence"),
    (dict(text_input="Once", min_tokens=9, max_tokens=4), "min_tokens must be <= max_tokens"),
    (dict(input_ids=[1, 600]), "input_ids: ids [600] are outside the vocabulary [0, 512)"),
    (dict(input_ids=[1] + [300] * 299), "the engine's max_seq_len is 256"),
    # 64-bit values arrive whole (INT64 inputs) and are range-checked; under INT32 they were wrapped
    (dict(input_ids=[1, 4294967396]), "input_ids: ids [4294967396] are outside the vocabulary [0, 512)"),
    (dict(input_ids=[1, 2**40]), "input_ids: ids [1099511627776] are outside the vocabulary [0, 512)"),
    (dict(text_input="Once", max_tokens=4294967301),
     "max_tokens must be in [1, 254] (the engine's max_seq_len 256 minus the prompt's 2 tokens), got 4294967301"),
    (dict(input_ids=[1, 2, 3], request_output_len=2**31), "request_output_len must be in [1, 253]"),
]


def test_bad_inputs_get_errors_naming_the_tensor(server):
    stream = Stream(server)
    try:
        for fields, message in BAD:
            stream.send(**fields)
            with pytest.raises(Exception) as e:
                stream.collect()
            assert message in str(e.value), (fields, str(e.value))
            status, body = server.post("/v2/models/trtbuild_sync/generate", fields)
            assert status == 400 and message in json.loads(body)["error"], (fields, body)
    finally:
        stream.close()
    status, body = server.post("/v2/models/trtbuild_sync/generate", {"text_input": "Once", "stream": True})
    assert status == 400 and "only supported if the model is deployed in decoupled mode" in body
    status, body = server.post("/v2/models/trtbuild/generate", {"text_input": "Once", "max_tokenz": 3})
    assert status == 400 and "unknown inputs ['max_tokenz']" in body  # not silently ignored
    stream = Stream(server)
    try:
        inputs = grpc_inputs(text_input="Once", temperature=1.0)
        inputs[1]._input.name = "max_tokens"  # FP32 data under an INT32 tensor's name: Triton's own check
        stream.client.async_stream_infer("trtbuild", inputs)
        with pytest.raises(Exception, match="input 'max_tokens' data-type is 'FP32', but model 'trtbuild' expects"):
            stream.collect()
    finally:
        stream.close()
    for model in ("trtbuild", "trtbuild_sync"):  # the values of issue 15 over Triton's HTTP API, both models
        for body, code, message in (
                ({"input_ids": [1, 4294967396]}, 400, "ids [4294967396] are outside the vocabulary"),
                ({"input_ids": [1, 2**40]}, 400, "ids [1099511627776] are outside the vocabulary"),
                ({"text_input": "Once", "max_tokens": 4294967301}, 400, "max_tokens must be in [1, 254]"),
                # NOTE: beyond int64 Triton's JSON parser refuses the request itself (500, before the model sees it)
                ({"text_input": "Once", "max_tokens": 2**64}, 500, "Unable to parse 'data'")):
            status, text = server.post(f"/v2/models/{model}/generate", body)
            assert status == code and message in json.loads(text)["error"], (model, body, text)
    status, body = server.post("/v2/models/trtbuild_sync/infer", {"inputs": [  # /infer: INT32 is no longer wrapped
        {"name": "input_ids", "datatype": "INT32", "shape": [1, 2], "data": [1, 4294967396]}]})
    assert status == 400 and "data-type is 'INT32', but model 'trtbuild_sync' expects 'INT64'" in body
    status, body = server.post("/v2/models/trtbuild/generate", {"text_input": "Once", "max_tokens": 3})
    assert status == 200 and json.loads(body)["sequence_length"] > 3  # the stub survived every error


def test_sigterm_stops_the_server_cleanly_leaving_no_shared_memory(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(TIMEOUT) == 0, server.log.read_text()[-3000:]
    assert "triton-serve: tritonserver exited with code 0" in server.lines[-1]
    assert server.log.read_text().count("trtbuild: engine loop stopped") == 2  # finalize() of both models
    assert sorted(os.listdir("/dev/shm")) == server.shm_before


# ---- LoRA adapters --------------------------------------------------------------------------------------------------
def test_lora_name_runs_the_request_under_that_adapter(lora_engine, tmp_path_factory):
    """lora_name picks one of the engine's adapters: the output equals the in-process LLM's under it (gRPC streaming
    and HTTP generate); absent is the base model; an unknown name is an error response naming it."""
    repo = write_repo(lora_engine, tmp_path_factory.mktemp("triton_lora_repo"), ["--threads", "1"])
    llm = LLM(lora_engine, RuntimeConfig(num_threads=1))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = {name: llm.generate([PROMPTS[0]], params, lora=name)[0] for name in (None, "sql", "poem")}
    assert expected["sql"].token_ids != expected[None].token_ids != expected["poem"].token_ids
    server = TritonServer(repo, tmp_path_factory.mktemp("triton_lora_logs") / "server.log")
    stream = None
    try:
        assert server.ready.wait(TIMEOUT) and server.proc.poll() is None, f"{server.lines}\n{server.log.read_text()}"
        stream = Stream(server)
        for name, want in expected.items():
            lora = {"lora_name": name} if name else {}  # absent: the base model
            fields = dict(text_input=PROMPTS[0], max_tokens=30, ignore_eos=True, **lora)
            stream.send(stream=True, **fields)
            assert stream.collect()[:3] == (want.token_ids, want.text, "length"), name
            status, body = server.post("/v2/models/trtbuild/generate", {**fields, "exclude_input_in_output": True})
            out = json.loads(body)
            assert status == 200 and (out["output_ids"], out["text_output"]) == (want.token_ids, want.text), name
        message = "lora_name: this engine has no LoRA adapter 'chat'; it has sql, poem"
        stream.send(text_input="Once", lora_name="chat")
        with pytest.raises(Exception, match=re.escape(message)):
            stream.collect()
        status, body = server.post("/v2/models/trtbuild/generate", {"text_input": "Once", "lora_name": "chat"})
        assert status == 400 and message in json.loads(body)["error"], body
        server.wait_gauges(lambda g: g["kv_free"] == g["kv_max"] and g["req_active"] == 0)
    finally:
        if stream is not None:
            stream.close()
        server.stop()
