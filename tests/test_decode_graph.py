"""The CPU engine's small-step graph (builder/decode_graph.py): steps of at most SMALL_STEP_MAX_TOKENS tokens
run 4/8-bit linears with trtbuild::BlockQuantMatMul over the same weight file; larger steps run MatMulNBits. Both
graphs give the same logits up to int8 activation rounding, and the runtime picks by step size."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import make_random_hf_model

from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import WeightOnly, convert
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, CPU_SMALL_STEP_FILE, SMALL_STEP_MAX_TOKENS, read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk

LIMITS = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128)


@pytest.fixture(scope="module", params=[4, 8], ids=["int4", "int8"])
def checkpoint(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"decode_graph_{request.param}")
    hf = make_random_hf_model("qwen2", work / "hf", overrides=dict(hidden_size=128, intermediate_size=256))
    convert(hf, work / "ckpt", weight_only=WeightOnly(request.param, 32))
    return work / "ckpt"


def ops(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_small_steps_run_the_native_linears_and_agree_with_matmulnbits(checkpoint, tmp_path):
    engine_dir = build_engine(checkpoint, tmp_path / "e", **LIMITS)
    assert read_engine_config(engine_dir).build.decode_linears == "native"
    main, small = ops(engine_dir / CPU_ENGINE_FILE), ops(engine_dir / CPU_SMALL_STEP_FILE)
    assert small.count("BlockQuantMatMul") == main.count("MatMulNBits") > 0 and "MatMulNBits" not in small
    assert [o for o in main if o != "MatMulNBits"] == [o for o in small if o != "BlockQuantMatMul"]

    engine = CpuEngine(engine_dir, num_threads=2, num_blocks=16)
    used = []
    for name in ("session", "small_step_session"):
        session = getattr(engine, name)
        setattr(engine, name, type("Spy", (), {"run": lambda _, *a, s=session, n=name: used.append(n) or s.run(*a)})())
    prompt = list(range(3, 40))
    engine.step([SequenceChunk(0, prompt, 0, 1, [0, 1, 2])])
    decode = [SequenceChunk(0, [7], len(prompt), 1, [0, 1, 2])]
    small_logits = engine.step(decode)
    assert used == ["session", "small_step_session"]
    engine.small_step_session = engine.session  # the same decode step through MatMulNBits
    big_logits = engine.step(decode)
    np.testing.assert_allclose(small_logits, big_logits, atol=2e-2 * np.abs(big_logits).max())
    assert small_logits.argmax() == big_logits.argmax()
    engine.step([SequenceChunk(i, [5] * (SMALL_STEP_MAX_TOKENS + 1 - i), 0, 1, [3 + i]) for i in range(2)])
    assert used[-1] == "session"  # more than SMALL_STEP_MAX_TOKENS tokens


def test_decode_linears_ort_or_where_nothing_applies(checkpoint, tmp_path):
    ort_engine = build_engine(checkpoint, tmp_path / "ort", decode_linears="ort", **LIMITS)
    assert read_engine_config(ort_engine).build.decode_linears == "ort"
    assert not (ort_engine / CPU_SMALL_STEP_FILE).exists()
    assert CpuEngine(ort_engine, num_blocks=4).small_step_session is None
    fp32 = build_engine(checkpoint, tmp_path / "acc1", int4_accuracy_level=1, **LIMITS)
    assert read_engine_config(fp32).build.decode_linears == "ort"  # fp32 compute asked for: MatMulNBits only
    with pytest.raises(ConfigError, match="native cannot be used: int4_accuracy_level 1"):
        build_engine(checkpoint, tmp_path / "bad", int4_accuracy_level=1, decode_linears="native", **LIMITS)


def test_a_cpu_without_vnni_keeps_matmulnbits(checkpoint, tmp_path, monkeypatch):
    from trtbuild import cpu_ops

    monkeypatch.setattr(cpu_ops, "has_vnni", lambda: False)
    assert read_engine_config(build_engine(checkpoint, tmp_path / "a", **LIMITS)).build.decode_linears == "ort"
    with pytest.raises(ConfigError, match="native cannot be used: this CPU has no AVX-512 VNNI"):
        build_engine(checkpoint, tmp_path / "b", decode_linears="native", **LIMITS)


def test_a_missing_small_step_graph_is_a_clear_error(checkpoint, tmp_path):
    from trtbuild.errors import EngineCompatibilityError

    engine_dir = build_engine(checkpoint, tmp_path / "e", **LIMITS)
    (engine_dir / CPU_SMALL_STEP_FILE).unlink()
    with pytest.raises(EngineCompatibilityError, match=r"rank0\.decode\.onnx is missing; rebuild"):
        CpuEngine(engine_dir, num_blocks=4)


def test_verify_checks_the_small_step_graph_against_matmulnbits(checkpoint, tmp_path):
    from trtbuild.bench.verify import verify_engine

    engine_dir = build_engine(checkpoint, tmp_path / "e", **LIMITS)
    report = verify_engine(engine_dir, checkpoint, num_threads=1)
    report.check()  # raises VerificationError if an output is off
    assert len(report.steps) == 2 and "decode" in report.steps[1]
