"""End to end on a real model: `trtbuild quantize` -> `trtbuild build` -> the engine, against modelopt's simulation.

Model: tinystories-656K (trained; 2 layers, hidden 128, ffn 384, 8/4 heads, vocab 2048, tied embeddings; int4 group
64 divides every linear), calibrated by the CLI on 8 x 64 tokens of the default corpus. Per format (fp8, int4_awq,
int8_sq, int4_awq + int8 KV, fp8 + fp8 KV, int8_sq with per-token activations, all with per-linear scales, the
default; int4_awq with `--fuse-shared-scales`; int4_awq with an int8 weight-only `lm_head`) the engine runs one
batched prefill of three prompts and four greedy decode steps; its logits at every position are compared with

- `reference_model(ckpt)`, the format's arithmetic from the checkpoint alone (torch), and
- modelopt's simulated-quantization model (`simulated_model`, calibrated with the CLI run's options; calibration is
  deterministic, so it is the model the checkpoint was exported from),

with the relative-to-range metric of tests/test_quantize.py, per sequence:

- **tight**: max |engine - x| <= 1e-4 * max |x| against both, at every position before the sequence's first rounding
  near-tie (below). Weight-only int4_awq has no activation rounding: every position is tight (measured <= 1e-6).
- **every position**: |engine - simulated| <= 30% (max) / 15% (mean) of the quantization error |simulated - fp32|,
  test_quantize's bound for the checkpoint against modelopt (measured here: <= 0.2% max, from one tie in fp8 + fp8 KV).

Rounding ties: the activation and KV formats quantize x / scale. The engine (ONNX Runtime) and torch compute x with
different summation orders, so x / scale differs by ~1e-7 relative; a value that close to a rounding boundary (int8:
k + 0.5, fp8: the midpoint of two e4m3 values) can round to the neighbouring level on one side only, and every later
position and layer carries that change. Seen on this model: x / scale = 3.37499928 (between e4m3 3.25 and 3.5) in
layer 1's mlp.proj input moved the fp8 + fp8 KV logits by 3.5e-4 of their range; -11.50000095 in layer 0 moved
int8_sq + int8 KV ones by 1.4% from that position on (modelopt's x * (127 / amax) has the same ambiguity). The tight
check therefore stops at the first position where the reference quantizes a value within 2e-6 relative of a boundary
(10x the largest distance seen to flip) and requires a third of all positions to be checked tightly (measured:
25 to 42 of 42 per format; engine vs reference there <= 7e-7), except for the tie-prone cases named in TIE_PRONE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from helpers import TINYSTORIES656K, require_shared_models
from onnx import numpy_helper

import trtbuild.quantize.reference as reference
from trtbuild.builder.engine_dir import CPU_ENGINE_FILE, read_engine_config
from trtbuild.cli import main
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.tokenizer import Tokenizer

MODEL = TINYSTORIES656K
GROUP = 64
CALIB = {"calib_size": 8, "calib_max_seq_len": 64}
# fp32 compute and a float32 KV pool (quantized weights default to float16): the logits are checked against the format
BUILD = ("--max-seq-len", 128, "--tokens-per-block", 8, "--max-batch-size", 4, "--max-num-tokens", 64,
         "--int4-accuracy-level", 1, "--kv-pool-dtype", "float32")
CASES = {  # name -> (--qformat, --kv-cache-qformat, flags)
    "fp8": ("fp8", None, ()),
    "int4_awq": ("int4_awq", None, ()),
    "int8_sq": ("int8_sq", None, ()),
    "int4_awq-kv_int8": ("int4_awq", "int8", ()),
    "fp8-kv_fp8": ("fp8", "fp8", ()),
    "int4_awq-shared": ("int4_awq", None, ("--fuse-shared-scales",)),
    "int8_sq-shared": ("int8_sq", None, ("--fuse-shared-scales", "--smoothquant-alpha", "0.5")),
    "int8_sq-per_token": ("int8_sq", None, ("--per-token-activations",)),
    "int8_sq-alpha1": ("int8_sq", None, ("--smoothquant-alpha", "1.0")),
    "int4_awq-lm_head_int8": ("int4_awq", None, ("--lm-head-qformat", "int8_wo")),
    "full_prec-kv_int8": ("full_prec", "int8", ()),  # the KV cache only
}
FLAGS = {"--fuse-shared-scales": "shared_input_scales", "--per-token-activations": "per_token_activations"}
PROMPTS = ["Once upon a time, there was a little girl named Lily.", "The cat sat on the mat and",
           "Tom and his dog went to the park. They played with a big red ball all day"]
DECODE_STEPS = 4
RTOL = 1e-4  # tight bound, relative to the logit range
LOOSE_MAX, LOOSE_MEAN = 0.3, 0.15  # of the quantization error, as tests/test_quantize.py
NEAR_TIE = 2e-6  # relative distance of x / scale to a rounding boundary within which engines may round differently
LAYERS, KV_HEADS, HEAD_SIZE = 2, 4, 16
LINEAR_PARAMS = LAYERS * (128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 128 * 384)  # q, k, v, dense, gate, fc, proj


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def quantize_args(name: str) -> tuple[list, dict]:
    """CLI arguments and the matching `QuantizeOptions` fields of a case (model and output aside)."""
    qformat, kv, flags = CASES[name]
    args = ["--qformat", qformat, "--calib-size", CALIB["calib_size"],
            "--calib-max-seq-len", CALIB["calib_max_seq_len"], *flags]
    options: dict = dict(CALIB)
    options.update({FLAGS[f]: True for f in flags if f in FLAGS})
    if "--smoothquant-alpha" in flags:
        options["smoothquant_alpha"] = float(flags[flags.index("--smoothquant-alpha") + 1])
    if "--lm-head-qformat" in flags:
        options["lm_head_qformat"] = flags[flags.index("--lm-head-qformat") + 1]
    if qformat == "int4_awq":
        args += ["--awq-block-size", GROUP]
        options["awq_block_size"] = GROUP
    if kv:
        args += ["--kv-cache-qformat", kv]
        options["kv_cache_qformat"] = kv
    return args, options


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    require_shared_models()
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def quantized(work):
    """name -> (checkpoint dir, engine dir), written by `trtbuild quantize` and `trtbuild build` (cached)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in cache:
            ckpt, engine = work / f"ckpt-{name}", work / f"engine-{name}"
            result = invoke("quantize", "--model", MODEL, "--output", ckpt, *quantize_args(name)[0])
            assert result.exit_code == 0, (result.output, result.exception)
            result = invoke("build", "--checkpoint", ckpt, "--output", engine, *BUILD)
            assert result.exit_code == 0, (result.output, result.exception)
            cache[name] = ckpt, engine
        return cache[name]

    return get


@pytest.fixture(scope="module")
def fp32_engine(work) -> Path:
    for args in (("convert", "--model", MODEL, "--output", work / "ckpt-fp32"),
                 # NOTE: this model's weights are exact in float16, which the default build would hold them in
                 ("build", "--checkpoint", work / "ckpt-fp32", "--output", work / "engine-fp32", *BUILD,
                  "--float-linears", "ort")):
        result = invoke(*args)
        assert result.exit_code == 0, (result.output, result.exception)
    return work / "engine-fp32"


@pytest.fixture(scope="module")
def fp32_model() -> torch.nn.Module:
    from trtbuild.quantize.source import build_torch_model, read_source

    require_shared_models()
    return build_torch_model(read_source(MODEL))


def engine_logits(engine_dir: Path) -> tuple[list[list[int]], list[np.ndarray]]:
    """One batched prefill of PROMPTS (logits at every position), then greedy decode steps of all three."""
    engine = CpuEngine(engine_dir, num_threads=1, num_blocks=24)
    seqs = [Tokenizer(engine_dir).encode(p) for p in PROMPTS]
    tables = [list(range(i, 24, 3)) for i in range(len(seqs))]  # interleaved block tables
    out = engine.step([SequenceChunk(i, s, 0, len(s), tables[i]) for i, s in enumerate(seqs)])
    bounds = np.cumsum([0] + [len(s) for s in seqs])
    logits = [[out[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    for _ in range(DECODE_STEPS):
        chunks = []
        for i, s in enumerate(seqs):
            s.append(int(logits[i][-1][-1].argmax()))
            chunks.append(SequenceChunk(i, s[-1:], len(s) - 1, 1, tables[i]))
        out = engine.step(chunks)
        for i in range(len(seqs)):
            logits[i].append(out[i : i + 1])
    return seqs, [np.concatenate(x) for x in logits]


# ---- rounding near-ties of the reference's activation / KV quantization ----------------------------------------------
_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
_E4M3 = torch.unique(_E4M3[torch.isfinite(_E4M3) & (_E4M3 >= 0)])
_E4M3_MIDPOINTS = (_E4M3[1:] + _E4M3[:-1]) / 2  # where a cast to e4m3 rounds up (below the 448 saturation)


def boundary_distance(y: torch.Tensor, kind: str) -> torch.Tensor:
    """|y - nearest rounding boundary| / |y| per element of y = x / scale."""
    a = y.detach().abs().double().contiguous()
    if kind == "int8":
        nearest = a.floor() + 0.5
    else:
        m = _E4M3_MIDPOINTS
        i = torch.searchsorted(m, a).clamp(1, len(m) - 1)
        nearest = torch.where((a - m[i - 1]).abs() < (m[i] - a).abs(), m[i - 1], m[i])
    return (a - nearest).abs() / a.clamp_min(1e-30)


@pytest.fixture
def tie_recorder(monkeypatch):
    """Wraps the reference's fake quantization: list of per-position minimal boundary distances, one per call."""
    calls: list[torch.Tensor] = []
    fake_quant = reference.fake_quant

    def recording(x: torch.Tensor, scale: torch.Tensor, kind: str, narrow: bool = False) -> torch.Tensor:
        d = boundary_distance(x.float() / scale.float(), kind)  # [1, T, features] or K/V [1, heads, T, head_size]
        calls.append(d.amin(dim=(1, 3)) if d.dim() == 4 else d.amin(dim=-1))
        return fake_quant(x, scale, kind, narrow)

    monkeypatch.setattr(reference, "fake_quant", recording)
    return calls


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# Cases whose activation rounding meets near-ties early on this model: int8_sq at the default alpha (3 of 42
# positions before the first one at alpha 0.8), per token (a token's largest values span the whole int8 range; a tie
# sits in the BOS position all prompts share: 0 of 42), int8_sq-shared (alpha 0.5: 0 of 42). They are checked
# tightly up to their first tie and loosely everywhere; tests/test_quantized_engine.py checks these engines against
# the format to 1e-4 on models without ties. int8_sq-alpha1 (25-42 tight) keeps the tight coverage of int8_sq here.
TIE_PRONE = {"int8_sq", "int8_sq-per_token", "int8_sq-shared"}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_modelopt_and_reference(name, quantized, fp32_model, tie_recorder):
    ckpt, engine_dir = quantized(name)
    qformat, kv, _ = CASES[name]
    seqs, got = engine_logits(engine_dir)
    simulated = reference.simulated_model(MODEL, qformat, **quantize_args(name)[1])
    ref_model = reference.reference_model(ckpt)
    tight = total = 0
    diffs, qerrs = [], []
    for ids, eng in zip(seqs, got, strict=True):
        tie_recorder.clear()
        with torch.no_grad():
            x = torch.tensor([ids])
            ref, sim, fp32 = (m(x).logits[0].numpy() for m in (ref_model, simulated, fp32_model))
        assert eng.shape == ref.shape
        if qformat == "int4_awq" and kv is None:
            assert not tie_recorder  # weight-only (int4 linears, int8 lm_head): nothing is rounded at run time
        near = torch.stack(tie_recorder).amin(0)[0] if tie_recorder else torch.ones(len(ids))
        first_tie = int(torch.nonzero(near < NEAR_TIE)[0, 0]) if bool((near < NEAR_TIE).any()) else len(ids)
        if first_tie:
            span = slice(0, first_tie)
            assert rel(eng[span], ref[span]) <= RTOL, (name, rel(eng[span], ref[span]), first_tie)
            assert rel(eng[span], sim[span]) <= RTOL, (name, rel(eng[span], sim[span]), first_tie)
        tight, total = tight + first_tie, total + len(ids)
        diffs.append(np.abs(eng - sim))
        qerrs.append(np.abs(sim - fp32))
        assert rel(sim, fp32) >= 30 * RTOL  # the quantization is real and the engine follows it
    d, q = np.concatenate(diffs), np.concatenate(qerrs)
    assert d.max() <= LOOSE_MAX * q.max() and d.mean() <= LOOSE_MEAN * q.mean(), (name, d.max() / q.max(),
                                                                                 d.mean() / q.mean())
    if name not in TIE_PRONE:  # a good part of the positions is checked tightly
        assert 3 * tight >= total, (name, tight, total)


@pytest.mark.parametrize("name", list(CASES))
def test_generate_text(name, quantized):
    _, engine_dir = quantized(name)
    llm = LLM(engine_dir, RuntimeConfig(num_threads=1, kv_cache_blocks=32))
    [out] = llm.generate(["Once upon a time"], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    words = [w for w in out.text.split() if w.strip(".,!?\"'").isalpha()]
    assert len(words) >= 3, out.text


@pytest.mark.parametrize(("name", "shared", "alpha", "per_layer"), [
    ("int4_awq", False, None, 7), ("int4_awq-shared", True, None, 4),
    ("int8_sq", False, 0.7, 7), ("int8_sq-per_token", False, 0.5, 7), ("int8_sq-shared", True, 0.5, 4),
    ("int8_sq-alpha1", False, 1.0, 4),  # alpha 1: x is divided by its own amax, so q/k/v (gate/up) agree anyway
])
def test_kernels_fuse_only_identical_scales(name, shared, alpha, per_layer, quantized):
    """Per-linear scales (the default) that differ: every linear is its own kernel; `--fuse-shared-scales`, or scales
    that come out identical: q/k/v and gate/up of each layer run as one kernel each. config.json records the form
    and the SmoothQuant alpha (the default: 0.7 static, 0.5 per token)."""
    ckpt, engine_dir = quantized(name)
    doc = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (doc["shared_input_scales"], doc["smoothquant_alpha"]) == (shared, alpha)
    model = onnx.load(str(engine_dir / CPU_ENGINE_FILE))
    kernel = {"int4_awq": "MatMulNBits", "int8_sq": "MatMulIntegerToFloat"}[CASES[name][0]]
    assert sum(n.op_type == kernel for n in model.graph.node) == per_layer * LAYERS


def int4_weight_bytes(engine_dir: Path) -> int:
    """Bytes of the MatMulNBits weights and scales in an engine file."""
    model = onnx.load(str(engine_dir / CPU_ENGINE_FILE))
    names = {i for n in model.graph.node if n.op_type == "MatMulNBits" for i in n.input[1:3]}
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer if t.name in names)


def test_engine_file_sizes_and_kv_bytes(quantized, fp32_engine):
    """int4 (group 64) stores (0.5 + 4/64) / 2 = 0.28 of the fp16 bytes of the linear weights, fp8 one byte per
    weight; the engine file shrinks by what the format saves. A quantized KV cache is 1 byte per value: 1/4 of fp32."""
    size = {n: read_engine_config(quantized(n)[1]).engine_bytes for n in ("int4_awq", "fp8", "int8_sq")}
    fp32 = read_engine_config(fp32_engine).engine_bytes
    assert int4_weight_bytes(quantized("int4_awq")[1]) <= 0.3 * 2 * LINEAR_PARAMS
    assert fp32 - size["int4_awq"] >= 0.9 * LINEAR_PARAMS * (4 - 0.5 - 4 / GROUP)
    for name in ("fp8", "int8_sq"):
        assert fp32 - size[name] >= 0.9 * LINEAR_PARAMS * 3, name
    assert size["int4_awq"] < size["int8_sq"] and size["int4_awq"] < size["fp8"]
    vocab, hidden = 2048, 128  # the int8 lm_head: 1 byte per weight, + a float32 row scale per block of 128
    head8 = read_engine_config(quantized("int4_awq-lm_head_int8")[1]).engine_bytes
    assert abs(head8 - size["int4_awq"] - vocab * hidden * (1 + 4 / 128)) <= 0.01 * vocab * hidden

    budget = 1 << 20
    fp32_kv = LLM(fp32_engine, RuntimeConfig(num_threads=1, kv_cache_memory=budget)).core.engine.kv
    assert fp32_kv.pool.dtype == np.float32 and fp32_kv.bytes_per_token == LAYERS * 2 * KV_HEADS * HEAD_SIZE * 4
    for name, dtype in (("int4_awq-kv_int8", np.int8), ("fp8-kv_fp8", np.uint8)):
        kv = LLM(quantized(name)[1], RuntimeConfig(num_threads=1, kv_cache_memory=budget)).core.engine.kv
        assert kv.pool.dtype == dtype and kv.bytes_per_token * 4 == fp32_kv.bytes_per_token, name
        assert kv.num_blocks == 4 * fp32_kv.num_blocks, name  # the same budget holds 4x the tokens


def test_build_refuses_unknown_quant_algo(quantized, tmp_path):
    ckpt, _ = quantized("int8_sq")
    shutil.copytree(ckpt, tmp_path / "ckpt")
    doc = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    doc["quantization"]["quant_algo"] = "w4a8_awq"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(doc))
    result = invoke("build", "--checkpoint", tmp_path / "ckpt", "--output", tmp_path / "engine")
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "quant_algo 'w4a8_awq' is not one of fp8, int4_awq, int8_sq" in errors[0], result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "engine").exists()
