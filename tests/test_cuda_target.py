"""`--target cuda` (builder/build_cuda.py, runtime/cuda_engine.py): the whole plan executed by CudaEngine against the
CPU engine. Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors (tests/conftest.py imports
triton for it), so the engines here are tiny and the steps short."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import STORIES260K, drive, require_shared_models

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev]); the cuda target needs it")

from trtbuild.builder.convert.convert import WeightOnly, convert  # noqa: E402
from trtbuild.builder.engine_dir import read_engine_config  # noqa: E402
from trtbuild.cli import main  # noqa: E402
from trtbuild.errors import EngineCompatibilityError  # noqa: E402
from trtbuild.runtime.config import RuntimeConfig  # noqa: E402
from trtbuild.runtime.cuda_engine import CudaEngine  # noqa: E402
from trtbuild.runtime.engine import CpuEngine, DraftAccept, SequenceChunk, in_every_group  # noqa: E402
from trtbuild.runtime.engine_core import EngineCore  # noqa: E402
from trtbuild.runtime.sampling import SamplingParams  # noqa: E402
from trtbuild.runtime.speculative import SpeculativeConfig  # noqa: E402

BS = 4  # tokens per block: small, so that short sequences cross block boundaries
OPTIONS = dict(max_seq_len=64, tokens_per_block=BS, max_batch_size=4, max_num_tokens=32)
GPU = torch.cuda.is_available()


def _source(name: str, random_hf_model):
    if name == "stories260K":
        require_shared_models()
        return STORIES260K
    return random_hf_model(name)


@pytest.fixture(scope="module")
def engine_pair(random_hf_model, engine_from_hf):
    """factory(model) -> (CPU engine dir, cuda engine dir), built from the same checkpoint options."""
    def get(name: str):
        src = _source(name, random_hf_model)
        return engine_from_hf(src, **OPTIONS), engine_from_hf(src, target="cuda", **OPTIONS)

    return get


# Three steps over two sequences (blocks of 4): fresh prefills (5 and 3 tokens, 2 logits rows for one), then a
# mixed step (a decode token beside a continuing prefill chunk), then two decode tokens, one of them the first
# token of a new block (position 8) and one the last slot of its block (position 7).
STEPS = [
    [SequenceChunk(0, [1, 5, 7, 9, 3], 0, 1, [3, 0]), SequenceChunk(1, [2, 4, 6], 0, 2, [5])],
    [SequenceChunk(0, [11], 5, 1, [3, 0]), SequenceChunk(1, [8, 9, 10, 12], 3, 1, [5, 1])],
    [SequenceChunk(0, [13], 6, 1, [3, 0]), SequenceChunk(1, [14], 7, 1, [5, 1])],
    [SequenceChunk(0, [15], 7, 1, [3, 0]), SequenceChunk(1, [16], 8, 1, [5, 1, 2])],
]


@pytest.mark.parametrize("model", ["stories260K", "qwen2", "mistral_window", "gemma2", "gemma3", "granite", "olmo3",
                                   "glm4", "cohere2", "ministral3", "arcee", "starcoder2", "qwen3_moe", "mixtral",
                                   "olmoe", "qwen2_moe", "granitemoe", "gpt_oss", "lfm2", "lfm2_wide",
                                   "lfm2_moe", "lfm2_moe_raw", "granite4_moe", "apertus", "afmoe", "glm", "qwen3_5",
                                   "granite4_h", "nemotron_h", "mamba2"])
def test_cuda_plan_matches_cpu_engine(engine_pair, model):
    cpu_dir, cuda_dir = engine_pair(model)
    groups = len(read_engine_config(cpu_dir).kv_cache_groups)  # Gemma 2 / 3, OLMo 3: a table per group
    cpu, cuda = CpuEngine(cpu_dir, num_blocks=8 * groups), CudaEngine(cuda_dir, num_blocks=8 * groups)
    for i, chunks in enumerate(STEPS):
        chunks = in_every_group(chunks, groups, 8)
        want, got = cpu.step(chunks), cuda.step(chunks)
        assert got.shape == want.shape == (sum(c.num_logits for c in chunks), cpu.info.model.vocab_size)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=f"step {i}")
    # the K/V each step wrote, slot by slot (the scratch block past the pool's blocks aside)
    np.testing.assert_allclose(cuda.kv.pool[: cuda.kv.num_blocks].float().cpu().numpy(), cpu.kv.pool, atol=1e-5,
                               rtol=1e-6)  # NOTE: ONNX Runtime's GEMMs round differently per instruction set
    if cpu.states is not None:  # the recurrent layers' states in the slots of both sequences
        np.testing.assert_allclose(cuda.states[:2].cpu().numpy(), cpu.states.states[:2], atol=1e-5, rtol=1e-5)


def test_cuda_engine_directory_describes_itself(engine_pair):
    _, cuda_dir = engine_pair("qwen2")
    info = read_engine_config(cuda_dir, expect_target="cuda")
    assert info.target["name"] == "cuda" and info.build.target == "cuda"
    assert set(info.target) >= {"device", "compute_capability", "cuda_version", "torch_version", "triton_version"}
    if not GPU:
        assert info.target["device"] == "cpu (Triton interpreter)"
    plan = json.loads((cuda_dir / "rank0.plan.json").read_text())
    kernels = [s["kernel"] for s in plan["steps"]]
    layers = info.model.num_hidden_layers
    assert kernels.count("paged_attention") == kernels.count("kv_write") == layers
    assert kernels.count("swiglu") == layers and kernels.count("add_rmsnorm") == 2 * layers - 1
    assert kernels.count("linear") == 4 * layers + 1  # qkv, dense, gate_up, proj per layer; lm_head
    assert info.tactics["paged_attention"]["chosen"]["num_splits"] == 1
    assert [o["name"] for o in info.io["outputs"]] == ["logits"]


def test_autotune_without_gpu_records_defaults_and_why(random_hf_model, engine_from_hf, tmp_path):
    if GPU:
        pytest.skip("on a GPU, --autotune times the kernels (scripts/gpu_check.sh)")
    engine = engine_from_hf(random_hf_model("qwen2"), target="cuda", autotune="fast", **OPTIONS)
    tactics = read_engine_config(engine, expect_target="cuda").tactics
    assert "needs a GPU" in tactics["paged_attention"]["source"]


@pytest.mark.parametrize("model", ["stories260K", "lfm2", "qwen3_5"])
def test_greedy_generation_equals_cpu_engine(engine_pair, model):
    """Through EngineCore (LFM2: convolution groups whose blocks are released as sequences advance; Qwen3.5: state
    slots handed out by the KV cache manager)."""
    cpu_dir, cuda_dir = engine_pair(model)
    config = RuntimeConfig(kv_cache_blocks=32, warm_up=False)
    prompts = ["Once upon a time", "The cat"] if model == "stories260K" else [[5, 9, 3, 7, 11, 2, 8], [2, 4]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    cuda_core = EngineCore(cuda_dir, config)
    assert isinstance(cuda_core.engine, CudaEngine)
    want, _, _ = drive(EngineCore(cpu_dir, config), prompts, params)
    got, _, _ = drive(cuda_core, prompts, params)
    assert got == want and all(len(t) == 6 for t in got)


def test_weight_only_int4_plan_matches_cpu_engine(random_hf_model, engine_from_hf, tmp_path):
    """Weight-only int4 (groups of 32) through the Triton weight-only GEMM, against MatMulNBits at fp32 compute."""
    ckpt = tmp_path / "ckpt"
    convert(random_hf_model("qwen2"), ckpt, weight_only=WeightOnly(4, 32))
    from trtbuild.builder.build import build_engine

    cpu = CpuEngine(build_engine(ckpt, tmp_path / "cpu", int4_accuracy_level=1, **OPTIONS), num_blocks=8)
    cuda = CudaEngine(build_engine(ckpt, tmp_path / "cuda", target="cuda", **OPTIONS), num_blocks=8)
    kernels = [s["kernel"] for s in json.loads((tmp_path / "cuda" / "rank0.plan.json").read_text())["steps"]]
    assert "weight_only_linear" in kernels
    for chunks in STEPS[:2]:
        np.testing.assert_allclose(cuda.step(chunks), cpu.step(chunks), atol=1e-4, rtol=0)


def test_weight_only_experts_plan_matches_cpu_engine(random_hf_model, tmp_path):
    """Weight-only int4 experts (as a GGUF's) are dequantized into the cuda plan's fused MoE, as the CPU engine's
    ONNX Runtime MoE holds them (--quant-linears ort); the other linears stay weight-only on both."""
    ckpt = tmp_path / "ckpt"
    convert(random_hf_model("qwen3_moe"), ckpt, weight_only=WeightOnly(4, 32))
    from trtbuild.builder.build import build_engine

    cpu = CpuEngine(build_engine(ckpt, tmp_path / "cpu", quant_linears="ort", int4_accuracy_level=1, **OPTIONS),
                    num_blocks=8)
    cuda = CudaEngine(build_engine(ckpt, tmp_path / "cuda", target="cuda", **OPTIONS), num_blocks=8)
    kernels = [s["kernel"] for s in json.loads((tmp_path / "cuda" / "rank0.plan.json").read_text())["steps"]]
    assert kernels.count("moe") == 2 and "weight_only_linear" in kernels
    # NOTE: 2e-4: the weight-only linears alone differ by up to ~1e-4 here (MatMulNBits and the Triton GEMM sum
    # in other orders; 9.5e-5 measured on a weight-only Qwen3 without experts)
    for chunks in STEPS[:2]:
        np.testing.assert_allclose(cuda.step(chunks), cpu.step(chunks), atol=2e-4, rtol=0)


# quantized checkpoint -> (format, quantize_checkpoint options, the plan kernel its linears become)
QUANTIZED = {"int4_awq": ("int4_awq", {}, "weight_only_linear"),
             "int4_awq-own_prequant-lm_head_int8": ("int4_awq", dict(shared_prequant=False, lm_head_int8=True),
                                                    "weight_only_linear"),
             "int8_sq": ("int8_sq", {}, "int8_linear"),
             "int8_sq-per_token": ("int8_sq", dict(per_token=True, shared_prequant=False), "int8_linear"),
             "fp8-lm_head": ("fp8", dict(exclude=()), "fp8_linear")}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_checkpoint_plan_matches_cpu_engine(name, random_hf_model, tmp_path):
    """trtbuild quantize's formats (builder/cuda_plan_quant.py): int4_awq through the weight-only GEMM (its prequant
    a `mul` step), int8_sq through the int8 GEMM (static or per-token activation scales), fp8 through
    torch._scaled_mm; each against the CPU engine (a float32 KV pool on both)."""
    from quant_helpers import calibrate, quantize_checkpoint

    from trtbuild.builder.build import build_engine

    algo, options, kernel = QUANTIZED[name]
    hf = random_hf_model("qwen2")
    convert(hf, tmp_path / "float")
    ckpt = quantize_checkpoint(tmp_path / "float", tmp_path / "ckpt", algo, None,
                               calibrate(hf, list(range(3, 40))), **options)
    # NOTE: int4 accuracy level 1: float activations, as the weight-only GEMM's
    cpu = CpuEngine(build_engine(ckpt, tmp_path / "cpu", kv_pool_dtype="float32", int4_accuracy_level=1, **OPTIONS),
                    num_blocks=8)
    cuda = CudaEngine(build_engine(ckpt, tmp_path / "cuda", target="cuda", **OPTIONS), num_blocks=8)
    kernels = [s["kernel"] for s in json.loads((tmp_path / "cuda" / "rank0.plan.json").read_text())["steps"]]
    assert kernels.count(kernel) == 2 * 7 + ("lm_head" in name)  # 7 linears a layer (q, k, v apart), lm_head
    for i, chunks in enumerate(STEPS):
        np.testing.assert_allclose(cuda.step(chunks), cpu.step(chunks), atol=1e-4, rtol=0, err_msg=f"step {i}")


def test_int8_kv_cache_plan_matches_cpu_engine(random_hf_model, tmp_path):
    """An int8 KV cache: the plan's kv_write stores what the CPU engine stores (round half to even of x / scale,
    clipped), and its attention reads the pool in units of the layer's scales."""
    from quant_helpers import calibrate, quantize_checkpoint

    from trtbuild.builder.build import build_engine

    hf = random_hf_model("qwen2")
    convert(hf, tmp_path / "float")
    ckpt = quantize_checkpoint(tmp_path / "float", tmp_path / "ckpt", None, "int8", calibrate(hf, list(range(3, 40))))
    cpu = CpuEngine(build_engine(ckpt, tmp_path / "cpu", **OPTIONS), num_blocks=8)
    cuda = CudaEngine(build_engine(ckpt, tmp_path / "cuda", target="cuda", **OPTIONS), num_blocks=8)
    assert cuda.kv.pool.dtype == torch.int8 and cpu.kv.pool.dtype == np.int8
    for i, chunks in enumerate(STEPS):
        np.testing.assert_allclose(cuda.step(chunks), cpu.step(chunks), atol=1e-4, rtol=0, err_msg=f"step {i}")
    stored = cuda.kv.pool[: cuda.kv.num_blocks].cpu().numpy().astype(np.int32)
    assert np.abs(stored - cpu.kv.pool).max() <= 1 and (stored != cpu.kv.pool).mean() < 1e-3  # ties apart
    assert np.abs(stored).max() > 64  # the scales put the values in int8's range


def test_other_gpu_or_stack_is_refused_with_the_rebuild_command(engine_pair, tmp_path):
    import shutil

    _, cuda_dir = engine_pair("qwen2")
    moved = tmp_path / "engine"
    shutil.copytree(cuda_dir, moved)
    doc = json.loads((moved / "config.json").read_text())
    doc["target"].update(device="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    (moved / "config.json").write_text(json.dumps(doc))
    for load in (lambda: CudaEngine(moved), lambda: EngineCore(moved, RuntimeConfig(kv_cache_blocks=8))):
        with pytest.raises(EngineCompatibilityError) as e:
            load()
        message = e.value.format_message()
        assert "NVIDIA H100 80GB HBM3" in message and "compute_capability" in message
        assert "trtbuild build --checkpoint <checkpoint dir> --output <new engine dir> --target cuda" in message
    with pytest.raises(EngineCompatibilityError, match="built for target 'cuda'"):
        CpuEngine(moved)


def test_target_tensorrt_says_what_to_install(tmp_path):
    require_shared_models()
    runner = CliRunner()
    ckpt = tmp_path / "ckpt"
    assert runner.invoke(main, ["convert", "--model", str(STORIES260K), "--output", str(ckpt)]).exit_code == 0
    result = runner.invoke(main, ["build", "--checkpoint", str(ckpt), "--output", str(tmp_path / "e"),
                                  "--target", "tensorrt"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and "pip install tensorrt" in lines[0]
    assert "Traceback" not in result.output and not (tmp_path / "e").exists()


def test_padded_decode_batch_equals_the_unpadded_step(engine_pair):
    """What a CUDA graph of a larger batch replays, run eagerly: the real rows' logits and K/V are those of the
    unpadded step, and the padding rows write only into the scratch block."""
    _, cuda_dir = engine_pair("qwen2")
    padded, plain = CudaEngine(cuda_dir, num_blocks=8), CudaEngine(cuda_dir, num_blocks=8)
    for chunks in STEPS[:3]:
        plain.step(chunks)
        padded.step(chunks)
    decode = STEPS[3]
    want = plain.step(decode)
    got = padded.forward(padded.inputs(decode, pad_to=4), max_query_len=1)
    np.testing.assert_allclose(got["logits"][: len(decode)].float().numpy(), want, atol=1e-5, rtol=0)
    blocks = padded.kv.num_blocks
    # NOTE: close, not bitwise: a 4-row GEMM may round otherwise than a 2-row one; a padding row's K/V landing in a
    # sequence's block would differ by O(1)
    np.testing.assert_allclose(padded.kv.pool[:blocks].numpy(), plain.kv.pool[:blocks].numpy(), atol=1e-5, rtol=0)
    assert padded.kv.pool[blocks].abs().sum() > 0


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU; on the CPU every step runs eagerly (interpreter)")
def test_cuda_graph_decode_equals_eager(engine_pair):
    _, cuda_dir = engine_pair("qwen2")
    graphed, eager = CudaEngine(cuda_dir, num_blocks=8), CudaEngine(cuda_dir, num_blocks=8)
    eager.use_cuda_graphs = False
    for chunks in STEPS:
        np.testing.assert_allclose(graphed.step(chunks), eager.step(chunks), atol=1e-5, rtol=0)
    assert graphed.graphs  # the decode steps replayed a captured graph


def test_gpu_check_parity_and_text_run_here(engine_pair):
    """The Python side of scripts/gpu_check.sh that needs no GPU: parity over its steps (a block boundary crossed)
    and the greedy text of both engines."""
    from trtbuild.bench.gpu_check import greedy_text, parity

    assert parity(*engine_pair("qwen2")) < 1e-4
    cpu_dir, cuda_dir = engine_pair("stories260K")
    assert greedy_text(cuda_dir, "Once upon a time", 3) == greedy_text(cpu_dir, "Once upon a time", 3)


def test_draft_tokens_engine_verifies_as_the_cpu_engine(engine_from_hf):
    """SpeculativeAccept as a plan step: only the other chunks' rows leave the engine, the accept results are the CPU
    draft-tokens engine's (greedy and sampled), and n-gram speculative decoding gives its tokens."""
    require_shared_models()
    options = dict(OPTIONS, speculative_decoding_mode="draft-tokens", max_draft_len=3)
    cpu_dir, cuda_dir = engine_from_hf(STORIES260K, **options), engine_from_hf(STORIES260K, target="cuda", **options)
    plan = json.loads((cuda_dir / "rank0.plan.json").read_text())
    assert [s["kernel"] for s in plan["steps"]][-2:] == ["speculative_accept", "gather_rows"]
    io = read_engine_config(cuda_dir, expect_target="cuda").io
    assert {o["name"] for o in io["outputs"]} == {"logits", "num_accepted", "next_tokens"}
    assert {i["name"] for i in io["inputs"]} >= {"logits_out_rows", "uniforms"}
    cpu, cuda = CpuEngine(cpu_dir, num_blocks=8), CudaEngine(cuda_dir, num_blocks=8)
    assert cuda.max_draft_len == 3
    greedy = int(cpu.step([SequenceChunk(9, [2, 4], 0, 1, [4])])[0].argmax())  # block 4: no chunk below reads it
    # the greedy drafts: the argmax, then another token; the sampled ones: u = 0 accepts the first two
    chunks = [SequenceChunk(0, [1, 5, 7, 9, 3], 0, 2, [3, 0]),
              SequenceChunk(1, [2, 4, greedy, 8], 0, 3, [5], DraftAccept((greedy, 8), 0.0)),
              SequenceChunk(2, [2, 4, 6, 8], 0, 4, [6], DraftAccept((4, 6, 8), 0.8, (0.0, 0.0, 0.9, 0.3))),
              SequenceChunk(3, [9], 0, 1, [7], DraftAccept((), 1.0, (0.6,)))]
    want, got = cpu.execute(chunks), cuda.execute(chunks)
    assert got.logits.shape == want.logits.shape == (2, cpu.info.model.vocab_size)
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-4, rtol=0)
    assert got.accepted == want.accepted and set(got.accepted) == {1, 2, 3}
    assert got.accepted[1][0] >= 1 and got.accepted[2][0] >= 2

    config = RuntimeConfig(kv_cache_blocks=32, warm_up=False, speculative=SpeculativeConfig(3))
    prompts = ["Tom had a big red ball. Tom had a big red ball. Tom", 'Mom said, "Yes, yes, yes']
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=1, ignore_eos=True)]
    want_tokens, _, _ = drive(EngineCore(cpu_dir, config), prompts, params)
    core = EngineCore(cuda_dir, config)
    execute, verified = core.engine.execute, []

    def counting(step_chunks):
        out = execute(step_chunks)
        verified.append(len(out.accepted))
        return out

    core.engine.execute = counting
    got_tokens, finals, _ = drive(core, prompts, params)
    assert got_tokens == want_tokens and sum(verified) > 0
    assert sum(f.metrics.num_accepted_draft_tokens for f in finals) > 0


def test_lora_plan_matches_cpu_engine(engine_from_hf, lora_adapters):
    """LoRA adapters (builder/lora.py) in the plan: each chunk under its own adapter, as in the CPU engine, and a
    decode batch padded for a CUDA graph (padding rows under no adapter)."""
    adapters = tuple((name, str(path)) for name, path in lora_adapters.items())
    cpu = CpuEngine(engine_from_hf(STORIES260K, lora_adapters=adapters, **OPTIONS), num_blocks=8)
    cuda = CudaEngine(engine_from_hf(STORIES260K, target="cuda", lora_adapters=adapters, **OPTIONS), num_blocks=8)
    for i, chunks in enumerate(STEPS):
        chunks = [dataclasses.replace(c, lora_id=1 + j) for j, c in enumerate(chunks)]  # sql, poem
        np.testing.assert_allclose(cuda.step(chunks), cpu.step(chunks), atol=1e-4, rtol=0, err_msg=f"step {i}")
    decode = [dataclasses.replace(STEPS[3][0], lora_id=2), STEPS[3][1]]  # the last step again, rewriting its K/V
    want = cpu.step(decode)
    padded = cuda.inputs(decode, pad_to=4)
    assert padded["lora_ids"].tolist() == [2, 0, 0, 0]
    got = cuda.forward(padded, max_query_len=1)["logits"][:2].float().numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
