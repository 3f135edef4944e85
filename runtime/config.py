"""RuntimeConfig: the serving options of an engine, shared by every front end, and the one place (`resolve`) where
they meet the engine's build limits.

The Triton backend stores a RuntimeConfig as config.pbtxt `parameters` (`to_parameters` / `from_parameters`), one
parameter per field, under the field's own name; the CLI sets the same fields from flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError
from trtbuild.runtime.scheduler import POLICIES
from trtbuild.runtime.speculative import SpeculativeConfig

# Speculative decoding's fields, stored flat beside the others (absent or 0 drafts: off).
_SPECULATIVE_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))
_AT_LEAST_ONE = ("kv_cache_blocks", "max_batch_size", "max_num_tokens", "max_prefill_chunk", "max_queue_size",
                 "max_queued_tokens", "num_threads")


@dataclass(frozen=True)
class RuntimeConfig:
    """Serving options. Invariant: every field is valid on its own (checked here); limits left None take the
    engine's build limits in `resolve`, where larger ones are refused, not clipped."""

    kv_cache_memory: float | None = None  # bytes (> 1) or a fraction of available memory (<= 1); None: see memory.py
    kv_cache_blocks: int | None = None  # exact number of blocks (overrides kv_cache_memory)
    policy: str = "max_utilization"  # POLICIES: max_utilization preempts when full, guaranteed_no_evict reserves
    enable_prefix_caching: bool = True
    # recurrent states (linear attention, Mamba2 layers) kept after prompts and answers so that a prefix of them can
    # be reused [None: recurrent_state.default_snapshots; 0: none, so such a model reuses no prefix; 0 after
    # `resolve` without prefix caching]
    max_state_snapshots: int | None = None
    max_batch_size: int | None = None  # sequences per engine step [None: the engine's]
    max_num_tokens: int | None = None  # tokens per engine step [None: the engine's]
    max_prefill_chunk: int | None = None  # prefill tokens of one request per step [None: the whole token budget]
    max_queue_size: int = 256  # unfinished requests a server holds at most; more are refused
    # prompt tokens of the unfinished requests a server holds at most [None: QUEUED_TOKENS_PER_POOL_TOKEN x the KV
    # pool's tokens, at least max_seq_len]; more are refused, so that queued prompts cannot hold unbounded memory
    max_queued_tokens: int | None = None
    num_threads: int | None = None  # ONNX Runtime intra-op threads [None: the number of cores]
    # a tensor-parallel engine's CPUs, rank by rank: "0-31|32-63" [None: one run of NUMA nodes per rank where the
    # machine has as many nodes as ranks, else none pinned] (runtime/cpu_topology.py)
    rank_cpus: str | None = None
    speculative: SpeculativeConfig | None = None  # draft tokens verified per decode step; None: off
    warm_up: bool = True  # at start: one dummy step of the largest batch (CpuEngine.warm_up), KV pool faulted in

    def __post_init__(self) -> None:
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(name, f"must be at least 1, got {value}")
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise ConfigError("max_state_snapshots", f"must be 0 or more, got {self.max_state_snapshots}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", f"must be positive (bytes, or a fraction of available memory), "
                                                 f"got {self.kv_cache_memory:g}")
        if self.policy not in POLICIES:
            raise ConfigError("policy", f"must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.rank_cpus is not None:
            from trtbuild.runtime.cpu_topology import parse_rank_cpus

            parse_rank_cpus(self.rank_cpus)  # ConfigError names the field and the format

    def resolve(self, build: BuildConfig) -> RuntimeConfig:
        """This config with the engine's limits in place of those left None (and no recurrent states kept without
        prefix caching). A limit above the engine's is a ConfigError: an engine cannot run batches larger than it was
        built for."""
        limits = {}
        for name in ("max_batch_size", "max_num_tokens"):
            asked, built = getattr(self, name), getattr(build, name)
            if asked is not None and asked > built:
                raise ConfigError(name, f"{asked} exceeds the engine's build limit {built}; ask for at most {built} "
                                        f"or rebuild the engine with a larger {name}")
            limits[name] = asked or built
        limits["max_state_snapshots"] = self.max_state_snapshots if self.enable_prefix_caching else 0
        return dataclasses.replace(self, **limits)

    # ---- flat string parameters (Triton's config.pbtxt) --------------------------------------------------------
    def to_parameters(self) -> dict[str, str]:
        """Every field as a string ("" for None), speculative decoding's fields flattened beside the others."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "speculative"}
        spec = self.speculative
        fields.update({name: getattr(spec, name) if spec else None for name in _SPECULATIVE_FIELDS})
        return {k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in fields.items()}

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> RuntimeConfig:
        """The inverse of `to_parameters`; missing or "" values take the default, unknown names are an error."""
        hints = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "speculative"}
        hints.update({f.name: f.type for f in dataclasses.fields(SpeculativeConfig)})
        unknown = sorted(set(parameters) - set(hints))
        if unknown:
            raise ConfigError(unknown[0], f"is not a runtime option; known: {', '.join(sorted(hints))}")
        values = {k: _parse(k, str(hints[k]), v.strip()) for k, v in parameters.items() if v.strip()}
        spec = {k: values.pop(k) for k in _SPECULATIVE_FIELDS if k in values}
        if spec.get("num_speculative_tokens"):
            values["speculative"] = SpeculativeConfig(**spec)
        return cls(**values)


def _parse(name: str, hint: str, text: str) -> Any:
    """`text` as the type named by a field's annotation (postponed, so a string: 'int | None', 'bool', ...)."""
    if hint.startswith("bool"):
        if text.lower() not in ("true", "false"):
            raise ConfigError(name, f"must be true or false, got {text!r}")
        return text.lower() == "true"
    for kind in (int, float):
        if hint.startswith(kind.__name__):
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(name, f"must be a number ({kind.__name__}), got {text!r}") from None
    return text
