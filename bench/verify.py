"""`trtbuild verify` and `trtbuild build --verify`: run a built engine against the unfused reference build of its
checkpoint with polygraphy's Comparator, and report each output's error against tolerances stated per precision.

The reference is the same checkpoint built with the same limits, `fuse=False` (no fusion passes, still lowered for
the CPU so ONNX Runtime can run it), no autotuning, the standard-op attention lowering (`split`) and MatMulNBits for
the quantized linears, so that trtbuild's native CPU ops are checked against ONNX Runtime's, into a temporary
directory that is removed afterwards. Both run the same two seeded steps: a prefill of two sequences of different
lengths (logits of every token), then one decode token per sequence on top of the K/V the reference's prefill wrote.
It borrows runtime/engine.py's session (the runtime's SessionOptions) and input packing, imported when it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trtbuild.builder.convert.checkpoint import CONFIG_FILE
from trtbuild.builder.engine_dir import EngineInfo, read_engine_config
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import EngineCompatibilityError, TrtbuildError, VerificationError
from trtbuild.quantization import KVPoolDtype

log = logging.getLogger(__name__)

PREFILL_LENGTHS = (20, 7)  # two sequences of different lengths, crossing block boundaries; a few dozen tokens
SEED = 0


@dataclass(frozen=True)
class Tolerance:
    """An element passes when it is within atol OR within rtol of the reference (polygraphy's elemwise check).
    `atol_of_range`: atol is that fraction of the reference output's largest |value| (its range)."""

    atol: float
    rtol: float
    atol_of_range: bool = False

    def resolve(self, reference_range: float) -> float:
        """The absolute tolerance for an output whose reference values reach `reference_range` in magnitude."""
        return self.atol * reference_range if self.atol_of_range else self.atol

    def describe(self, reference_range: float) -> str:
        atol = f"{self.resolve(reference_range):.1e}" + (f" ({self.atol * 100:g}% of max |ref|)" if self.atol_of_range
                                                          else "")
        return f"atol {atol} or rtol {self.rtol:.0e}"


# NOTE: measured fused vs unfused, max abs error over both steps (logits / new_kv): stories260K 1.0e-5 / 8.1e-6,
# SmolLM2-135M (GGUF dequantized to fp32, 30 layers, logits up to 36) 6.6e-5 / 2.0e-5, a random tiny Llama 1.8e-7 /
# 1.5e-7. Tolerances are 15x and 50x the largest; a real fault (a wrong or corrupted weight) is off by far more.
FLOAT_TOLERANCES = {"logits": Tolerance(1e-3, 1e-3), "new_kv": Tolerance(1e-3, 1e-3)}
# NOTE: a float16 KV pool (`--kv-pool-dtype float16`) rounds every K/V attention reads to float16 (relative 5e-4), so
# the fused graph's differences flip roundings as quantization does, on a finer grid. Measured: SmolLM2-135M logits
# off by up to 7.2e-3 (2e-4 of the largest |logit|, 36), new_kv 3.9e-3 (2e-4 of 19); stories260K 7.3e-4 / 3.0e-4.
FLOAT16_KV_TOLERANCES = {"logits": Tolerance(5e-3, 1e-2, atol_of_range=True),
                         "new_kv": Tolerance(5e-3, 1e-2, atol_of_range=True)}
# NOTE: quantized engines (quant_algo, lm_head_quant_algo or a quantized KV cache): where activations are quantized
# (int8 compute of MatMulNBits at int4 accuracy level 4, int8_sq, fp8, KV rounding), the 1e-7 differences of the
# fused graph flip a rounding here and there, and the flips carry through the layers. Measured: SmolLM2-135M Q4_1
# GGUF at level 4, logits off by up to 1.21 (3.4% of the largest |logit|, 36) and new_kv by 0.47 (2.5% of 19); the
# same engine at level 1 (fp32 compute) 1.0e-4; random tiny models in every format (fp8, int8_sq, int4_awq, weight
# only, int8/fp8 KV) at most 5.1e-4. Hence an atol of a fraction of each output's range, with a 3x margin.
QUANTIZED_TOLERANCES = {"logits": Tolerance(0.1, 5e-2, atol_of_range=True),
                        "new_kv": Tolerance(0.1, 5e-2, atol_of_range=True)}
# NOTE: the native linears round activations to int8 in blocks of 32 (llama.cpp's way), MatMulNBits at level 4 in
# blocks of the weights' 16 or 32; with 2- and 3-bit weights the two differ by more than the tolerance above while
# each stays near the checkpoint's float model (SmolLM2-135M requantized to IQ2_XS: logits of the engine and the
# unfused reference 7.2 apart, a fifth of the range; against fp32 compute, the engine 2.0 off and the reference 5.7).
# So a quantized engine that misses the tolerance is also measured against its checkpoint computed in fp32
# (MatMulNBits at level 1): it passes when it is no further from that than EXACT_RATIO x the reference is.
EXACT_RATIO = 1.5


def tolerances_for(model: ModelConfig, build: BuildConfig) -> tuple[str, dict[str, Tolerance]]:
    """(what the tolerances are for, output -> tolerance) of an engine's model and build config."""
    q = model.quantization
    formats = [f for f in (q.quant_algo, q.lm_head_quant_algo, q.kv_cache_quant_algo and f"{q.kv_cache_quant_algo} "
                           "KV cache") if f]
    if formats:
        return "quantized: " + ", ".join(formats), QUANTIZED_TOLERANCES
    if build.kv_pool_dtype == KVPoolDtype.FLOAT16:
        return f"{model.dtype} weights, fp32 compute, float16 KV pool", FLOAT16_KV_TOLERANCES
    return f"{model.dtype} weights, fp32 compute", FLOAT_TOLERANCES


@dataclass(frozen=True)
class OutputError:
    """One output over all steps: the largest errors polygraphy measured, and whether every step passed."""

    name: str
    max_abs: float
    max_rel: float
    tolerance: str  # as checked, e.g. "atol 1.0e-03 or rtol 1e-03"
    passed: bool
    worst_step: str  # the step with the largest absolute error
    # where the tolerance was missed: (the engine's, the reference's) max abs error against the fp32-compute build
    exact: tuple[float, float] | None = None


@dataclass(frozen=True)
class VerifyReport:
    engine: Path
    precision: str
    steps: tuple[str, ...]
    outputs: tuple[OutputError, ...]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def table(self) -> str:
        rows = [("output", "max abs err", "max rel err", "tolerance (per element)", "result")]
        rows += [(o.name, f"{o.max_abs:.3e}", f"{o.max_rel:.3e}", o.tolerance, "PASS" if o.passed else "FAIL")
                 for o in self.outputs]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"engine {self.engine} vs. the unfused build of its checkpoint ({self.precision})",
                 "steps: " + "; ".join(self.steps)]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines += [f"{o.name} against the checkpoint computed in fp32 (MatMulNBits at accuracy level 1): max abs err "
                  f"{o.exact[0]:.3e}, the unfused reference's {o.exact[1]:.3e} "
                  f"({'within' if o.passed else 'beyond'} {EXACT_RATIO:g}x)" for o in self.outputs if o.exact]
        return "\n".join(lines)

    def check(self) -> None:
        """Raise VerificationError naming each failed output and by how much."""
        failed = [o for o in self.outputs if not o.passed]
        if failed:
            raise VerificationError("; ".join(
                f"{o.name} differs from the unfused reference by up to {o.max_abs:.3e} (abs) / {o.max_rel:.3e} (rel) "
                f"in the {o.worst_step.split(' ')[0]} step, beyond {o.tolerance}"
                + (f", and from the checkpoint computed in fp32 by {o.exact[0]:.3e}, more than {EXACT_RATIO:g}x the "
                   f"reference's {o.exact[1]:.3e}" if o.exact else "") for o in failed)
                + f"; the engine {self.engine} does not compute what its checkpoint does.")


def check_checkpoint(info: EngineInfo, checkpoint: Path | None) -> None:
    """The checkpoint is given, is one, and is what the engine was built from (its model config)."""
    if checkpoint is None:
        raise TrtbuildError("--checkpoint is required: verify builds the unfused reference from the checkpoint the "
                            f"engine {info.path} was built from (the folder `trtbuild convert` wrote).")
    checkpoint = Path(checkpoint)
    if not (checkpoint / CONFIG_FILE).is_file():
        raise TrtbuildError(f"--checkpoint {checkpoint} is not a checkpoint folder (no {CONFIG_FILE}); pass the "
                            f"folder `trtbuild convert` wrote and the engine {info.path} was built from.")
    model = ModelConfig.load(checkpoint / CONFIG_FILE)
    if model != info.model:
        ours, theirs = info.model.to_dict(), model.to_dict()
        diff = [f"{k} {theirs.get(k)!r} vs {ours.get(k)!r}" for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]
        diff = ", ".join(diff[:4] + ([f"and {len(diff) - 4} more"] if len(diff) > 4 else []))
        raise TrtbuildError(f"--checkpoint {checkpoint} is not the checkpoint engine {info.path} was built from "
                            f"(checkpoint vs engine: {diff}); pass the one it was built from.")


def verify_engine(engine_dir: Path, checkpoint: Path | None, num_threads: int | None = None,
                  echo: Callable[[str], None] = log.info) -> VerifyReport:
    """Build the unfused reference of `checkpoint`, run it and the engine at `engine_dir` on the same steps with
    polygraphy, and compare `logits` (an embed engine's `hidden_states`) and `new_kv`. The report says what passed;
    `report.check()` raises if not."""
    from trtbuild.builder.build import build_engine
    from trtbuild.builder.network import engine_outputs

    info = read_engine_config(Path(engine_dir), expect_target="cpu")
    if info.model.mapping.tp_size > 1:  # NOTE: before the reference is built
        raise EngineCompatibilityError(
            f"{engine_dir} is a tensor-parallel engine of {info.model.mapping.tp_size} ranks; `trtbuild verify` "
            "compares one rank's graph with its unfused build: verify the engine of a --tp-size 1 checkpoint of "
            "the same model (tests/test_tensor_parallel.py holds the ranks to the single-rank logits).")
    check_checkpoint(info, checkpoint)
    precision, by_kind = tolerances_for(info.model, info.build)
    rows = engine_outputs(info.build)[0]  # an embed engine's rows are hidden states, held to the logits' tolerance
    tolerances = {rows if name == "logits" else name: t for name, t in by_kind.items()}
    with tempfile.TemporaryDirectory(prefix="trtbuild-verify-") as tmp:
        echo(f"building the unfused reference of {checkpoint} in {tmp}")
        unfused = dataclasses.replace(info.build, fuse=False, autotune="off", attention="split",
                                      quant_linears="ort", float_linears="ort")
        reference = read_engine_config(build_engine(Path(checkpoint), Path(tmp) / "reference", build=unfused))
        echo("running the engine and the reference")
        steps, results = _run_engine_and_reference(info, reference, num_threads)
        outputs = _judge(results, steps, tolerances)
        if by_kind is QUANTIZED_TOLERANCES and not all(o.passed for o in outputs):
            # NOTE: the outputs are kept, so the reference's files go first: one engine at a time in `tmp` (an 8B
            # engine's reference is GBs)
            shutil.rmtree(reference.path)
            echo("building the checkpoint computed in fp32 (MatMulNBits at accuracy level 1) to measure both against")
            exact = read_engine_config(build_engine(Path(checkpoint), Path(tmp) / "exact",
                                                    build=dataclasses.replace(unfused, int4_accuracy_level=1)))
            results = _run(results, [_runner(exact, steps, num_threads, EXACT)], steps.data)
            outputs = _judge(results, steps, tolerances)
    return VerifyReport(Path(engine_dir), precision, tuple(steps.descriptions), tuple(outputs))


def _nan_high(x: float) -> float:
    return math.inf if math.isnan(x) else x


class _Once:
    """A session handed to polygraphy's runner once: released when the runner deactivates, so that the engine and
    the reference are not both in memory."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self):
        engine, self.engine = self.engine, None
        return _OwnLoraTables(engine)


class _OwnLoraTables:
    """A CpuEngine's session that feeds its own LoRA slot tables (builder/lora_slots.py: all slots empty) and
    hides them from polygraphy: an engine's tables may be packed for trtbuild::LoraAdd, the reference's not."""

    def __init__(self, engine) -> None:
        self.engine = engine
        tables = engine.lora_slots.arrays if engine.lora_slots is not None else {}
        self.tables, self.inputs = tables, [i for i in engine.session.get_inputs() if i.name not in tables]

    def get_inputs(self) -> list:
        return self.inputs

    def run(self, output_names, feeds, *args, **kwargs):
        return self.engine.session.run(output_names, {**feeds, **self.tables}, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.engine.session, name)


REFERENCE, ENGINE, EXACT = "unfused-reference", "engine", "fp32-compute"  # polygraphy runner names


@dataclass(frozen=True)
class _Steps:
    descriptions: list[str]
    data: list[dict[str, np.ndarray]]  # each step's feeds, made by the reference's packing, its K/V pool included
    num_blocks: int


def _runner(info: EngineInfo, steps: _Steps, num_threads: int | None, name: str):
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from trtbuild.runtime.engine import CpuEngine

    return OnnxrtRunner(lambda: _OwnLoraTables(CpuEngine(info, num_threads=num_threads, num_blocks=steps.num_blocks)),
                        name=name)


def _run(results, runners: list, data: list[dict[str, np.ndarray]]):
    """`results` (polygraphy RunResults, or None) with the outputs of `runners` on `data` added."""
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.INFO if log.isEnabledFor(logging.INFO) else G_LOGGER.CRITICAL):
        new = Comparator.run(runners, data_loader=data)
    if results is None:
        return new
    results.extend(new)
    return results


def _run_engine_and_reference(info: EngineInfo, reference: EngineInfo,
                              num_threads: int | None) -> tuple[_Steps, object]:
    """The verification steps, and the reference's and the engine's outputs on them (polygraphy RunResults)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from trtbuild.runtime.engine import CpuEngine

    descriptions, feeds, num_blocks = _step_chunks(info)
    ref = CpuEngine(reference, num_threads=num_threads, num_blocks=num_blocks)
    data = [_step_data(ref, feeds[0])]
    if len(feeds) > 1:  # the decode step reads the K/V the reference's prefill wrote, and follows its greedy tokens
        logits = ref.step(feeds[0])
        last = np.cumsum([c.num_logits for c in feeds[0]]) - 1
        decode = [dataclasses.replace(c, token_ids=[int(logits[i].argmax())]) for c, i in zip(feeds[1], last,
                                                                                                strict=True)]
        data.append(_step_data(ref, decode))
    steps = _Steps(descriptions, data, num_blocks)
    runners = [OnnxrtRunner(_Once(ref), name=REFERENCE), _runner(info, steps, num_threads, ENGINE)]
    del ref
    return steps, _run(None, runners, data)


def _step_data(ref, chunks: list) -> dict[str, np.ndarray]:
    """One step's feeds by the reference's packing, its K/V pool included and its LoRA slot tables left out (each
    runner feeds its own: _OwnLoraTables)."""
    own = ref.lora_slots.arrays if ref.lora_slots is not None else {}
    return {k: v for k, v in ref.feeds(chunks)[0].items() if k not in own} | {"kv_cache": ref.kv.pool.copy()}


def _judge(results, steps: _Steps, tolerances: dict[str, Tolerance]) -> list[OutputError]:
    """Each output's errors over the steps, engine vs reference; where `results` hold the checkpoint computed in fp32
    too, an output that misses its tolerance passes if the engine is no further from that than EXACT_RATIO x the
    reference is."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    ranges = {name: max(float(np.abs(it[name]).max(initial=0.0)) for it in results[REFERENCE]) for name in tolerances}
    atol = {name: tolerances[name].resolve(ranges[name]) for name in tolerances}
    compare = SimpleCompareFunc(atol=atol, rtol={name: t.rtol for name, t in tolerances.items()},
                                check_error_stat="elemwise")
    names = list(results.keys())
    # engine first: polygraphy's relative error is relative to the second runner's outputs, the reference's
    accuracy = Comparator.compare_accuracy(results, comparisons=[(names.index(ENGINE), names.index(REFERENCE))],
                                           compare_func=compare)
    per_step = accuracy[0][(ENGINE, REFERENCE)]  # [step] -> {output: OutputCompareResult}
    outputs = []
    for name in tolerances:
        errors = [(r[name], step) for r, step in zip(per_step, steps.descriptions, strict=True)]
        worst = max(errors, key=lambda e: _nan_high(e[0].max_absdiff))
        passed, against_exact = all(bool(e) for e, _ in errors), None
        if EXACT in names and not passed:
            against_exact = tuple(_max_abs_diff(results[runner], results[EXACT], name)
                                  for runner in (ENGINE, REFERENCE))
            passed = against_exact[0] <= EXACT_RATIO * against_exact[1]
        outputs.append(OutputError(name, max(_nan_high(e.max_absdiff) for e, _ in errors),
                                   max(_nan_high(e.max_reldiff) for e, _ in errors),
                                   tolerances[name].describe(ranges[name]), passed, worst[1], against_exact))
    return outputs


def _max_abs_diff(ours, theirs, name: str) -> float:
    """The largest |difference| of output `name` over every step of two runners' results (NaN: infinite)."""
    return max(_nan_high(float(np.abs(a[name] - b[name]).max(initial=0.0))) for a, b in zip(ours, theirs, strict=True))


def _step_chunks(info: EngineInfo):
    """(descriptions, chunk lists, pool blocks) of the verification steps within the engine's build limits:
    a prefill of up to two sequences of different lengths with logits of every token, then one token each."""
    from trtbuild.runtime.engine import SequenceChunk, in_every_group

    b, vocab = info.build, info.model.vocab_size
    rng = np.random.default_rng(SEED)
    lengths = [min(n, max(1, b.max_seq_len - 1)) for n in PREFILL_LENGTHS[: min(b.max_batch_size, b.max_num_tokens)]]
    while sum(lengths) > b.max_num_tokens:  # shorten the longest until the step fits
        lengths[lengths.index(max(lengths))] -= 1
    decode = all(n < b.max_seq_len for n in lengths)
    blocks_per_seq = [-(-(n + decode) // b.tokens_per_block) for n in lengths]
    ids = rng.permutation(sum(blocks_per_seq)).tolist()  # scattered block tables, as a pool in use has
    tables = [ids[sum(blocks_per_seq[:i]): sum(blocks_per_seq[: i + 1])] for i in range(len(lengths))]
    # NOTE: the sequences run under the engine's last LoRA adapters (the first under none where it has fewer)
    loras = [max(0, len(b.lora_adapters) - len(lengths) + 1 + i) for i in range(len(lengths))]
    prefill = [SequenceChunk(i, rng.integers(0, vocab, n).tolist(), 0, n, tables[i], lora_id=loras[i])
               for i, n in enumerate(lengths)]
    seqs = f"{len(lengths)} sequence" + "s" * (len(lengths) > 1)
    steps = [f"prefill of {' + '.join(map(str, lengths))} tokens ({seqs}, logits of every token)"]
    chunks = [prefill]
    if decode:
        chunks.append([SequenceChunk(i, [0], n, 1, tables[i], lora_id=loras[i]) for i, n in enumerate(lengths)])
        steps.append("decode of 1 token per sequence, on the reference prefill's K/V")
    groups, per_group = len(info.kv_cache_groups), sum(blocks_per_seq)
    return steps, [in_every_group(c, groups, per_group) for c in chunks], groups * per_group
