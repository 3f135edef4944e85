"""`trtbuild bench --lora NAME` on the stories260K engine with adapters `sql` and `poem`: every request (the warm-up
too) reaches the engine under the adapter and generates what the engine generates under it, in-process and through
both servers (gRPC and the OpenAI API, in this process); the report names the adapter; an unknown name, a compared
engine without it and --compare-hf (the HF base model) are refused before any request runs."""

from __future__ import annotations

import re

import pytest
from helpers import STORIES260K
from test_bench import assert_sane, assert_user_error, bench, ok_json

from trtbuild.bench.run import BenchOptions, run_bench
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams

SYNTHETIC = ("--num-requests", 2, "--input-len", 6, "--output-len", 4, "--threads", 1)


@pytest.fixture
def added(monkeypatch) -> list[Request]:
    """The requests any EngineCore of this process is given, as it is given them (the engine runs them unchanged)."""
    seen: list[Request] = []
    add = EngineCore.add_request

    def spy(self: EngineCore, request: Request) -> None:
        seen.append(request)
        add(self, request)

    monkeypatch.setattr(EngineCore, "add_request", spy)
    return seen


def assert_generated_under(requests: list[Request], engine, lora: str, lora_id: int, count: int) -> None:
    """`count` requests (the bench's and its warm-up), all under adapter `lora`, each with the greedy tokens the
    engine generates for its prompt under that adapter, which are not the base model's."""
    assert len(requests) == count and {r.lora_id for r in requests} == {lora_id}
    prompts = [r.prompt_ids for r in requests]
    params = [SamplingParams(max_tokens=len(r.token_ids) - r.num_prompt_tokens, ignore_eos=True) for r in requests]
    llm = LLM(engine, RuntimeConfig(num_threads=1))
    got = [r.token_ids[r.num_prompt_tokens:] for r in requests]
    assert got == [c.token_ids for c in llm.generate(prompts, params, lora=lora)]
    assert got != [c.token_ids for c in llm.generate(prompts, params)]


def test_in_process_bench_runs_every_request_under_the_adapter(lora_engine, added):
    r = run_bench(BenchOptions(engine=lora_engine, num_requests=4, input_len=8, output_len=12, concurrency=4,
                               threads=1, lora="sql"))
    assert_sane(r, 4, 8, 12)
    assert r["lora"] == "sql" and r["target"] == f"engine {lora_engine}"
    assert_generated_under(list(added), lora_engine, "sql", 1, 5)
    # the CLI: the table and the JSON name the adapter; --compare-engine runs under it too
    added.clear()
    result = bench("--engine", lora_engine, *SYNTHETIC, "--lora", "poem", "--compare-engine", lora_engine)
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(r"^LoRA adapter: +poem \(every request, on both engines\)$", result.stdout, re.M), result.stdout
    assert len(added) == 6 and {x.lora_id for x in added} == {2}  # 2 requests and a warm-up per engine
    out = ok_json(bench("--engine", lora_engine, *SYNTHETIC, "--lora", "sql", "--json"))
    assert_sane(out, 2, 6, 4)
    assert out["lora"] == "sql"
    assert "LoRA adapter" not in bench("--engine", lora_engine, *SYNTHETIC).stdout


def test_bench_refuses_an_adapter_the_engine_lacks_before_any_request(lora_engine, stories_engine, added):
    result = bench("--engine", lora_engine, *SYNTHETIC, "--lora", "chat")
    assert_user_error(result, rf"^Error: --lora chat: engine {re.escape(str(lora_engine))} has no LoRA adapter "
                              r"'chat'; it has sql, poem$")
    assert_user_error(bench("--engine", stories_engine, *SYNTHETIC, "--lora", "sql"),
                      r"has no LoRA adapter 'sql'; it was built without any \(`trtbuild build --lora NAME=PATH`\)")
    assert_user_error(bench("--engine", lora_engine, *SYNTHETIC, "--lora", "sql", "--compare-engine", stories_engine),
                      r"--lora sql: --compare-engine .* \(run under the same adapter\) has no LoRA adapter 'sql'")
    assert_user_error(bench("--engine", lora_engine, *SYNTHETIC, "--lora", "sql", "--compare-hf", STORIES260K),
                      r"--compare-hf runs the HF base model, without the LoRA adapter 'sql'")
    assert added == []  # refused before any request reached an engine


def test_servers_get_every_request_under_the_adapter(lora_engine, added):
    """A real gRPC server and OpenAI app over one engine, in this process: `GenerateRequest.lora` and the OpenAI
    `model` carry the adapter; an unknown one is refused from what the server lists, naming its adapters."""
    from trtbuild.serving.grpc.server import GenerationServer
    from trtbuild.serving.openai.server import HttpServer

    server = GenerationServer(port=0, max_queue_size=16)
    http = None
    try:
        server.load(lora_engine, RuntimeConfig(num_threads=1))
        http = HttpServer(server.servicer.engine, "127.0.0.1", 0, "stories")
        for backend, address in (("grpc", server.address), ("openai", http.address)):
            added.clear()
            r = run_bench(BenchOptions(address=address, backend=backend, num_requests=3, input_len=8, output_len=12,
                                       concurrency=3, lora="poem"))
            assert (r["completed"], r["failed"], r["total_output_tokens"], r["lora"]) == (3, 0, 36, "poem"), backend
            assert_generated_under(list(added), lora_engine, "poem", 2, 4)
        assert_user_error(bench("--address", server.address, *SYNTHETIC, "--lora", "chat"),
                          r"--lora chat: the engine of the server at 127\.0\.0\.1:\d+ has no LoRA adapter 'chat'; "
                          r"it has sql, poem$")
        assert_user_error(bench("--address", http.address, "--backend", "openai", *SYNTHETIC, "--lora", "chat"),
                          r"--lora chat: the server at http://127\.0\.0\.1:\d+ has no LoRA adapter 'chat'; "
                          r"it has sql, poem$")
    finally:
        if http is not None:
            http.stop()
        server.stop(grace=1.0)
