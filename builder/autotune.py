"""Kernel autotuning at build time, in the manner of TensorRT's tactic selection with a timing cache.

A tactic is one way to compute the same thing, each worth having because it wins somewhere: the attention (the native
custom op where its library builds, or the standard-op lowerings of `ATTENTION_VARIANTS`: scoring past and new keys
apart, or side by side after one copy of the context), the 4/8-bit linears (trtbuild::BlockQuantMatMul or ONNX
Runtime's MatMulNBits) and the number of ONNX Runtime threads. Each candidate is timed on this machine at the
engine's shape classes (a single user's decode and prefill; `full` adds a full decode batch and a long context), and
the one with the lowest total time relative to the best of each class is kept. Choices and timings go into the
engine's config.json ("tactics").

The timing cache (`--timing-cache FILE`, JSON) maps a key of (CPU model, CPU features, core count, onnxruntime
version, tactic family, the engine's shapes and formats) to what was measured, so a rebuild of the same engine on the
same kind of machine measures nothing. NOTE: this module picks and records; the timing itself is a `Timer` handed in
by the caller (bench/autotune.py), since the builder does not run models.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from trtbuild.builder.engine_dir import cpu_features
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import TrtbuildError

log = logging.getLogger(__name__)
CACHE_VERSION = 1
PREFERRED_MARGIN = 0.03  # relative; see best()


@dataclass(frozen=True)
class ShapeClass:
    """One kind of engine call timed: `batch` sequences with `context` tokens cached, `new_tokens` computed each."""

    name: str
    batch: int
    context: int
    new_tokens: int


# (graph file with its weights as external data beside it, the engine's model and build configs, thread count,
# shape classes) -> milliseconds per call, by shape class name
Timer = Callable[[Path, ModelConfig, BuildConfig, int, tuple[ShapeClass, ...]], dict[str, float]]


def shape_classes(build: BuildConfig, mode: str) -> tuple[ShapeClass, ...]:
    """The calls tactics are timed on, within the build's limits."""
    ctx = max(1, min(128, build.max_seq_len // 2))
    prompt = max(1, min(128, build.max_num_tokens, build.max_seq_len))
    shapes = [ShapeClass(f"decode_b1_ctx{ctx}", 1, ctx, 1), ShapeClass(f"prefill_{prompt}", 1, 0, prompt)]
    if mode == "full":
        batch = min(build.max_batch_size, 16, build.max_num_tokens)
        long_ctx = max(ctx, min(1024, build.max_seq_len - 1))
        shapes += [ShapeClass(f"decode_b{batch}_ctx{ctx}", batch, ctx, 1),
                   ShapeClass(f"decode_b1_ctx{long_ctx}", 1, long_ctx, 1)]
    return tuple(dict.fromkeys(shapes))


def best(timings: dict[str, dict[str, float]]) -> str:
    """The candidate with the lowest sum over shape classes of its time / the best time of that class. The first
    listed (the default) stays unless another's sum is lower by more than PREFERRED_MARGIN: a difference inside
    this VM's timing noise is no reason to leave the default."""
    classes = next(iter(timings.values())).keys()
    fastest = {c: min(t[c] for t in timings.values()) for c in classes}
    score = {name: sum(t[c] / fastest[c] for c in classes) for name, t in timings.items()}
    default, winner = next(iter(score)), min(score, key=score.__getitem__)
    return default if score[default] <= score[winner] * (1 + PREFERRED_MARGIN) else winner


class TimingCache:
    """What earlier builds measured, by key (see module docstring); a missing file is an empty cache."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            try:
                doc = json.loads(self.path.read_bytes())
                if doc.get("version") != CACHE_VERSION:
                    raise ValueError(f"version {doc.get('version')!r}, this trtbuild writes {CACHE_VERSION}")
                self.entries = dict(doc["entries"])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise TrtbuildError(f"timing cache {self.path} is unreadable ({e}); delete it or give another "
                                    "file.") from None

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.entries[key] = value
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": self.entries}, indent=1) + "\n")
            os.replace(tmp, self.path)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(family: str, model: ModelConfig, build: BuildConfig, extra: dict[str, Any] | None = None) -> str:
    """The timing cache key of one tactic family for one engine on this kind of machine."""
    import onnxruntime

    m = model.to_dict()
    signature = {k: m.get(k) for k in ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "head_size", "vocab_size",
                                       "dtype", "quantization")}
    limits = {k: v for k, v in build.to_dict().items() if k not in ("autotune", "fuse")}
    doc = {"cpu": cpu_model(), "features": cpu_features(), "cores": os.cpu_count(), "family": family,
           "onnxruntime": onnxruntime.__version__, "model": signature, "build": limits, **(extra or {})}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _measured(family: str, key: str, cache: TimingCache, candidates: dict[str, Callable[[], dict[str, float]]]
              ) -> dict[str, Any]:
    """{"chosen", "timings_ms", "source"} for a tactic family: from the cache, or by timing every candidate."""
    hit = cache.get(key)
    if hit is not None and set(hit.get("timings_ms", {})) == set(candidates):
        hit = {**hit, "chosen": best({name: hit["timings_ms"][name] for name in candidates})}  # today's rule
        log.info("autotune %s: %s (timing cache)", family, hit["chosen"])
        return {**hit, "source": "timing cache"}
    timings = {name: time_it() for name, time_it in candidates.items()}
    record = {"chosen": best(timings), "timings_ms": timings}
    cache.put(key, record)
    log.info("autotune %s: %s, ms by shape class: %s", family, record["chosen"], timings)
    return {**record, "source": "measured"}


def tune(model: onnx.ModelProto, config: ModelConfig, build: BuildConfig, output: Path,
         lower: Callable[[onnx.ModelProto, BuildConfig], Any], candidates: dict[str, tuple[str, ...]], timer: Timer,
         cache: TimingCache) -> dict[str, Any]:
    """Choose each tactic family's candidate in turn (`candidates`: BuildConfig field -> values, preferred first),
    then the thread count; returns the config.json "tactics".

    `model` is the network before its last lowering; `lower(copy, build)` lowers a copy in place as `build` says.
    A family is timed with the choices made before it and the preferred values of those after it. Each candidate
    graph is written into `output` beside the staging weights it refers to, timed, and removed."""
    shapes = shape_classes(build, build.autotune)
    cores = os.cpu_count() or 1
    graph = Path(output) / "rank0.tuning.onnx"

    def timed(choice: BuildConfig, threads: int) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            candidate = copy.deepcopy(model)
            lower(candidate, choice)
            onnx.save_model(candidate, str(graph))
            del candidate
            try:
                return timer(graph, config, choice, threads, shapes)
            finally:
                graph.unlink(missing_ok=True)
        return run

    tactics: dict[str, Any] = {"mode": build.autotune, "shape_classes": [s.name for s in shapes]}
    on = {"shapes": [s.name for s in shapes]}
    chosen = dataclasses.replace(build, **{family: options[0] for family, options in candidates.items()})
    for family, options in candidates.items():
        if len(options) > 1:
            earlier = {f: getattr(chosen, f) for f in candidates if f in tactics}
            tactics[family] = _measured(family, cache_key(family, config, build, {**on, **earlier, "threads": cores}),
                                        cache, {v: timed(dataclasses.replace(chosen, **{family: v}), cores)
                                                for v in options})
        else:  # asked for, or the only one that applies here: nothing to choose
            tactics[family] = {"chosen": options[0], "timings_ms": {},
                               "source": "requested" if getattr(build, family) != "auto" else "only candidate"}
        chosen = dataclasses.replace(chosen, **{family: tactics[family]["chosen"]})
    thread_counts = sorted({1, cores} | ({cores // 2} if cores >= 4 else set()), reverse=True)  # default first
    if len(thread_counts) > 1:
        fixed = {f: getattr(chosen, f) for f in candidates}
        threads = _measured("num_threads", cache_key("num_threads", config, build, {**on, **fixed}),
                            cache, {str(n): timed(chosen, n) for n in thread_counts})
        tactics["num_threads"] = {**threads, "chosen": int(threads["chosen"]), "cores": cores}
    return tactics
