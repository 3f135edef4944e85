"""Tensor-parallel cpu engines (builder/tensor_parallel.py, runtime/tensor_parallel.py, cpu_ops/collectives.cc):
a checkpoint converted with --tp-size 2 builds one graph per rank, runs as one process per rank, and computes what
the single-rank engine of the same model computes; a rank that fails or dies stops the engine with its reason.

Tolerance: max |tp - single| / max |single| <= 1e-4 over every logit row (the partial sums add in another order).
"""

from __future__ import annotations

import contextlib
import gc
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import STORIES260K, require_shared_models

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.tensor_parallel import RankStopped, TensorParallelEngine, make_cpu_engine

RTOL = 1e-4
# dense biases after the all-reduce (llama_bias), q / k / v biases (qwen2), per-head q / k norms (qwen3), a tied
# head and Gemma 2's embedding multiplier, soft-caps and sandwich norms, a partial rotary's per-head row order
# (phi3_partial), Cohere's parallel residual and LayerNorms, StarCoder 2's MLP biases, a vocabulary of 321 rows
# that two ranks split as 161 + 160 (odd_vocab); bfloat16 weights, which DenseMatMul packs per rank; mixtures of
# experts, each expert's features split (Qwen2-MoE's shared expert too, summed before the one all-reduce); OLMo 2's
# and OLMoE's q / k norms over the whole projection (their mean squares all-reduced)
FAMILIES = [("llama", "float32"), ("llama_bias", "float32"), ("qwen2", "float32"), ("qwen3", "float32"),
            ("gemma2", "float32"), ("phi3_partial", "float32"), ("cohere", "float32"), ("starcoder2", "float32"),
            ("odd_vocab", "float32"), ("qwen2", "bfloat16"),
            ("qwen3_moe", "float32"), ("qwen2_moe", "float32"), ("mixtral", "float32"), ("olmo2", "float32"),
            ("olmoe", "float32"), ("afmoe", "float32"), ("apertus", "float32"), ("granite4_moe", "float32")]


@pytest.fixture(scope="module")
def engines(hf_dir, tmp_path_factory, library):
    """(name, dtype) -> (single-rank engine dir, tensor-parallel engine dir) of the same model."""
    cache = {}

    def get(name: str, dtype: str = "float32", source=None):
        if (name, dtype) not in cache:
            root = tmp_path_factory.mktemp(f"tp_{name}_{dtype}")
            model = source or hf_dir(name)
            dirs = []
            for tp in (1, 2):
                convert(model, root / f"ckpt{tp}", dtype=dtype, tp_size=tp)
                dirs.append(build_engine(root / f"ckpt{tp}", root / f"engine{tp}", max_seq_len=128))
            cache[name, dtype] = tuple(dirs)
        return cache[name, dtype]

    return get


BLOCKS = 8  # per KV cache group


def steps(engine, vocab: int) -> list[np.ndarray]:
    """Logits of a mixed step (two prompts of 40 and 17 tokens), then of four decode steps of both sequences."""
    prompt = [(7 * i + 3) % (vocab - 1) + 1 for i in range(40)]
    tables = ([0, 1, 2, 3], [4, 5, 6])
    groups = len(engine.kv.groups)

    def step(chunks: list[SequenceChunk]) -> np.ndarray:
        return engine.step(in_every_group(chunks, groups, BLOCKS))

    out = [step([SequenceChunk(0, prompt, 0, 1, tables[0]), SequenceChunk(1, prompt[:17], 0, 3, tables[1])])]
    for i in range(4):
        out.append(step([SequenceChunk(0, [int(out[-1][0].argmax())], 40 + i, 1, tables[0]),
                         SequenceChunk(1, [5 + i], 17 + i, 1, tables[1])]))
    return out


def blocks(info) -> int:
    return BLOCKS * len(info.kv_cache_groups)


def assert_quantized_ranks_agree(logits: dict[tuple[int, int], list[np.ndarray]]) -> None:
    """logits[(ranks, accuracy level)]: with float activations (level 1) two ranks compute one rank's logits; with
    int8 activations (level 4) each is as close to those as the single rank is (a rounding flipped by the partial
    sums' order changes a code, so the two are not bit for bit alike)."""
    for step, reference in enumerate(logits[1, 1]):
        scale = np.abs(reference).max()
        assert np.abs(logits[2, 1][step] - reference).max() <= RTOL * scale
        single = np.abs(logits[1, 4][step] - reference).max()
        assert np.abs(logits[2, 4][step] - reference).max() <= max(2 * single, 0.02 * scale)


@contextlib.contextmanager
def opened(engine_dir):
    """The engine of `engine_dir` (one rank or several), closed after."""
    info = read_engine_config(engine_dir)
    engine = make_cpu_engine(info, num_threads=2, num_blocks=blocks(info))
    try:
        yield engine
    finally:
        if isinstance(engine, TensorParallelEngine):
            engine.close()


@pytest.mark.parametrize(("name", "dtype"), FAMILIES)
def test_two_ranks_compute_the_single_rank_logits(name, dtype, engines):
    single, parallel = engines(name, dtype)
    info = read_engine_config(parallel)
    assert info.model.mapping.tp_size == 2 and set(info.weight_files) == {"rank0.weights", "rank1.weights"}
    ops = [[n.op_type for n in onnx.load(str(parallel / f"rank{r}.onnx"), load_external_data=False).graph.node
            if n.domain == "trtbuild" and n.op_type.startswith("All")] for r in (0, 1)]
    layers = info.model.num_hidden_layers
    norms = 2 * layers if info.model.qk_norm_full else 0  # the q / k norms' mean squares
    assert ops[0] == ops[1] and ops[0].count("AllReduce") == 1 + 2 * layers + norms
    assert ops[0].count("AllGather") == 1
    vocab = info.model.vocab_size
    with opened(single) as engine:
        want = steps(engine, vocab)
    with opened(parallel) as engine:
        got = steps(engine, vocab)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (len(g), vocab)
        assert np.abs(g - w).max() / np.abs(w).max() <= RTOL


def test_each_rank_holds_its_share_of_the_kv_pool(engines):
    single, parallel = engines("qwen2")
    one = read_engine_config(single)
    two = read_engine_config(parallel)
    assert two.kv_cache_input["shape"][3] * 2 == one.kv_cache_input["shape"][3]  # KV heads per rank
    assert two.kv_cache_bytes_per_block == one.kv_cache_bytes_per_block  # over both ranks
    engine = TensorParallelEngine(two, num_threads=2, num_blocks=8)
    try:
        assert engine.kv.bytes_per_block == one.kv_cache_bytes_per_block
        assert engine.rank0.kv.pool.shape[3] == two.kv_cache_input["shape"][3]
        steps(engine, 320)
        channel = f"trtbuild-tp-{engine.channel.id:x}"
        assert channel in Path("/proc/self/maps").read_text()  # the collectives mapped it
    finally:
        engine.close()
    del engine
    gc.collect()
    assert channel not in Path("/proc/self/maps").read_text()  # unmapped with the session's kernels


def test_stories260k_generates_the_same_text_on_two_ranks(engines, tmp_path):
    """The real model through LLM (the scheduler, the sampler, prefix caching, a beam search's block copies)."""
    require_shared_models()
    single, parallel = engines("stories260K", source=STORIES260K)
    prompts = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    beams = SamplingParams(max_tokens=12, beam_width=2)
    texts = []
    for engine_dir in (single, parallel):
        llm = LLM(engine_dir, RuntimeConfig(num_threads=2))
        try:
            texts.append([o.text for o in llm.generate(prompts, greedy)] + [llm.generate(prompts[:1], beams)[0].text])
        finally:
            llm.close()
    assert texts[0] == texts[1]
    assert all(len(t) > 20 for t in texts[1])


def test_a_rank_that_dies_stops_the_engine_with_its_reason(engines):
    _, parallel = engines("llama")
    engine = TensorParallelEngine(read_engine_config(parallel), num_threads=2, num_blocks=8)
    try:
        engine.ranks.processes[0].kill()
        engine.ranks.processes[0].wait()
        with pytest.raises(RankStopped, match=r"rank 1.*(exit code -9|gone).*start it again"):
            steps(engine, 320)
        with pytest.raises(RankStopped, match="rank 1"):  # and every later call
            engine.kv.reserve()
    finally:
        engine.close()


def test_bad_chunks_are_refused_before_any_rank_runs(engines):
    _, parallel = engines("llama")
    engine = TensorParallelEngine(read_engine_config(parallel), num_threads=2, num_blocks=8)
    try:
        with pytest.raises(ValueError):
            engine.step([SequenceChunk(0, [], 0, 1, [0])])
        assert steps(engine, 320)[-1].shape == (2, 320)  # the engine still steps
    finally:
        engine.close()


def test_a_rank_whose_engine_files_are_missing_fails_to_start(engines, tmp_path):
    import shutil

    _, parallel = engines("llama")
    broken = shutil.copytree(parallel, tmp_path / "engine")
    (broken / "rank1.onnx").unlink()
    with pytest.raises(RankStopped, match=r"rank 1 failed.*rank1.onnx is missing"):
        TensorParallelEngine(read_engine_config(broken), num_threads=2, num_blocks=8)


@pytest.mark.parametrize(("overrides", "pattern"), [
    ({"autotune": "fast"}, "--autotune off"),
    ({"max_loras": 2, "max_lora_rank": 8}, "LoRA adapters are not split"),
])
def test_tensor_parallel_builds_refuse_what_they_cannot_split(overrides, pattern, hf_dir, tmp_path, library):
    convert(hf_dir("llama"), tmp_path / "ckpt", tp_size=2)
    with pytest.raises((ConfigError, TrtbuildError), match=pattern):
        build_engine(tmp_path / "ckpt", tmp_path / "engine", **overrides)
    assert not (tmp_path / "engine").exists()


def test_pipeline_parallel_checkpoints_are_refused_with_the_way_out(hf_dir, tmp_path):
    convert(hf_dir("llama"), tmp_path / "ckpt", tp_size=1, pp_size=2)
    with pytest.raises(TrtbuildError, match=r"pp=2.*no pipeline-parallel ranks.*--tp-size 1 --pp-size 1"):
        build_engine(tmp_path / "ckpt", tmp_path / "engine")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["mapping"]["pp_size"] == 2


def test_a_quantized_gguf_splits_over_two_ranks_as_it_is(tmp_path, library):
    """A GGUF's low-bit linears stay low-bit on each rank (codes, scales and zero points split by whole groups; Q4_K
    and Q5_K row-parallel shares of 128 inputs, half a super-block), computing what one rank computes
    (`assert_quantized_ranks_agree`)."""
    import gguf
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp

    q = gguf.GGMLQuantizationType
    hf = make_hf_folder("qwen2", tmp_path / "hf", overrides={"hidden_size": 256, "intermediate_size": 512})
    kinds = [q.Q4_K, q.Q8_0, q.Q6_K, q.Q5_K, q.Q4_0]
    names = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    qtypes = {f"blk.{layer}.{n}.weight": kinds[(i + layer) % len(kinds)] for layer in range(2)
              for i, n in enumerate(names)}
    path = write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "qwen2",
                                     {**qtypes, "token_embd.weight": q.Q6_K, "output.weight": q.Q8_0})
    logits = {}
    for tp in (1, 2):
        config = convert(path, tmp_path / f"ckpt{tp}", tp_size=tp)
        assert config.quantization.quant_algo == "weight_only" and not config.quantization.exclude_modules
        for level in (1, 4):
            engine_dir = build_engine(tmp_path / f"ckpt{tp}", tmp_path / f"engine{tp}_{level}",
                                      int4_accuracy_level=level)
            with opened(engine_dir) as engine:
                logits[tp, level] = steps(engine, config.vocab_size)
    assert_quantized_ranks_agree(logits)


def test_a_weight_only_split_needs_whole_groups_on_each_rank(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"48 per rank, not a multiple of its 4-bit weights' group of 32"):
        convert(hf_dir("qwen2"), tmp_path / "ckpt", tp_size=2, weight_only=WeightOnly(4, 32))
    assert not (tmp_path / "ckpt").exists()


def test_eval_scores_the_ranks_as_the_single_rank_and_verify_says_what_it_takes(engines, tmp_path):
    from trtbuild.bench.perplexity import evaluate
    from trtbuild.bench.verify import verify_engine
    from trtbuild.errors import EngineCompatibilityError

    single, parallel = engines("qwen2")
    ids = [(5 * i + 2) % 300 + 1 for i in range(90)]
    one, two = (evaluate(e, ids, max_seq_len=64, num_threads=2) for e in (single, parallel))
    assert abs(one.perplexity - two.perplexity) <= 1e-4 * one.perplexity
    with pytest.raises(EngineCompatibilityError, match=r"tensor-parallel engine of 2 ranks.*--tp-size 1"):
        verify_engine(parallel, parallel.parent / "ckpt2")
    with pytest.raises(EngineCompatibilityError, match=r"tensor-parallel engine of 2 ranks.*LLM run"):
        CpuEngine(read_engine_config(parallel))


def test_bench_reports_the_ranks_threads_and_pools_together(engines):
    from trtbuild.bench.run import BenchOptions, run_bench

    single, parallel = engines("qwen2")
    r = run_bench(BenchOptions(engine=parallel, compare_engine=single, num_requests=4, input_len=12, output_len=6,
                               concurrency=2, threads=2, kv_cache_blocks=16))
    assert r["completed"] == r["engine"]["completed"] == 4
    assert r["threads"] == r["engine"]["threads"] == 2  # one a rank, against two in one
    assert r["kv_pool_bytes"] == r["engine"]["kv_pool_bytes"] and r["kv_bytes_per_token"] == \
        r["engine"]["kv_bytes_per_token"]


def test_a_rank_that_stops_answering_stops_the_engine(engines, monkeypatch):
    import signal

    from trtbuild.runtime import tensor_parallel

    _, parallel = engines("llama")
    monkeypatch.setattr(tensor_parallel, "COLLECTIVE_SECONDS", 1.0)
    monkeypatch.setattr(tensor_parallel, "ANSWER_SECONDS", 0.5)
    engine = TensorParallelEngine(read_engine_config(parallel), num_threads=2, num_blocks=8)
    try:
        engine.ranks.processes[0].send_signal(signal.SIGSTOP)  # alive, but never reaches the first collective
        waited = r"rank 0 failed .*the other tensor-parallel ranks did not arrive within 1\.0+ s"
        with pytest.raises(RankStopped, match=waited):
            steps(engine, 320)
        with pytest.raises(RankStopped, match=waited):  # and every later call
            engine.kv.reserve()
    finally:
        engine.ranks.processes[0].send_signal(signal.SIGCONT)
        engine.close()


def test_triton_serves_a_tensor_parallel_engine(engines, tmp_path):
    """The Triton model's stub runs the ranks too (its worker processes start from the stub's Python): the stream
    equals the single-rank engine's greedy text, and stopping the server leaves no rank or channel behind."""
    import os

    from triton_helpers import TIMEOUT, Stream, TritonServer, write_repo

    require_shared_models()
    single, parallel = engines("stories260K", source=STORIES260K)
    llm = LLM(single, RuntimeConfig(num_threads=1))
    want = llm.generate(["Lily went to the park"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    server = TritonServer(write_repo(parallel, tmp_path / "repo", ["--threads", "2"]), tmp_path / "server.log")
    stream = None
    try:
        assert server.ready.wait(TIMEOUT) and server.proc.poll() is None, f"{server.lines}\n{server.log.read_text()}"
        stream = Stream(server)
        stream.send(stream=True, text_input="Lily went to the park", max_tokens=20, ignore_eos=True)
        assert stream.collect()[:2] == (want.token_ids, want.text)
    finally:
        if stream is not None:
            stream.close()
        server.stop()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("trtbuild-tp-")]


def test_ranks_run_on_their_numa_nodes(engines, tmp_path):
    """Nodes read from sysfs's CPU lists; as many runs of whole nodes as ranks, or none where the nodes are fewer;
    each rank pinned to its set (rank 0: the threads that load and step it), computing the same logits."""
    import os

    from trtbuild.runtime.cpu_topology import numa_node_cpus, parse_cpu_list, rank_cpu_sets

    assert parse_cpu_list("0-3,8-9,12\n") == {0, 1, 2, 3, 8, 9, 12}
    for node, cpus in enumerate(["0-1", "2-3", "", "4"]):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    allowed = os.sched_getaffinity(0)
    assert numa_node_cpus(tmp_path) == [c for c in ({0, 1}, {2, 3}, {4}) if c & allowed]
    nodes = [frozenset({0, 1}), frozenset({2, 3}), frozenset({4})]
    assert rank_cpu_sets(2, nodes) == [{0, 1, 2, 3}, {4}]
    assert rank_cpu_sets(3, nodes) == nodes and rank_cpu_sets(4, nodes) is None
    if len(allowed) < 2:
        pytest.skip("pinning two ranks apart needs two CPUs")
    first, second = sorted(allowed)[:2]
    single, parallel = engines("llama")
    with opened(single) as engine:
        want = steps(engine, 320)
    try:
        engine = TensorParallelEngine(read_engine_config(parallel), cpu_sets=[frozenset({first}),
                                                                             frozenset({second})])
        try:
            assert os.sched_getaffinity(engine.ranks.processes[0].pid) == {second}
            assert os.sched_getaffinity(0) == {first}
            assert engine.rank0.session.get_session_options().intra_op_num_threads == 1  # one CPU, one thread
            got = steps(engine, 320)
        finally:
            engine.close()
    finally:
        os.sched_setaffinity(0, allowed)
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w).max() / np.abs(w).max() <= RTOL


def test_weight_only_experts_split_per_expert(tmp_path, library):
    """A weight-only stack of experts ([experts x out, in]) splits each expert's rows, and its down projection's
    inputs; per-channel int8 and int4 in groups of 32, in float (ONNX Runtime's MoE) and as native experts."""
    from helpers import make_random_hf_model

    hf = make_random_hf_model("qwen3_moe", tmp_path / "hf", overrides={"moe_intermediate_size": 64})
    for weight_only in (WeightOnly(8, None), WeightOnly(4, 32)):
        logits = {}
        for tp in (1, 2):
            ckpt = tmp_path / f"ckpt{tp}_{weight_only.bits}"
            convert(hf, ckpt, dtype="float32", tp_size=tp, weight_only=weight_only)
            for level in (1, 4):
                engine_dir = build_engine(ckpt, tmp_path / f"engine{tp}_{weight_only.bits}_{level}", max_seq_len=128,
                                          int4_accuracy_level=level)
                ops = {n.op_type for n in onnx.load(str(engine_dir / "rank0.onnx"), load_external_data=False)
                       .graph.node}
                assert ("MoERoute" in ops) == (level == 4)  # native experts, else ONNX Runtime's MoE
                with opened(engine_dir) as engine:
                    logits[tp, level] = steps(engine, 320)
        assert_quantized_ranks_agree(logits)


def test_draft_tokens_engines_verify_drafts_on_two_ranks_as_on_one(tmp_path, library):
    """The accept op reads the all-gathered logits: prompt-lookup speculation gives the single rank's greedy text."""
    from trtbuild.runtime.speculative import SpeculativeConfig

    require_shared_models()
    texts = []
    for tp in (1, 2):
        convert(STORIES260K, tmp_path / f"ckpt{tp}", tp_size=tp)
        engine_dir = build_engine(tmp_path / f"ckpt{tp}", tmp_path / f"engine{tp}", max_seq_len=256,
                                  speculative_decoding_mode="draft-tokens", max_draft_len=4)
        llm = LLM(engine_dir, RuntimeConfig(num_threads=2, speculative=SpeculativeConfig(num_speculative_tokens=4)))
        try:
            outputs = llm.generate(["Once upon a time", "Lily and Tom went to the park. Lily and Tom"],
                                   SamplingParams(max_tokens=40, temperature=0.0))
            texts.append([o.text for o in outputs])
        finally:
            llm.close()
    assert texts[0] == texts[1]


def test_rank_cpus_pin_each_rank_or_are_refused_with_the_format(engines):
    import os

    from trtbuild.runtime.cpu_topology import parse_rank_cpus

    assert parse_rank_cpus("0-3|4,6") == [{0, 1, 2, 3}, {4, 6}]
    for bad in ("0-3", "0-3|", "0-3|3-4", "a|b"):
        with pytest.raises(ConfigError, match=r"rank_cpus must give each tensor-parallel rank its own CPUs"):
            RuntimeConfig(rank_cpus=bad)
    single, parallel = engines("llama")
    with pytest.raises(ConfigError, match=r"gives 2 ranks' CPUs, but .* has 1 tensor-parallel rank$"):
        LLM(single, RuntimeConfig(rank_cpus="0|1"))
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("pinning two ranks apart needs two CPUs")
    first, second = sorted(allowed)[:2]
    llm = LLM(parallel, RuntimeConfig(rank_cpus=f"{first}|{second}", num_threads=2))
    try:
        engine = llm.core.engine
        assert os.sched_getaffinity(engine.ranks.processes[0].pid) == {second}
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids) == 4
    finally:
        llm.close()
        os.sched_setaffinity(0, allowed)
