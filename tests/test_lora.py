"""LoRA adapters built into an engine (builder/lora.py): logits against PEFT's for each adapter in one mixed step,
the fusion passes unchanged by them, the runtime's per-request choice (batched = alone, prefix caching kept apart per
adapter), the OpenAI server's `model` routing, and every bad adapter refused before any work."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import (
    BLOCK_QUANT,
    STORIES260K,
    make_peft_adapter,
    make_random_hf_model,
    needs_dense,
    peft_logits,
    prefix_cached_tokens,
)
from prometheus_client.parser import text_string_to_metric_families
from test_openai import Server

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.builder.lora import LoraError
from trtbuild.cli import main
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

IDS = [3, 17, 42, 9, 100, 5, 77, 12, 60, 1, 250, 31]
# family -> (targets of adapter "a", of adapter "b"): Phi-3 fuses q/k/v in its source (B rows split) and rotates
# half of each head (B's q / k rows reordered with the weights'); Qwen2 adds q / k / v biases
FAMILIES = {"llama": (["q_proj", "v_proj"], "all-linear"),
            "phi3_partial": (["qkv_proj"], "all-linear"),
            "qwen2": (["k_proj", "o_proj", "down_proj"], "all-linear")}


@pytest.fixture(scope="module", params=[p for f in FAMILIES for p in (pytest.param((f, "native"), marks=needs_dense),
                                                                      (f, "ort"))])
def adapted(request, tmp_path_factory):
    """(engine with adapters a and b, HF base, {name: adapter dir}) of a random model of each family, its float
    linears and LoRA branches native (trtbuild::LoraAdd) or standard ONNX ops."""
    (family, linears), work = request.param, tmp_path_factory.mktemp(f"lora_{request.param[0]}")
    hf = make_random_hf_model(family, work / "hf")
    targets = FAMILIES[family]
    adapters = {"a": make_peft_adapter(hf, work / "a", seed=1, r=4, lora_alpha=8, target_modules=targets[0]),
                "b": make_peft_adapter(hf, work / "b", seed=2, r=8, lora_alpha=16, target_modules=targets[1])}
    convert(hf, work / "ckpt")
    engine = build_engine(work / "ckpt", work / "engine", max_seq_len=64, tokens_per_block=8, float_linears=linears,
                          lora_adapters=tuple((n, str(p)) for n, p in adapters.items()))
    return engine, hf, adapters


def test_each_adapter_matches_peft_in_one_mixed_step(adapted):
    engine, hf, adapters = adapted
    info = read_engine_config(engine)
    assert info.build.lora_names == ("a", "b")
    n = len(IDS)
    chunks = [SequenceChunk(i, IDS, 0, n, [2 * i, 2 * i + 1], lora_id=i) for i in range(3)]  # base, a, b
    logits = CpuEngine(info, num_threads=1, num_blocks=8).step(chunks)
    base = peft_logits(hf, None, IDS)
    for i, adapter in enumerate([None, adapters["a"], adapters["b"]]):
        want = base if adapter is None else peft_logits(hf, adapter, IDS)
        np.testing.assert_allclose(logits[i * n : (i + 1) * n], want, atol=2e-5, rtol=0)
        if adapter is not None:
            assert np.abs(want - base).max() > 0.1  # the adapter matters


def test_adapters_leave_the_fusions_in_place(adapted):
    """q/k/v and gate/up still run as one GEMM each, the SwiGLU as one op: the deltas join before the Split; with
    native float linears, each linear's (or fused siblings') branch is one LoraAdd."""
    info = read_engine_config(adapted[0])
    passes = dict(p.split(":") for p in info.passes)
    layers = 2
    assert passes["fuse_qkv"] == passes["fuse_gate_up"] == str(layers)
    assert passes["hoist_lora_adds"] == str(2 * layers)
    native = info.build.float_linears == "native"
    assert passes["native_swiglu"] == str(layers)  # the native attention loads the library either way
    assert passes.get("native_lora") == (str(4 * layers) if native else None)  # q+k+v, o, gate+up, down


def test_prefix_blocks_are_kept_apart_per_adapter(lora_engine):
    core = EngineCore(lora_engine, RuntimeConfig(num_threads=1))
    prompt = list(range(5, 5 + 40))  # 5 full blocks of 8

    def cached(lora: str | None) -> int:
        return prefix_cached_tokens(core, prompt, lora)

    assert cached(None) == 0
    assert cached("sql") == 0  # the base model's K/V are not the adapter's
    assert cached("sql") == 32  # its own are reused (all but the last block, which recomputes the last token)
    assert cached("poem") == 0
    assert cached(None) == 32


def test_batched_adapters_equal_each_alone(lora_engine):
    llm = LLM(lora_engine, RuntimeConfig(num_threads=1))
    prompts = ["Once upon a time", "The cat sat", "Once upon a time", "Lily went"]
    loras = ["sql", None, "poem", "sql"]
    params = SamplingParams(max_tokens=12)
    batched = llm.generate(prompts, params, lora=loras)
    alone = [llm.generate([p], params, lora=name)[0] for p, name in zip(prompts, loras, strict=True)]
    assert [b.token_ids for b in batched] == [a.token_ids for a in alone]
    assert batched[0].token_ids != llm.generate([prompts[0]], params)[0].token_ids != batched[2].token_ids


def test_speculative_drafts_are_verified_under_the_adapter(lora_engine, stories_engine):
    """Prompt-lookup drafts, and a draft engine without adapters: greedy outputs under each adapter are the plain
    ones (the target verifies every draft under the request's adapter)."""
    from trtbuild.runtime.speculative import SpeculativeConfig

    prompts, loras = ["Once upon a time, Lily", "The cat sat on the mat. The cat"], ["poem", "sql"]
    params = SamplingParams(max_tokens=24)
    plain = LLM(lora_engine, RuntimeConfig(num_threads=1)).generate(prompts, params, lora=loras)
    draft = SpeculativeConfig(3, method="draft_model", draft_engine_dir=str(stories_engine))
    for spec in (SpeculativeConfig(3), draft):
        got = LLM(lora_engine, RuntimeConfig(num_threads=1, speculative=spec)).generate(prompts, params, lora=loras)
        assert [g.token_ids for g in got] == [p.token_ids for p in plain], spec.method


def test_an_unknown_adapter_is_refused(lora_engine, llama_engine):
    core = EngineCore(lora_engine, RuntimeConfig(num_threads=1))
    with pytest.raises(ValueError, match=r"lora: this engine has no LoRA adapter 'chat'; it has sql, poem"):
        core.make_request("Once", SamplingParams(), lora="chat")
    with pytest.raises(ValueError, match=r"built without any \(`trtbuild build --lora NAME=PATH`\)"):
        EngineCore(llama_engine, RuntimeConfig(num_threads=1)).make_request([1, 2], SamplingParams(), lora="sql")


def test_openai_model_names_the_adapter(lora_engine):
    want = LLM(lora_engine, RuntimeConfig(num_threads=1)).generate(["Once upon a time"], SamplingParams(max_tokens=10),
                                                                   lora="poem")[0].text
    server = Server(lora_engine)
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["stories", "sql", "poem"]
        out = client.completions.create(model="poem", prompt="Once upon a time", max_tokens=10, temperature=0)
        assert out.choices[0].text == want and out.model == "poem"
        base = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=10, temperature=0)
        assert base.choices[0].text != want and base.model == "stories"
        status, body = server.post("/v1/completions", {"model": "chat", "prompt": "Once", "max_tokens": 2})
        assert status == 404 and "`stories`, `sql`, `poem`" in body["error"]["message"]
        body = {"model": "sql", "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        stream = urllib.request.Request(server.base + "/v1/completions", json.dumps(body).encode(),
                                        {"Content-Type": "application/json"})
        with urllib.request.urlopen(stream, timeout=60) as running:
            running.readline()  # the request is running while the metrics are scraped
            families = text_string_to_metric_families(server.scrape())
            (info,) = [f for f in families if f.name == "vllm:lora_requests_info"]
        (sample,) = info.samples
        assert sample.labels == {"model_name": "stories", "running_lora_adapters": "sql", "waiting_lora_adapters": "",
                                 "max_lora": "2"}
    finally:
        server.stop()


def _adapter_error(tmp_path: Path, edit, family: str = "llama") -> str:
    hf = make_random_hf_model(family, tmp_path / "hf")
    adapter = make_peft_adapter(hf, tmp_path / "adapter", r=4, lora_alpha=8, target_modules="all-linear")
    edit(adapter)
    convert(hf, tmp_path / "ckpt")
    with pytest.raises(LoraError) as e:
        build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, lora_adapters=(("x", str(adapter)),))
    assert not (tmp_path / "engine").exists()  # refused before any output
    return str(e.value)


def _edit_config(**fields):
    def edit(adapter: Path) -> None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: (a / "adapter_config.json").unlink(), r"is not a PEFT LoRA adapter folder \(no adapter_config.json\)"),
    (lambda a: (a / "adapter_model.safetensors").rename(a / "adapter_model.bin"),
     r"no adapter_model.safetensors \(it has adapter_model.bin: save it with safe_serialization=True\)"),
    (_edit_config(use_dora=True), r"DoRA is not supported"),
    (_edit_config(bias="all"), r"only bias \"none\" adapters are supported"),
    (_edit_config(peft_type="IA3"), r"peft_type 'IA3'; trtbuild builds LoRA adapters only"),
])
def test_bad_adapter_folders_are_refused(tmp_path, edit, message):
    assert re.search(message, _adapter_error(tmp_path, edit))


def test_an_adapter_of_another_model_is_refused(tmp_path):
    other = make_random_hf_model("llama", tmp_path / "other", overrides={"hidden_size": 32, "intermediate_size": 48})
    adapter = make_peft_adapter(other, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj"])
    hf = make_random_hf_model("llama", tmp_path / "hf")
    convert(hf, tmp_path / "ckpt")
    with pytest.raises(LoraError, match=r"do not fit the base model's \[64, 64\] linear; is this adapter for another"):
        build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, lora_adapters=(("x", str(adapter)),))


def test_an_adapter_of_experts_is_refused(tmp_path):
    message = _adapter_error(tmp_path, lambda a: None, family="qwen3_moe")
    assert "layer 0 mlp.experts: trtbuild does not adapt a mixture of experts' MLP; train the adapter with " \
           "target_modules among q_proj, k_proj, v_proj, o_proj." in message


def test_cli_lora_flags(tmp_path, lora_engine):
    ckpt = tmp_path / "ckpt"
    convert(STORIES260K, ckpt)
    runner = CliRunner()
    result = runner.invoke(main, ["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"),
                                  "--lora", "no-equals-sign"])
    assert result.exit_code == 2 and "give NAME=PATH" in result.output
    result = runner.invoke(main, ["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"),
                                  "--lora", f"bad name={tmp_path}"])
    assert result.exit_code != 0 and "LoRA adapter name 'bad name'" in result.output
    result = runner.invoke(main, ["run", "--engine", str(lora_engine), "--prompt", "Once", "--lora", "chat",
                                  "--max-tokens", "3", "--threads", "1"])
    assert result.exit_code != 0 and "no LoRA adapter 'chat'; it has sql, poem" in result.output
    result = runner.invoke(main, ["run", "--engine", str(lora_engine), "--prompt", "Once upon a time", "--lora", "sql",
                                  "--max-tokens", "8", "--threads", "1"])
    want = LLM(lora_engine, RuntimeConfig(num_threads=1)).generate(["Once upon a time"], SamplingParams(max_tokens=8),
                                                                   lora="sql")[0].text
    assert result.exit_code == 0 and result.output.rstrip("\n") == "Once upon a time" + want


def write_gguf_lora(peft_dir: Path, path: Path, hf_dir: Path, family: str) -> Path:
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it for a base of `family`: float32 A / B per
    `blk.N.<linear>.weight`, B's q / k rows permuted where the base's are, alpha in the metadata."""
    import gguf
    from gguf_helpers import FAMILIES, PERMUTED, _permute
    from safetensors.numpy import load_file

    arch = FAMILIES[family][0]
    cfg = json.loads((hf_dir / "config.json").read_text())
    alpha = json.loads((peft_dir / "adapter_config.json").read_text())["lora_alpha"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    for key, data in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        module, _, ab = key.removeprefix("base_model.model.").rpartition(".lora_")
        if ab == "B.weight" and module.endswith(("q_proj", "k_proj")) and arch in PERMUTED:
            data = _permute(data, cfg["num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"])
        base = names.get_name(module + ".weight", try_suffixes=(".weight",))  # blk.N.attn_q.weight
        w.add_tensor(f"{base}.lora_{ab[0].lower()}", data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # q / k rows permuted in the file; q / k / v biases
def test_a_gguf_adapter_over_a_quantized_gguf_base(tmp_path, family):
    """llama.cpp's adapter file over a Q8_0 / Q4_0 GGUF base: the logits of the PEFT folder it was written from, with
    the quantized q / k / v and gate / up still one kernel each (and the biases in them), their deltas joined
    before the Split."""
    from gguf import GGMLQuantizationType as Q
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp

    hf = make_hf_folder(family, tmp_path / "hf")
    peft = make_peft_adapter(hf, tmp_path / "peft", seed=3, r=4, lora_alpha=8, target_modules="all-linear")
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    qtypes = {f"blk.{i}.{n}.weight": Q.Q8_0 if i else Q.Q4_0 for i in range(2) for n in linears}
    convert(write_gguf_like_llama_cpp(hf, tmp_path / "base.gguf", family, qtypes), tmp_path / "ckpt")
    adapter = write_gguf_lora(peft, tmp_path / "adapter.gguf", hf, family)
    logits = []
    for source in (peft, adapter):
        engine = build_engine(tmp_path / "ckpt", tmp_path / f"engine_{source.name}", max_seq_len=64,
                              tokens_per_block=8, lora_adapters=(("x", str(source)),))
        info = read_engine_config(engine)
        passes = dict(p.split(":") for p in info.passes)
        assert passes["lower_quantized_linears"] == "10" and passes["hoist_lora_adds"] == "4"  # q/k/v, gate/up
        # the q / k / v biases join BlockQuantMatMul, which needs AVX-512 VNNI or AVX2 (MatMulNBits keeps them as Adds)
        assert passes["native_swiglu"] == "2"
        assert passes.get("linear_biases") == ("2" if family == "qwen2" and BLOCK_QUANT else None)
        chunks = [SequenceChunk(i, IDS, 0, len(IDS), [2 * i, 2 * i + 1], lora_id=i) for i in range(2)]
        logits.append(CpuEngine(info, num_threads=1, num_blocks=4).step(chunks))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=0)
    assert np.abs(logits[0][len(IDS):] - logits[0][: len(IDS)]).max() > 0.1
    with pytest.raises(LoraError, match=r"base.gguf is not a LoRA adapter GGUF .* convert_lora_to_gguf.py"):
        build_engine(tmp_path / "ckpt", tmp_path / "e", lora_adapters=(("x", str(tmp_path / "base.gguf")),))


def test_verify_runs_the_adapters_against_the_unfused_build(lora_engine):
    """`trtbuild verify`: the two verification sequences under the engine's two adapters, the reference built
    unfused with them."""
    from trtbuild.bench.verify import _step_chunks, verify_engine

    _, steps, _ = _step_chunks(read_engine_config(lora_engine))
    assert [c.lora_id for c in steps[0]] == [1, 2]
    verify_engine(lora_engine, lora_engine.parent / "ckpt", num_threads=1).check()


@needs_dense
@pytest.mark.parametrize("weight_type", ["float16", "bfloat16", "float32"])
def test_lora_add_matches_its_reference(library, weight_type):
    """trtbuild::LoraAdd on three sibling blocks (48, 16, 32 columns), three adapters of ranks 4, 2 and 3, runs of
    tokens under each and under none."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from trtbuild.plugins import dense_matmul as dm
    from trtbuild.plugins import lora as lp

    rng = np.random.default_rng(0)
    k, splits, offsets = 32, [48, 16, 32], np.array([0, 4, 6, 9])
    a_blocks = [rng.standard_normal((k, 9)).astype(np.float32) for _ in splits]
    b_blocks = [rng.standard_normal((9, n)).astype(np.float32) for n in splits]
    a, bt = lp.pack(a_blocks, b_blocks, offsets)
    a, bt = a.astype(dm.WEIGHT_TYPES[weight_type]), bt.astype(dm.WEIGHT_TYPES[weight_type])
    ids = np.array([0, 1, 1, 1, 1, 1, 2, 2, 3, 0, 0, 2, 2, 2], np.int64)  # runs that tile 4 + 1, 2, 1, 3 tokens
    x = rng.standard_normal((len(ids), k)).astype(np.float32)
    y = rng.standard_normal((len(ids), sum(splits))).astype(np.float32)
    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
    node = helper.make_node(lp.OP_TYPE, ["y", "x", "ids", "a", "bt"], ["out"], domain=lp.DOMAIN, K=k, N=sum(splits),
                            R=bt.shape[1], splits=splits)
    weights = [helper.make_tensor(name, elem, w.shape, w.tobytes(), raw=True) for name, w in (("a", a), ("bt", bt))]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", sum(splits)]),
                                            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k]),
                                            helper.make_tensor_value_info("ids", TensorProto.INT64, ["m"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["m", sum(splits)])],
                              initializer=weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(lp.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {"y": y, "x": x, "ids": ids})[0]
    want = lp.reference_lora_add(y, x, ids, a, bt, splits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    few = session.run(None, {"y": y[1:4], "x": x[1:4], "ids": ids[1:4]})[0]  # a decode step's split of the work
    np.testing.assert_allclose(few, want[1:4], rtol=1e-5, atol=1e-4)
    base = session.run(None, {"y": y[9:11], "x": x[9:11], "ids": ids[9:11]})[0]  # a decode step under no adapter
    np.testing.assert_array_equal(base, y[9:11])
    # the packing: adapter 2 (rank 2) of block 1 computes x @ lora_a[:, 4:6] @ lora_b[4:6]
    dense = x[6] @ a_blocks[1][:, 4:6].astype(np.float64) @ b_blocks[1][4:6].astype(np.float64)
    if weight_type == "float32":
        np.testing.assert_allclose(got[6, 48:64] - y[6, 48:64], dense, rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match=r"lora id 4 outside 0..3"):
        session.run(None, {"y": y[:1], "x": x[:1], "ids": np.array([4])})
