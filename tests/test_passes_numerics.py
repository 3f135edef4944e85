"""Fusion passes' numerics: fused and unfused networks, lowered for the CPU target, compute the same steps.

Numerics: the unfused and the fused network are both lowered for the CPU target and driven through CpuEngine.step
over the same three steps (prefill, mixed prefill chunk + decode + fresh prompt, decode); logits and new_kv must
agree to 1e-5 relative to their largest magnitude.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import AVX512
from passes_helpers import BUILD, ENGINE_OPTIONS, LAYERS, VOCAB, check_lowered

from trtbuild import cpu_ops
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.lower_cpu import lower_paged_attention
from trtbuild.builder.network import build_network
from trtbuild.builder.passes import fuse_add_rmsnorm, fuse_gate_up, fuse_qkv, fuse_rope_into_attention
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

ALL = (fuse_qkv, fuse_gate_up, fuse_rope_into_attention, fuse_add_rmsnorm)
RTOL = 1e-5


# --- numerics ---------------------------------------------------------------------------------------------------

VARIANTS = {"fuse_qkv": (fuse_qkv,), "fuse_gate_up": (fuse_gate_up,),
            "fuse_rope_into_attention": (fuse_rope_into_attention,), "fuse_add_rmsnorm": (fuse_add_rmsnorm,),
            "all": ALL}


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def chunk(seq: int, token_ids: list[int], start: int, num_logits: int = 1) -> SequenceChunk:
    """Sequence `seq` owns every third block from block `seq` (interleaved tables: 16 blocks, 128 tokens each)."""
    return SequenceChunk(seq, token_ids, start, num_logits, list(range(seq, 48, 3)))


A, B, C = ids(13, 1), ids(16, 2), ids(6, 3)
STEPS = [  # prefill + first chunk; decode + continuing chunk + fresh prompt; three decodes (block boundaries)
    [chunk(0, A[:11], 0, num_logits=11), chunk(1, B[:9], 0, num_logits=0)],
    [chunk(0, A[11:12], 11), chunk(1, B[9:15], 9, num_logits=6), chunk(2, C[:5], 0, 5)],
    [chunk(0, A[12:], 12), chunk(1, B[15:], 15), chunk(2, C[5:], 5)],
]


class Recorder:
    """Stands in for the engine's session; runs the given model and keeps what each step returned."""

    def __init__(self, model: onnx.ModelProto) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        if any(o.domain == cpu_ops.DOMAIN for o in model.opset_import):  # built with native attention
            options.register_custom_ops_library(str(cpu_ops.library_path()))
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.outputs: list[list[np.ndarray]] = []

    def run(self, names, feeds):
        out = self.session.run(names, feeds)
        self.outputs.append(out)
        return out


def drive(engine_dir, model: onnx.ModelProto | None) -> list[list[np.ndarray]]:
    """Run STEPS through CpuEngine.step (its feeds, its KV pool), with `model` in place of the engine's own."""
    engine = CpuEngine(engine_dir, num_threads=1)
    recorder = Recorder(model) if model is not None else Recorder(onnx.load(str(engine_dir / CPU_ENGINE_FILE)))
    engine.session = recorder
    for step in STEPS:
        engine.step(step)
    return recorder.outputs


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


def assert_same_outputs(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    assert len(got) == len(want) == len(STEPS)
    for i, ((logits, new_kv), (logits_ref, new_kv_ref)) in enumerate(zip(got, want, strict=True)):
        assert logits.shape == (sum(c.num_logits for c in STEPS[i]), VOCAB)
        assert rel_err(logits, logits_ref) <= RTOL, f"step {i} logits"
        assert rel_err(new_kv, new_kv_ref) <= RTOL, f"step {i} new_kv"


@pytest.fixture(scope="module")
def unfused(random_hf_model, engine_from_hf, checkpoint):
    """family -> (engine dir built without passes, outputs of its own lowered unfused network)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            engine_dir = engine_from_hf(random_hf_model(family), fuse=False, **ENGINE_OPTIONS)
            config, tensors = checkpoint(family)
            model = build_network(config, tensors, BUILD)
            lower_paged_attention(model)
            cache[family] = engine_dir, drive(engine_dir, model)
        return cache[family]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_numerics_match_unfused(family, variant, unfused, network):
    engine_dir, want = unfused(family)
    _, _, model = network(family)
    for p in VARIANTS[variant]:
        assert p(model) > 0, p.__name__
    lower_paged_attention(model)
    check_lowered(model)
    assert_same_outputs(drive(engine_dir, model), want)


@pytest.mark.parametrize("family", ["llama3_rope", "qwen2"])
def test_fused_engine_matches_unfused_engine(family, random_hf_model, engine_from_hf, unfused):
    """The real build path: build_engine with fuse=True vs fuse=False, both run by CpuEngine."""
    fused_dir = engine_from_hf(random_hf_model(family), **ENGINE_OPTIONS)
    unfused_dir, _ = unfused(family)
    fused_info, unfused_info = CpuEngine(fused_dir).info, CpuEngine(unfused_dir).info
    biases = 3 * LAYERS if family == "qwen2" else 0  # q, k and v
    lowered = (f"dense_linears:{7 * LAYERS + 1}",) + ((f"linear_biases:{biases}",) if biases else ())
    fused_lowered = (f"dense_linears:{4 * LAYERS + 1}",) + ((f"linear_biases:{LAYERS}",) if biases else ())
    if not AVX512:  # the float linears stay MatMuls, their bias Adds Adds
        lowered = fused_lowered = ()
    assert unfused_info.passes == lowered  # the target's lowering: every linear, and the bias adds
    assert fused_info.passes == ("fold_prescale:0", f"fuse_qkv:{LAYERS}", f"fuse_gate_up:{LAYERS}",
                                 "hoist_lora_adds:0", f"fuse_rope_into_attention:{LAYERS}",
                                 f"fuse_add_rmsnorm:{2 * LAYERS - 1}", *fused_lowered, f"native_swiglu:{LAYERS}")
    assert_same_outputs(drive(fused_dir, None), drive(unfused_dir, None))
    pools = []
    for engine_dir in (fused_dir, unfused_dir):
        engine = CpuEngine(engine_dir, num_threads=1)
        for step in STEPS:
            logits = engine.step(step)
        pools.append((logits, engine.kv.pool))
    assert rel_err(pools[0][0], pools[1][0]) <= RTOL
    assert rel_err(pools[0][1], pools[1][1]) <= RTOL
