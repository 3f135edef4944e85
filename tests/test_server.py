"""`trtbuild serve` end to end: real server subprocesses on loopback (port 0), driven through serving/grpc/client.py and
raw gRPC stubs, checked against in-process generation (`LLM`) of the same requests one at a time."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from helpers import STORIES260K, alone, assert_soak_passes, require_shared_models

from trtbuild.runtime.async_engine import EngineDeadError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.grpc.client import GenerationClient, make_request
from trtbuild.serving.grpc.proto import trtbuild_pb2 as pb
from trtbuild.serving.grpc.server import GenerationServer

NAMES = ["Lily", "Tom", "Sue", "Ben", "Max", "Amy", "Tim", "Mia"]
PLACES = ["park", "sea", "shop", "forest"]
PROMPTS = [f"{n} went to the {p}" for n in NAMES for p in PLACES]  # 32 different prompts
LONG = dict(max_tokens=230, ignore_eos=True)  # runs ~230 steps: long enough to be cancelled mid-stream
TIMEOUT = 60.0
REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class Server:
    """A `trtbuild serve` subprocess; stdout is read by a thread (the port comes from its first line)."""

    def __init__(self, engine: Path, log: Path, *args: str) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(engine), "--port", "0", "--threads", "1",
             *args], stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.lines: list[str] = []
        self.address = ""
        self._listening = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("trtbuild serve listening on "):
                self.address = line.split()[-1]
                self._listening.set()
        self._listening.set()  # exited

    def client(self) -> GenerationClient:
        assert self._listening.wait(TIMEOUT), "server did not print its address"
        assert self.address, f"server exited: {self.lines}\n{self.log.read_text()}"
        client = GenerationClient(self.address, timeout=TIMEOUT)
        client.wait_ready(TIMEOUT)
        return client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)


@pytest.fixture(scope="module")
def engine(engine_from_hf) -> Path:
    require_shared_models()
    return engine_from_hf(STORIES260K, max_batch_size=32, max_num_tokens=512)


@pytest.fixture(scope="module")
def servers(engine, tmp_path_factory, request) -> dict[str, Server]:
    """All servers start at once (they load in parallel); each is killed at the end of the module."""
    logs = tmp_path_factory.mktemp("server_logs")
    args = {"main": (), "tiny_kv": ("--kv-cache-blocks", "16", "--policy", "max_utilization"),
            "small_queue": ("--max-queue-size", "2"), "speculative": ("--speculative-tokens", "3")}
    started: dict[str, Server] = {}
    request.addfinalizer(lambda: [s.stop() for s in started.values()])
    for name, extra in args.items():
        started[name] = Server(engine, logs / f"{name}.log", *extra)
    return started


@pytest.fixture(scope="module")
def main(servers) -> GenerationClient:
    with servers["main"].client() as client:
        yield client


@pytest.fixture(scope="module")
def llm(engine) -> LLM:
    return LLM(engine, RuntimeConfig(num_threads=1))


def collect(responses) -> tuple[list[int], str, pb.GenerateResponse]:
    tokens, text, last = [], "", None
    for r in responses:
        tokens += r.token_ids
        text += r.text
        last = r
    return tokens, text, last


def wait_for(client: GenerationClient, ok: Callable[[pb.Stats], bool], timeout: float = 20.0) -> pb.Stats:
    deadline = time.monotonic() + timeout
    while not ok(stats := client.stats()):
        assert time.monotonic() < deadline, f"stats never reached the expected state: {stats}"
        time.sleep(0.02)
    return stats


def pool_is_full(s: pb.Stats) -> bool:
    return s.kv_free_blocks == s.kv_total_blocks and s.kv_cache_usage == 0 and s.num_unfinished == 0


def run_concurrently(client: GenerationClient, prompts: list[str], **sampling: object) -> list[tuple]:
    barrier = threading.Barrier(len(prompts))

    def one(prompt: str) -> tuple:
        barrier.wait(TIMEOUT)
        return collect(client.generate_stream(prompt, timeout=TIMEOUT, **sampling))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_32_concurrent_streams_equal_each_request_alone(main, llm):
    expected = [alone(llm, p, max_tokens=40) for p in PROMPTS]
    running, done = [], threading.Event()

    def watch() -> None:
        while not done.wait(0.005):
            running.append(main.stats().num_running)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results = run_concurrently(main, PROMPTS, max_tokens=40)
    done.set()
    watcher.join(TIMEOUT)
    for prompt, (tokens, text, reason), (got, got_text, last) in zip(PROMPTS, expected, results, strict=True):
        assert (got, got_text) == (tokens, text), prompt
        assert last.finished and last.finish_reason == REASONS[reason]
        assert last.usage.output_tokens == len(tokens) and last.usage.prompt_tokens == len(llm.core.make_request(
            prompt, SamplingParams()).prompt_ids)
        assert last.usage.HasField("ttft_s") and last.usage.HasField("queue_time_s")
    assert max(running) >= 8, f"the requests did not run batched: {running}"
    wait_for(main, pool_is_full)


def test_speculative_server_streams_multi_token_deltas_equal_to_alone(servers, llm):
    """Drafts accepted in a step reach the client as one delta of several tokens; the tokens, text, logprobs and
    usage are those of the same greedy request run alone without drafts."""
    prompts = ["Tom had a big red ball. Tom had a big red ball. Tom", *PROMPTS[:7]]
    expected = [alone(llm, p, max_tokens=40) for p in prompts]
    client = servers["speculative"].client()
    results = run_concurrently(client, prompts, max_tokens=40, logprobs=1)
    for prompt, (tokens, text, _), (got, got_text, last) in zip(prompts, expected, results, strict=True):
        assert (got, got_text) == (tokens, text), prompt
        assert last.usage.output_tokens == len(tokens)
    deltas = list(client.generate_stream(prompts[0], max_tokens=40, logprobs=1, timeout=TIMEOUT))
    assert max(len(d.token_ids) for d in deltas) > 1  # this prompt repeats itself: drafts were accepted
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [lp.token_id for d in deltas for lp in d.logprobs] == expected[0][0]
    wait_for(client, pool_is_full)


def test_tiny_kv_pool_preempts_and_still_returns_every_request(servers, llm):
    client = servers["tiny_kv"].client()
    info = client.model_info()
    assert (info.kv_cache_blocks, info.kv_cache_tokens, info.policy) == (16, 128, "max_utilization")
    assert "KV cache 16 blocks x 8 tokens = 128 tokens" in "\n".join(servers["tiny_kv"].lines)
    prompts = PROMPTS[::3]  # 11 requests of ~48 tokens (6 blocks) each against 16 blocks
    expected = [alone(llm, p, max_tokens=40) for p in prompts]
    results = run_concurrently(client, prompts, max_tokens=40)
    assert [(r[0], r[1]) for r in results] == [(e[0], e[1]) for e in expected]
    stats = wait_for(client, pool_is_full)
    assert stats.num_preemptions > 0 and sum(r[2].usage.num_preemptions for r in results) == stats.num_preemptions


def test_cancel_rpc_and_client_disconnect_return_the_kv_pool(main, servers):
    aborts = main.stats().finish_reasons["abort"]
    stream = main.generate_stream("Once upon a time", request_id="to-cancel", timeout=TIMEOUT, **LONG)
    first = next(stream)
    assert main.stats().kv_free_blocks < main.stats().kv_total_blocks  # the request holds blocks while it runs
    assert main.cancel("to-cancel") is True
    tokens, _, last = collect(stream)
    assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORT
    assert len(first.token_ids) + len(tokens) < LONG["max_tokens"]
    wait_for(main, pool_is_full)
    assert main.cancel("to-cancel") is False  # finished: nothing to cancel
    # A client that cancels its call, and one that closes its channel, mid-stream.
    stream = main.generate_stream("Once upon a time", timeout=TIMEOUT, **LONG)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as e:
        collect(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    other = servers["main"].client()
    stream = other.generate_stream("Once upon a time", timeout=TIMEOUT, **LONG)
    next(stream)
    other.close()
    wait_for(main, lambda s: pool_is_full(s) and s.finish_reasons["abort"] == aborts + 3)


BAD_INPUTS = [
    ("empty prompt", dict(prompt=""), "prompt is empty"),
    ("prompt and token ids", dict(prompt="Once", prompt_token_ids=[1, 2]),
     "send exactly one of prompt (text) and prompt_token_ids (token ids), got both"),
    ("neither prompt nor token ids", dict(), "got neither"),
    ("top_p 0", dict(prompt="Once", sampling=pb.SamplingOptions(top_p=0)), "top_p must be in (0, 1]"),
    ("temperature -1", dict(prompt="Once", sampling=pb.SamplingOptions(temperature=-1)), "temperature must be"),
    ("max_tokens 0", dict(prompt="Once", sampling=pb.SamplingOptions(max_tokens=0)), "max_tokens must be"),
    ("seed -1", dict(prompt="Once", sampling=pb.SamplingOptions(seed=-1)), "seed must be"),
    ("logprobs 21", dict(prompt="Once", sampling=pb.SamplingOptions(logprobs=21)), "logprobs must be"),
    ("token id beyond vocab", dict(prompt_token_ids=[1, 512]), "prompt_token_ids: ids [512] are outside"),
    ("stop token beyond vocab", dict(prompt="Once", sampling=pb.SamplingOptions(stop_token_ids=[9999])),
     "stop_token_ids must be token ids below the vocabulary size 512"),
    ("prompt longer than max_seq_len", dict(prompt_token_ids=[1] + [300] * 299), "max_seq_len is 256"),
    ("lora of an engine without adapters", dict(prompt="Once", lora="sql"),
     "lora: this engine has no LoRA adapter 'sql'; it was built without any"),
]


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_bad_inputs_are_invalid_argument_naming_the_field(main, rpc):
    def call(request: pb.GenerateRequest) -> object:
        result = getattr(main.stub, rpc)(request, timeout=TIMEOUT)
        return list(result) if rpc == "GenerateStream" else result

    for name, fields, message in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as e:
            call(pb.GenerateRequest(**fields))
        assert (e.value.code(), message in e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, True), name
    # request_id of an unfinished request: INVALID_ARGUMENT (see the status table in trtbuild.proto)
    stream = main.generate_stream("Once", request_id=f"dup-{rpc}", timeout=TIMEOUT, **LONG)
    next(stream)
    with pytest.raises(grpc.RpcError) as e:
        main.generate("Twice", request_id=f"dup-{rpc}", timeout=TIMEOUT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in e.value.details()
    assert main.cancel(f"dup-{rpc}") and collect(stream)[2].finish_reason == pb.FINISH_REASON_ABORT


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "Cancel"])
def test_a_malformed_request_body_is_invalid_argument_with_one_log_line(main, servers, method):
    identity = (lambda b: b)  # noqa: E731 - raw bytes on the wire
    call = (main.channel.unary_stream if method == "GenerateStream" else main.channel.unary_unary)(
        f"/trtbuild.v1.Generation/{method}", request_serializer=identity, response_deserializer=identity)
    with pytest.raises(grpc.RpcError) as e:
        result = call(b"\xff\xff\xff\xff garbage", timeout=TIMEOUT)
        list(result) if method == "GenerateStream" else result
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "not a valid /trtbuild.v1.Generation/" + method in e.value.details()
    assert main.generate("Once", timeout=TIMEOUT, max_tokens=2).usage.output_tokens == 2  # the server carries on
    log = servers["main"].log.read_text()
    assert f"{method}: malformed request" in log and "Traceback" not in log


def test_full_queue_is_resource_exhausted_then_sigterm_shuts_down_gracefully(servers):
    server = servers["small_queue"]
    client = server.client()
    streams = [client.generate_stream("Once upon a time", timeout=TIMEOUT, **LONG) for _ in range(2)]
    ids = [next(s).request_id for s in streams]  # both accepted and running: the queue (2) is full
    with ThreadPoolExecutor(6) as pool:
        errors = list(pool.map(lambda _: _error(lambda: client.generate("Hi", timeout=TIMEOUT, max_tokens=4)),
                               range(6)))
    assert all(e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.details()
               for e in errors), errors
    assert all(client.cancel(i) for i in ids) and [collect(s)[2].finish_reason for s in streams] == [3, 3]
    assert client.generate("Hi", timeout=TIMEOUT, max_tokens=4).finished  # room again
    # SIGTERM: the running stream ends (aborted), health stops SERVING, the process exits 0.
    stream = client.generate_stream("Once upon a time", timeout=TIMEOUT, **LONG)
    next(stream)
    server.proc.send_signal(signal.SIGTERM)
    assert collect(stream)[2].finish_reason == pb.FINISH_REASON_ABORT
    assert server.proc.wait(TIMEOUT) == 0 and "trtbuild serve: shutting down" in server.lines
    assert server.address.startswith("127.0.0.1:")  # loopback by default


def _error(call: Callable[[], object]) -> grpc.RpcError | None:
    try:
        call()
    except grpc.RpcError as e:
        return e
    return None


def test_health_reflection_model_info_and_unary_equals_stream(main, servers, llm):
    assert main.health_status() == main.health_status("") == "SERVING"
    db = ProtoReflectionDescriptorDatabase(main.channel)
    assert {"trtbuild.v1.Generation", "grpc.health.v1.Health"} <= set(db.get_services())
    assert db.FindFileContainingSymbol("trtbuild.v1.Generation").name.endswith("trtbuild.proto")
    info = main.model_info()
    assert (info.architecture, info.vocab_size, info.max_seq_len, info.max_batch_size, info.max_num_tokens) == (
        "LlamaForCausalLM", 512, 256, 32, 512)
    assert info.kv_cache_tokens == info.kv_cache_blocks * 8 > 0 and info.trtbuild_version and not info.lora_names
    cases = [dict(max_tokens=30), dict(temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=30, logprobs=3),
             dict(stop=["."], max_tokens=60), dict(stop_token_ids=[269], bad_words=["Lily"], min_tokens=2),
             dict(ignore_eos=True, max_tokens=50, repetition_penalty=1.3, include_stop_str_in_output=True)]
    for sampling in cases:
        tokens, text, last = collect(main.generate_stream("Once upon a time", timeout=TIMEOUT, **sampling))
        unary = main.generate("Once upon a time", timeout=TIMEOUT, **sampling)
        assert (list(unary.token_ids), unary.text, unary.finish_reason) == (tokens, text, last.finish_reason)
        assert unary.usage.output_tokens == last.usage.output_tokens == len(tokens)
        exp_tokens, exp_text, exp_reason = alone(llm, "Once upon a time", **sampling)
        assert (tokens, text, last.finish_reason) == (exp_tokens, exp_text, REASONS[exp_reason]), sampling
        if "logprobs" in sampling:
            assert [lp.token_id for lp in unary.logprobs] == tokens and all(len(lp.top) == 3 for lp in unary.logprobs)
    assert main.generate([1, 403, 407], timeout=TIMEOUT, max_tokens=5).usage.prompt_tokens == 3  # token-id prompt
    scored = main.generate([1, 403, 407, 300], timeout=TIMEOUT, max_tokens=2, prompt_logprobs=1)
    (want,) = llm.generate([[1, 403, 407, 300]], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert [(lp.token_id, len(lp.top)) for lp in scored.prompt_logprobs] == [(403, 1), (407, 1), (300, 1)]
    assert [lp.logprob for lp in scored.prompt_logprobs] == pytest.approx([w.logprob for w in want.prompt_logprobs[1:]])
    beams = main.generate("Once upon a time", timeout=TIMEOUT, max_tokens=8, beam_width=3, length_penalty=0.5)
    (want,) = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, beam_width=3, length_penalty=0.5))
    assert [(list(b.token_ids), b.text) for b in beams.beams] == [(list(b.token_ids), b.text) for b in want.beams]
    assert list(beams.token_ids) == list(want.beams[0].token_ids)
    expected = alone(llm, PROMPTS[0], max_tokens=20)[1]
    for extra in ([], ["--no-stream"]):
        out = subprocess.run([sys.executable, "-m", "trtbuild.cli", "client", "--address", main.address, "--prompt",
                              PROMPTS[0], "--max-tokens", "20", *extra], capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert (out.returncode, out.stdout) == (0, PROMPTS[0] + expected + "\n"), out.stderr
    out = subprocess.run([sys.executable, "-m", "trtbuild.cli", "client", "--address", main.address, "--prompt", "x",
                          "--top-k", "-1"], capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 2


def test_health_is_not_serving_until_the_engine_loads_and_a_dead_engine_is_unavailable(engine):
    server = GenerationServer(port=0, max_queue_size=4)
    try:
        with GenerationClient(server.address, timeout=TIMEOUT) as client:
            assert client.health_status() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as e:
                client.generate("Once", timeout=TIMEOUT)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in e.value.details()
            server.load(engine, RuntimeConfig(num_threads=1))
            client.wait_ready(TIMEOUT)
            assert client.generate("Once", timeout=TIMEOUT, max_tokens=3).usage.output_tokens == 3
            loaded, server.servicer.engine = server.servicer.engine, _DeadEngine()
            with pytest.raises(grpc.RpcError) as e:
                client.generate("Once", timeout=TIMEOUT)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine loop stopped" in e.value.details()
            assert client.health_status() == "NOT_SERVING"
            server.servicer.engine = loaded
            assert make_request([1, 2], stop=".").sampling.stop == ["."]
    finally:
        server.stop(grace=1.0)


class _DeadEngine:
    def submit(self, *args: object) -> None:
        raise EngineDeadError("the engine loop stopped: boom")


def test_an_api_key_guards_every_call_but_health_checks(engine):
    server = GenerationServer(port=0, max_queue_size=4, api_key="sekret")
    try:
        server.load(engine, RuntimeConfig(num_threads=1))
        with GenerationClient(server.address, timeout=TIMEOUT) as anonymous, \
                GenerationClient(server.address, timeout=TIMEOUT, api_key="wrong") as wrong, \
                GenerationClient(server.address, timeout=TIMEOUT, api_key="sekret") as keyed:
            assert anonymous.health_status() == "SERVING"  # probes need no secret
            for client in (anonymous, wrong):
                for call in (lambda c=client: c.generate("Once", timeout=TIMEOUT, max_tokens=2),
                             lambda c=client: list(c.generate_stream("Once", timeout=TIMEOUT, max_tokens=2)),
                             lambda c=client: c.cancel("x"), lambda c=client: c.stats(),
                             lambda c=client: c.model_info()):
                    e = _error(call)
                    assert e is not None and e.code() == grpc.StatusCode.UNAUTHENTICATED, call
            assert keyed.generate("Once", timeout=TIMEOUT, max_tokens=2).usage.output_tokens == 2
            assert keyed.stats().num_finished == 1 and not keyed.cancel("x")
    finally:
        server.stop(grace=1.0)


def test_a_request_runs_under_the_lora_adapter_it_names(lora_engine):
    """`lora` picks one of the engine's adapters: greedy output equals the in-process LLM's under that adapter (and
    differs from the base model's); unset is the base model; an unknown name is INVALID_ARGUMENT naming it."""
    llm = LLM(lora_engine, RuntimeConfig(num_threads=1))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = {name: llm.generate([PROMPTS[0]], params, lora=name)[0] for name in (None, "sql", "poem")}
    assert expected["sql"].token_ids != expected[None].token_ids != expected["poem"].token_ids
    server = GenerationServer(port=0, max_queue_size=4)
    try:
        server.load(lora_engine, RuntimeConfig(num_threads=1))
        with GenerationClient(server.address, timeout=TIMEOUT) as client:
            assert list(client.model_info().lora_names) == ["sql", "poem"]
            for name, want in expected.items():
                unary = client.generate(PROMPTS[0], lora=name, timeout=TIMEOUT, max_tokens=30, ignore_eos=True)
                tokens, text, _ = collect(client.generate_stream(PROMPTS[0], lora=name, timeout=TIMEOUT,
                                                                 max_tokens=30, ignore_eos=True))
                assert (list(unary.token_ids), unary.text) == (tokens, text) == (want.token_ids, want.text), name
            for call in (lambda: client.generate("Once", lora="chat", timeout=TIMEOUT),
                         lambda: list(client.generate_stream("Once", lora="chat", timeout=TIMEOUT))):
                e = _error(call)
                assert e is not None and (e.code(), e.details()) == (
                    grpc.StatusCode.INVALID_ARGUMENT, "lora: this engine has no LoRA adapter 'chat'; it has sql, poem")
            assert client.stats().num_unfinished == 0
    finally:
        server.stop(grace=1.0)


def test_serve_refuses_a_broken_engine_before_listening(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode != 0 and "listening" not in out.stdout and "is corrupt" in out.stderr


def test_soak_with_preemption_cancels_and_bad_requests_returns_every_token_and_block(engine):
    """benchmarks/soak.py for a few seconds: every completed stream equals its request alone, the 8-block pool is
    full again, nothing unfinished, RSS flat (the 10-minute run is in docs/reliability.md)."""
    assert_soak_passes(engine, kv_cache_blocks=8)
