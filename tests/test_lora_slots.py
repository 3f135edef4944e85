"""LoRA slots (builder/lora_slots.py, runtime/lora_slots.py): adapters loaded into a running engine give PEFT's
logits, in one step with the base model and each other; unloading drains; a reused slot shares no cached K/V with
the adapter before; the OpenAI server's /v1/load_lora_adapter and /v1/unload_lora_adapter; every bad load refused
with what to do; the gRPC service's LoadLoraAdapter / UnloadLoraAdapter."""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import RUNTIME_ENGINE_OPTIONS
from helpers import STORIES260K, make_peft_adapter, make_random_hf_model, peft_logits, prefix_cached_tokens
from test_openai import Server

from trtbuild import cpu_ops
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.lora import read_adapter
from trtbuild.builder.lora_slots import PACKED, STACKED, SlotTable, write_slot
from trtbuild.cli import main
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError
from trtbuild.plugins.lora import reference_lora_add
from trtbuild.runtime.async_engine import AsyncEngine
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import SequenceChunk
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.lora_slots import LoraLoadError
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.grpc.client import GenerationClient
from trtbuild.serving.grpc.server import GenerationServer

IDS = [3, 17, 42, 9, 100, 5, 77, 12, 60, 1, 250, 31]
LINEARS = ["ort", "native"] if cpu_ops.runs_dense() else ["ort"]  # NOTE: LoraAdd needs AVX-512 or AVX2
FAMILIES = {"llama": ["q_proj", "v_proj"], "phi3_partial": ["qkv_proj"], "qwen2": ["k_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module", params=[(f, linears) for f in FAMILIES for linears in LINEARS])
def slotted(request, tmp_path_factory):
    """(core over an engine with 3 slots of rank 8, HF base, {name: adapter dir}) of a random model of each family,
    its LoRA branches standard ONNX ops or trtbuild::LoraAdd."""
    (family, linears), work = request.param, tmp_path_factory.mktemp(f"slots_{request.param[0]}")
    hf = make_random_hf_model(family, work / "hf")
    adapters = {"a": make_peft_adapter(hf, work / "a", seed=1, r=4, lora_alpha=8, target_modules=FAMILIES[family]),
                "b": make_peft_adapter(hf, work / "b", seed=2, r=8, lora_alpha=16, target_modules="all-linear")}
    convert(hf, work / "ckpt")
    engine = build_engine(work / "ckpt", work / "engine", max_seq_len=64, tokens_per_block=8, float_linears=linears,
                          max_loras=3, max_lora_rank=8)
    return EngineCore(engine, RuntimeConfig(num_threads=1, warm_up=False)), hf, adapters


def test_loaded_adapters_match_peft_in_one_mixed_step(slotted):
    core, hf, adapters = slotted
    for name in ("b", "a"):  # NOTE: b takes slot 0, a slot 1: ids follow the slots, not the names
        core.load_lora(core.lora.prepare(name, adapters[name]))
    assert core.lora_names == ("b", "a") and core.lora.id_of("a")[0] == 2
    n = len(IDS)
    chunks = [SequenceChunk(i, IDS, 0, n, [2 * i, 2 * i + 1], lora_id=lora_id) for i, lora_id in enumerate([0, 2, 1])]
    logits = core.engine.step(chunks)
    base = peft_logits(hf, None, IDS)
    for i, adapter in enumerate([None, adapters["a"], adapters["b"]]):
        want = base if adapter is None else peft_logits(hf, adapter, IDS)
        np.testing.assert_allclose(logits[i * n : (i + 1) * n], want, atol=2e-5, rtol=0)
        if adapter is not None:
            assert np.abs(want - base).max() > 0.1
    core.unload_lora("b")
    core.unload_lora("a")
    assert core.lora_names == () and not any(a.any() for a in core.engine.lora_slots.arrays.values())


def test_slot_tables_are_engine_inputs(slotted):
    """Every linear of every layer has its tables as engine inputs, in the layout the metadata names; with native
    float linears each (fused) branch is one LoraAdd over packed tables; the fusions stay in place."""
    core = slotted[0]
    info, tables = core.engine.info, core.engine.lora_slots.tables
    passes = dict(p.split(":") for p in info.passes)
    layers = info.model.num_hidden_layers
    assert passes["fuse_qkv"] == passes["fuse_gate_up"] == str(layers)
    names = {i["name"] for i in info.io["inputs"]}
    assert {t.a for t in tables} | {t.b for t in tables} <= names
    assert sorted(p for t in tables for p in t.linears) == sorted(
        f"transformer.layers.{i}.{linear}" for i in range(layers)
        for linear in ("attention.q", "attention.k", "attention.v", "attention.dense", "mlp.gate", "mlp.fc",
                       "mlp.proj"))
    packed = [t for t in tables if t.layout == PACKED]
    if info.build.float_linears == "native":
        assert len(packed) == 4 * layers and passes["native_lora"] == str(4 * layers)  # q+k+v, o, gate+up, down
        assert core.engine.lora_slots.arrays[packed[0].a].shape == (3, 3 * 8, info.model.hidden_size)
    else:
        assert not packed and len(tables) == 7 * layers


def test_packed_slots_are_what_lora_add_reads(tmp_path):
    """write_slot's packed layout through trtbuild::LoraAdd's numpy reference equals x A^T B^T per linear (the
    native op itself runs it in test_loaded_adapters_match_peft_in_one_mixed_step where the CPU has AVX-512)."""
    rng = np.random.default_rng(0)
    k, splits, rank, slots = 32, (48, 16), 8, 3
    table = SlotTable("A", "Bt", PACKED, ("q", "k"), splits)
    arrays = {"A": np.zeros((slots, 2 * rank, k), np.float32), "Bt": np.zeros((slots, rank, sum(splits)), np.float32)}
    weights = {"q": (rng.normal(size=(4, k)), rng.normal(size=(48, 4))), "k": (rng.normal(size=(6, k)),
                                                                               rng.normal(size=(16, 6)))}
    write_slot(arrays, [table], 1, rank, weights)
    x, y = rng.normal(size=(2, k)).astype(np.float32), np.zeros((2, sum(splits)), np.float32)
    out = reference_lora_add(y, x, np.array([2, 0]), arrays["A"], arrays["Bt"], list(splits))
    want = np.concatenate([x[0] @ weights[n][0].T @ weights[n][1].T for n in ("q", "k")])
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-5)
    assert not out[1].any() and not arrays["A"][[0, 2]].any()
    write_slot(arrays, [table], 1, rank, {})  # emptied
    assert not arrays["A"].any() and not arrays["Bt"].any()
    stacked = SlotTable("a", "b", STACKED, ("q",), (48,))
    arrays = {"a": np.ones((k, slots * rank), np.float32), "b": np.ones((slots * rank, 48), np.float32)}
    write_slot(arrays, [stacked], 2, rank, {"q": weights["q"]})
    np.testing.assert_allclose(x[0] @ arrays["a"][:, 16:] @ arrays["b"][16:], want[:48], rtol=1e-5, atol=1e-5)
    assert arrays["a"][:, :16].all()  # other slots untouched


@pytest.fixture(scope="module")
def slot_engine(engine_from_hf):
    """stories260K with 2 slots of rank 8 (the adapters of conftest's lora_adapters: ranks 4 and 8)."""
    return engine_from_hf(STORIES260K, max_loras=2, max_lora_rank=8, **RUNTIME_ENGINE_OPTIONS)


def test_a_loaded_adapter_generates_as_the_built_in_one(slot_engine, lora_engine, lora_adapters):
    prompts, params = ["Once upon a time", "The cat sat"], SamplingParams(max_tokens=12)
    built_in = LLM(lora_engine, RuntimeConfig(num_threads=1))
    llm = LLM(slot_engine, RuntimeConfig(num_threads=1))
    for name in ("poem", "sql"):
        llm.load_lora(name, lora_adapters[name])
    got = llm.generate(prompts * 3, params, lora=["poem", "poem", "sql", "sql", None, None])
    want = built_in.generate(prompts * 3, params, lora=["poem", "poem", "sql", "sql", None, None])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_reused_slot_shares_no_cached_blocks(slot_engine, lora_adapters):
    core = EngineCore(slot_engine, RuntimeConfig(num_threads=1))
    prompt = list(range(5, 5 + 40))  # 5 full blocks of 8

    def cached(lora: str | None) -> int:
        return prefix_cached_tokens(core, prompt, lora)

    core.load_lora(core.lora.prepare("sql", lora_adapters["sql"]))
    assert (cached("sql"), cached("sql")) == (0, 32)
    core.unload_lora("sql")
    core.load_lora(core.lora.prepare("poem", lora_adapters["poem"]))
    assert core.lora.id_of("poem")[0] == 1  # sql's slot, reused
    assert (cached("poem"), cached("poem")) == (0, 32)
    core.unload_lora("poem")
    core.load_lora(core.lora.prepare("sql", lora_adapters["sql"]))  # the same adapter loaded again: a new load
    assert cached("sql") == 0


def test_unloading_drains_the_requests_under_the_adapter(slot_engine, lora_adapters):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = LLM(slot_engine, RuntimeConfig(num_threads=1))
    alone.load_lora("poem", lora_adapters["poem"])
    want = alone.generate(["Once upon a time"], params, lora="poem")[0].token_ids
    engine = AsyncEngine(EngineCore(slot_engine, RuntimeConfig(num_threads=1)))
    try:
        engine.load_lora("poem", lora_adapters["poem"])
        stream = engine.submit("Once upon a time", params, lora="poem")
        first = stream.get(timeout=60)
        late = engine.core.make_request("Once", params, lora="poem")  # made before the unload, added after it
        engine.unload_lora("poem")
        assert engine.core.lora_names == ()
        with pytest.raises(ValueError, match="no LoRA adapter 'poem'; it has none loaded"):
            engine.submit("Once", params, lora="poem")
        with pytest.raises(ValueError, match="'poem' was unloaded before the request started"):
            engine.core.add_request(late)  # NOTE: on this thread only because the loop is idle between its steps
        tokens = list(first.new_token_ids) + [t for out in stream for t in out.new_token_ids]
        assert tokens == want  # finished under the adapter it started with
        engine.load_lora("sql", lora_adapters["sql"])
        engine.load_lora("poem", lora_adapters["poem"])  # poem's slot was freed when its request finished
        assert sorted(engine.core.lora_names) == ["poem", "sql"]
    finally:
        engine.shutdown()


def test_bad_loads_are_refused(slot_engine, lora_engine, lora_adapters, tmp_path):
    core = EngineCore(slot_engine, RuntimeConfig(num_threads=1, warm_up=False))
    high = make_peft_adapter(STORIES260K, tmp_path / "r16", seed=3, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(LoraLoadError, match="has rank 16, above the engine's max_lora_rank 8; rebuild it with "
                                            "`--max-lora-rank 16`"):
        core.lora.prepare("big", high)
    with pytest.raises(LoraLoadError, match="does not exist"):
        core.lora.prepare("gone", tmp_path / "missing")
    core.load_lora(core.lora.prepare("sql", lora_adapters["sql"]))
    with pytest.raises(LoraLoadError, match="named 'sql' is already loaded; unload it first"):
        core.load_lora(core.lora.prepare("sql", lora_adapters["poem"]))
    core.load_lora(core.lora.prepare("poem", lora_adapters["poem"]))
    with pytest.raises(LoraLoadError, match=r"all 2 LoRA slots hold adapters \(sql, poem\); unload one, or rebuild "
                                            "the engine with a larger `--max-loras`"):
        core.load_lora(core.lora.prepare("third", lora_adapters["sql"]))
    with pytest.raises(LoraLoadError, match="no LoRA adapter 'third' is loaded; loaded: sql, poem"):
        core.unload_lora("third")
    built_in = EngineCore(lora_engine, RuntimeConfig(num_threads=1, warm_up=False))
    with pytest.raises(LoraLoadError, match="cannot load LoRA adapters: it was built without LoRA slots"):
        built_in.lora.prepare("x", lora_adapters["sql"])
    with pytest.raises(ConfigError, match="not both"):
        BuildConfig(max_loras=2, max_lora_rank=8, lora_adapters=(("sql", str(lora_adapters["sql"])),))
    with pytest.raises(ConfigError, match="both at least 1"):
        BuildConfig(max_loras=2)
    with pytest.raises(ConfigError, match="cpu target only"):
        BuildConfig(target="cuda", max_loras=2, max_lora_rank=8)
    assert read_adapter("sql", lora_adapters["sql"], core.engine.info.model).rank == 4


def test_openai_loads_and_unloads_adapters(slot_engine, lora_adapters):
    want = LLM(slot_engine, RuntimeConfig(num_threads=1))
    want.load_lora("poem", lora_adapters["poem"])
    text = want.generate(["Once upon a time"], SamplingParams(max_tokens=10), lora="poem")[0].text
    server = Server(slot_engine, "--lora-modules", f"sql={lora_adapters['sql']}")
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["stories", "sql"]
        poem = {"lora_name": "poem", "lora_path": str(lora_adapters["poem"])}
        assert _post_text(server, "/v1/load_lora_adapter", poem) == "Success: LoRA adapter 'poem' added successfully."
        assert [m.id for m in client.models.list().data] == ["stories", "sql", "poem"]
        out = client.completions.create(model="poem", prompt="Once upon a time", max_tokens=10, temperature=0)
        assert out.choices[0].text == text and out.model == "poem"
        status, body = server.post("/v1/load_lora_adapter", {"lora_name": "more", "lora_path": "/no/such/adapter"})
        assert status == 400 and "does not exist" in body["error"]["message"]
        assert _post_text(server, "/v1/unload_lora_adapter", {"lora_name": "poem"}
                          ) == "Success: LoRA adapter 'poem' removed successfully."
        status, body = server.post("/v1/completions", {"model": "poem", "prompt": "Once", "max_tokens": 2})
        assert status == 404 and "`stories`, `sql`" in body["error"]["message"]
        status, body = server.post("/v1/unload_lora_adapter", {"lora_name": "poem"})
        assert status == 404 and "not loaded; loaded: sql" in body["error"]["message"]
    finally:
        server.stop()


def _post_text(server: Server, path: str, body: dict) -> str:
    """A successful call's plain-text answer (vLLM's endpoints answer text, not JSON)."""
    request = urllib.request.Request(server.base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200
        return r.read().decode()


def test_loads_race_with_requests(slot_engine, lora_adapters):
    """Loads and unloads from other threads while requests run: every request finishes, none under a wrong
    adapter (the slot tables change only between steps)."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = AsyncEngine(EngineCore(slot_engine, RuntimeConfig(num_threads=1)))
    try:
        engine.load_lora("sql", lora_adapters["sql"])
        want = [t for out in engine.submit("The cat", params, lora="sql") for t in out.new_token_ids]
        streams = [engine.submit("The cat", params, lora="sql") for _ in range(4)]

        def churn() -> None:
            for _ in range(3):
                engine.load_lora("poem", lora_adapters["poem"])
                engine.unload_lora("poem")

        thread = threading.Thread(target=churn)
        thread.start()
        thread.join(60)
        for stream in streams:
            assert [t for out in stream for t in out.new_token_ids] == want
    finally:
        engine.shutdown()


def test_grpc_loads_and_unloads_adapters(slot_engine, lora_engine, lora_adapters):
    want = LLM(lora_engine, RuntimeConfig(num_threads=1)).generate(["Once"], SamplingParams(max_tokens=6),
                                                                   lora="sql")[0].token_ids
    server = GenerationServer(port=0, max_queue_size=4)
    try:
        server.load(slot_engine, RuntimeConfig(num_threads=1))
        with GenerationClient(server.address, timeout=60) as client:
            assert client.model_info().max_loras == 2 and not client.model_info().lora_names
            assert client.load_lora_adapter("sql", str(lora_adapters["sql"])) == ["sql"]
            assert list(client.generate("Once", lora="sql", max_tokens=6).token_ids) == want
            with pytest.raises(grpc.RpcError) as e:
                client.load_lora_adapter("sql", str(lora_adapters["poem"]))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already loaded" in e.value.details()
            assert client.unload_lora_adapter("sql") == []
            with pytest.raises(grpc.RpcError) as e:
                client.unload_lora_adapter("sql")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:
                client.generate("Once", lora="sql", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "none loaded" in e.value.details()
    finally:
        server.stop(grace=1.0)


def test_verify_runs_a_slot_engine_against_the_unfused_build(slotted):
    """`trtbuild verify` of a slot engine: each side feeds its own (empty) tables, packed for LoraAdd or not."""
    from trtbuild.bench.verify import verify_engine

    engine = slotted[0].engine.info.path
    verify_engine(engine, engine.parent / "ckpt", num_threads=1).check()


def test_cli_slot_flags(slot_engine, lora_engine, lora_adapters, tmp_path):
    runner = CliRunner()
    ckpt = slot_engine.parent / "ckpt"
    result = runner.invoke(main, ["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"),
                                  "--max-loras", "2", "--lora", f"sql={lora_adapters['sql']}"])
    assert result.exit_code != 0 and "not both" in result.output and not (tmp_path / "e").exists()
    result = runner.invoke(main, ["run", "--engine", str(slot_engine), "--prompt", "Once upon a time", "--lora",
                                  f"sql={lora_adapters['sql']}", "--max-tokens", "8", "--threads", "1"])
    want = LLM(lora_engine, RuntimeConfig(num_threads=1)).generate(["Once upon a time"], SamplingParams(max_tokens=8),
                                                                   lora="sql")[0].text
    assert result.exit_code == 0 and result.output.rstrip("\n") == "Once upon a time" + want
    result = runner.invoke(main, ["run", "--engine", str(lora_engine), "--prompt", "Once", "--lora",
                                  f"x={lora_adapters['sql']}", "--max-tokens", "2", "--threads", "1"])
    assert result.exit_code != 0 and "built without LoRA slots" in result.output


def test_bench_loads_the_adapter_into_each_engine(slot_engine, lora_adapters):
    """`trtbuild bench --lora NAME=PATH`: the adapter is loaded into the engine's slot (and --compare-engine's)
    before the first request, and the report names it; a server loads its own."""
    runner = CliRunner()
    common = ["--num-requests", "2", "--input-len", "8", "--output-len", "4", "--concurrency", "2", "--threads", "1",
              "--json"]
    result = runner.invoke(main, ["bench", "--engine", str(slot_engine), "--compare-engine", str(slot_engine),
                                  "--lora", f"sql={lora_adapters['sql']}", *common])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["lora"] == "sql" and report["completed"] == 2
    result = runner.invoke(main, ["bench", "--address", "127.0.0.1:1", "--lora", f"sql={lora_adapters['sql']}",
                                  *common])
    assert result.exit_code != 0 and "a server loads its LoRA adapters itself" in result.output
