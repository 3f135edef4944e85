"""`--target tensorrt` (builder/tensorrt/, plugins/tensorrt/, runtime/tensorrt_engine.py). TensorRT cannot be
installed here, so what runs here is everything that does not need it: the graph rewrite into plugin nodes, the
optimization profiles, the refusals, the error paths, the plugins' Triton kernels compiled to PTX in the argument
order a TensorRT AOT plugin launches them with, and those kernels (as the plugins launch them) against the
PagedAttention reference in Triton's interpreter. What needs TensorRT skips, saying why."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from trtbuild.builder.network import build_network
from trtbuild.builder.passes import run_passes
from trtbuild.builder.tensorrt.plan import (
    ATTENTION_PLUGIN,
    NAMESPACE,
    ROTARY_ATTENTION_PLUGIN,
    ROTARY_K_PLUGIN,
    check_tensorrt_buildable,
    check_tensorrt_graph,
    max_pool_blocks,
    optimization_profiles,
    profile_for,
    rewrite_for_tensorrt,
)
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError

NO_TRT = "TensorRT cannot be installed here: its library wheels come from NVIDIA's index"
OPTIONS = dict(target="tensorrt", max_seq_len=64, tokens_per_block=4, max_batch_size=4, max_num_tokens=32)
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def checkpoint(random_hf_model, tmp_path_factory):
    from trtbuild.builder.convert.convert import convert

    ckpt = tmp_path_factory.mktemp("trt") / "ckpt"
    convert(random_hf_model("qwen2"), ckpt)
    return ckpt


def _fused(checkpoint: Path, fuse_rope: bool = True, **options) -> tuple[onnx.ModelProto, object, BuildConfig]:
    from trtbuild.builder.convert.checkpoint import open_checkpoint

    config, tensors = open_checkpoint(checkpoint)
    build = BuildConfig(**{**OPTIONS, **options})
    model = build_network(config, tensors, build)
    if fuse_rope:
        run_passes(model, "tensorrt")
    return model, config, build


def _produced(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    return {i.name for i in g.input} | {i.name for i in g.initializer} | {o for n in g.node for o in n.output}


@pytest.mark.parametrize("fuse_rope", [True, False], ids=["rotary", "plain"])
def test_rewrite_makes_plugin_nodes_the_parser_can_find(checkpoint, fuse_rope):
    model, config, _ = _fused(checkpoint, fuse_rope)
    before = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    wanted = {o for n in before for o in n.output}
    plan = rewrite_for_tensorrt(model)
    nodes = model.graph.node
    assert not any(n.op_type == "PagedAttention" for n in nodes)
    attention = ROTARY_ATTENTION_PLUGIN if fuse_rope else ATTENTION_PLUGIN
    want = ([ROTARY_K_PLUGIN] if fuse_rope else []) + [attention]
    assert [p.plugin for p in plan] == want * config.num_hidden_layers
    plugin_nodes = [n for n in nodes if n.domain == NAMESPACE]
    for n in plugin_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_namespace"] == NAMESPACE.encode() and attrs["plugin_version"] == b"1"
        if n.op_type == attention:
            assert len(n.input) == (10 if fuse_rope else 7) and len(n.output) == 1
            assert attrs["num_heads"] == config.num_attention_heads and "rotary" not in attrs
    # every output the attention op had is still produced (the new_kv Concat reads k_new / v_new), in graph order
    seen = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    for n in nodes:
        assert all(not i or i in seen for i in n.input), n.name
        seen.update(n.output)
    assert wanted <= _produced(model)


def test_rewritten_reshapes_give_the_contract_shapes(checkpoint):
    """k_new / v_new are [T, KVH, D] Reshapes of the packed projections, as PagedAttention's outputs 1-2."""
    model, config, _ = _fused(checkpoint, fuse_rope=False)
    rewrite_for_tensorrt(model)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    reshapes = [n for n in model.graph.node if n.op_type == "Reshape" and n.name.endswith(("/k_new", "/v_new"))]
    assert len(reshapes) == 2 * config.num_hidden_layers
    for n in reshapes:
        np.testing.assert_array_equal(inits[n.input[1]], [-1, config.num_key_value_heads, config.head_size])


def test_refusals_name_what_is_missing(checkpoint):
    model, config, build = _fused(checkpoint)
    bad = onnx.helper.make_node("SpeculativeAccept", ["logits"], ["n", "t"], domain="trtbuild", name="accept")
    model.graph.node.append(bad)
    with pytest.raises(ConfigError, match="SpeculativeAccept TensorRT plugin, which is not written yet"):
        check_tensorrt_graph(model)
    draft = BuildConfig(**OPTIONS, speculative_decoding_mode="draft-tokens", max_draft_len=2)
    with pytest.raises(ConfigError, match="SpeculativeAccept TensorRT plugin"):
        check_tensorrt_buildable(config, draft)
    check_tensorrt_buildable(config, build)  # a float checkpoint is buildable


def test_soft_capped_attention_is_refused_with_what_to_do(checkpoint):
    model, _, _ = _fused(checkpoint)
    check_tensorrt_graph(model)  # no softcap: accepted
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    node.attribute.append(onnx.helper.make_attribute("softcap", 50.0))
    with pytest.raises(ConfigError, match="soft-caps its attention scores .*; build it for cpu or cuda"):
        check_tensorrt_graph(model)


@pytest.mark.parametrize("fuse_rope", [True, False], ids=["rotary", "plain"])
def test_attention_sinks_are_refused_with_what_to_do(checkpoint, fuse_rope):
    """gpt-oss's sinks (input 10) have no TensorRT plugin input yet: refused by name, never dropped silently."""
    model, config, _ = _fused(checkpoint, fuse_rope)
    node = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    model.graph.initializer.append(onnx.numpy_helper.from_array(
        np.zeros(config.num_attention_heads, np.float32), "sinks"))
    node.input.extend(([] if fuse_rope else ["", "", ""]) + ["sinks"])
    with pytest.raises(ConfigError, match="attention has sinks .*; build it for cpu or cuda"):
        rewrite_for_tensorrt(model)
    node.input[10] = ""  # an empty name is no sinks, and no plugin input
    rewrite_for_tensorrt(model)
    plugin = next(n for n in model.graph.node if n.name == f"{node.name}/attention")
    assert list(plugin.input) == [node.input[0], node.output[1], *node.input[2:10 if fuse_rope else 7]]


def test_profiles_cover_decode_and_mixed_steps(checkpoint):
    _, config, build = _fused(checkpoint)
    profiles = optimization_profiles(build, config)
    assert [p.name for p in profiles] == ["decode", "mixed"]
    for p in profiles:
        for name, (lo, opt, hi) in p.shapes.items():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)), name
        pool = p.shapes["kv_cache"]
        assert pool[2] == (max_pool_blocks(build), config.num_hidden_layers, 2, config.num_key_value_heads,
                           build.tokens_per_block, config.head_size)
        assert pool[0][1:] == pool[2][1:]  # only the block count is dynamic: the plugins compile the rest in
        assert p.shapes["block_tables"][0][1] == p.shapes["block_tables"][2][1] == build.max_blocks_per_seq
        assert p.shapes["query_start_loc"][2][0] == p.shapes["past_lengths"][2][0] + 1
    assert profiles[0].max_tokens == build.max_batch_size and profiles[1].max_tokens == build.max_num_tokens
    assert profile_for(profiles, 4, 4) == 0 and profile_for(profiles, 5, 2) == 1
    with pytest.raises(ValueError, match="exceeds every profile"):
        profile_for(profiles, build.max_num_tokens + 1, 1)
    assert "lora_ids" not in profiles[0].shapes
    with_lora = optimization_profiles(dataclasses.replace(build, lora_adapters=(("sql", "/a"),)), config)
    assert [p.shapes["lora_ids"] for p in with_lora] == [p.shapes["input_ids"] for p in profiles]  # one per token


def test_modules_import_without_tensorrt():
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    code = ("import sys; import trtbuild.builder.tensorrt.build, trtbuild.plugins.tensorrt.paged_attention, "
            "trtbuild.plugins.tensorrt.rotary_k, trtbuild.runtime.tensorrt_engine; "
            "assert 'tensorrt' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plugin_kernels_compile_to_ptx_in_tensorrt_argument_order():
    """triton.compile needs no GPU for PTX: each kernel's entry takes the plugin's inputs, one int32 extra arg (T),
    then its output, followed only by Triton's own trailing scratch pointers."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
    code = """
import re
from trtbuild.plugins.tensorrt import kernels as K
def params(c):
    return re.findall(r"\\.param\\s+(\\.\\w+)", c.asm["ptx"].split(".entry", 1)[1].split(")", 1)[0])
for rotary, fn, n_in in ((True, K.trt_paged_attention_rotary, 10), (False, K.trt_paged_attention, 7)):
    s = K.AttentionShape(3, 8, 2, 64, 16, 8, 4, 0.125, rotary)
    c = K.compile_ptx(fn, K.attention_signature(s), K.attention_constexprs(s, 16, 64), 90)
    print(c.metadata.name, n_in, params(c))
c = K.compile_ptx(K.trt_rotary_k, K.rotary_k_signature(), K.rotary_k_constexprs(2, 64), 90)
print(c.metadata.name, 4, params(c))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["trt_paged_attention_rotary", "trt_paged_attention",
                                                   "trt_rotary_k"]
    for line in lines:
        name, n_in, params = line.split(" ", 2)
        types = eval(params)  # noqa: S307 (our own subprocess's printed list)
        n_in = int(n_in)
        assert types[:n_in] == [".u64"] * n_in and types[n_in] == ".u32" and types[n_in + 1] == ".u64", line
        assert len(types) <= n_in + 2 + 2, line  # at most Triton's global and profile scratch pointers after


def test_plugin_kernels_match_the_reference_as_launched():
    """The exact kernels, constexprs and grid the AOT plugins hand TensorRT, run in Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
    out = subprocess.run([sys.executable, str(HERE / "tensorrt_kernel_check.py")], check=True, capture_output=True,
                         text=True, timeout=600)
    errors = [float(line.rsplit("=", 1)[1]) for line in out.stdout.strip().splitlines()]
    assert len(errors) == 4 and max(errors) < 1e-5, out.stdout


def test_engine_dir_of_tensorrt_without_tensorrt_says_what_to_do(tmp_path, llama_engine):
    import json
    import shutil

    from trtbuild.builder.engine_dir import engine_target, read_engine_config
    from trtbuild.errors import EngineCompatibilityError

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here")
    engine = tmp_path / "e"
    shutil.copytree(llama_engine, engine)
    doc = json.loads((engine / "config.json").read_text())
    doc["target"] = {"name": "tensorrt", "device": "NVIDIA H200", "tensorrt_version": "10.13.0"}
    (engine / "config.json").write_text(json.dumps(doc))
    assert engine_target(engine) == "tensorrt"
    with pytest.raises(EngineCompatibilityError, match=r"TensorRT engine.*not installed here; `pip install tensorrt`"):
        read_engine_config(engine, expect_target="tensorrt")


# --- needs TensorRT (and its GPU): written against the real API, never run here ---

def test_tensorrt_engine_matches_cpu_engine(random_hf_model, engine_from_hf, tmp_path):
    pytest.importorskip("tensorrt", reason=NO_TRT)
    from trtbuild.runtime.engine import CpuEngine, SequenceChunk
    from trtbuild.runtime.tensorrt_engine import TensorRTEngine

    src = random_hf_model("qwen2")
    options = {k: v for k, v in OPTIONS.items() if k != "target"}
    cpu = CpuEngine(engine_from_hf(src, **options), num_blocks=16)
    trt_dir = engine_from_hf(src, target="tensorrt", timing_cache=tmp_path / "trt.cache", **options)
    assert (trt_dir / "rank0.engine").is_file() and (tmp_path / "trt.cache").is_file()
    trt = TensorRTEngine(trt_dir, num_blocks=16)
    steps = [[SequenceChunk(0, [1, 5, 7, 9, 3], 0, 1, [3, 0]), SequenceChunk(1, [2, 4, 6], 0, 2, [5])],
             [SequenceChunk(0, [11], 5, 1, [3, 0]), SequenceChunk(1, [8, 9, 10, 12], 3, 1, [5, 1])]]
    for step in steps:
        np.testing.assert_allclose(trt.step(step), cpu.step(step), rtol=1e-4, atol=1e-4)
