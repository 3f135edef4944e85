"""Command-line options shared by several `trtbuild` commands (cli.py)."""

from __future__ import annotations

from pathlib import Path

import click

from trtbuild.errors import TrtbuildError

existing = click.Path(exists=True, path_type=Path)
out = click.Path(path_type=Path)


def read_text_file(path: Path) -> str:
    """A UTF-8 text file given on the command line; other encodings are a user error naming the file."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrtbuildError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8.") from None


def lora_adapter_options(ctx: click.Context, param: click.Parameter,
                         values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--lora NAME=PATH` values as (name, absolute path) pairs, the form BuildConfig.lora_adapters holds."""
    adapters = []
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise click.BadParameter(f"{value!r}: give NAME=PATH, e.g. {param.opts[0]} sql=./sql-lora", ctx, param)
        if not Path(folder).exists():
            raise click.BadParameter(f"{value!r}: {folder} does not exist (give a PEFT adapter folder, with "
                                     "adapter_config.json and adapter_model.safetensors, or a LoRA .gguf)", ctx, param)
        adapters.append((name, str(Path(folder).resolve())))
    return tuple(adapters)


def options(*decorators):
    """Apply several click options as one decorator (shared by the commands that take them)."""

    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


sampling_options = options(
    click.option("--max-tokens", type=click.IntRange(min=1), default=64, help="Tokens to generate at most."),
    click.option("--temperature", type=click.FloatRange(min=0), default=0.0, help="0 is greedy."),
    click.option("--top-k", type=click.IntRange(min=0), default=0, help="Keep the k most likely tokens (0: all)."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, help="Nucleus mass."),
    click.option("--seed", type=int, default=None, help="Seed for sampling."),
)
speculative_options = options(
    click.option("--speculative-tokens", type=click.IntRange(min=0), default=0,
                 help="Draft tokens per decode step (at most, with --draft-engine) from prompt lookup (n-gram) or "
                      "the draft engine; 0 is off."),
    click.option("--prompt-lookup-max", type=click.IntRange(min=1), default=4,
                 help="Longest n-gram prompt lookup matches (with --speculative-tokens)."),
    click.option("--draft-engine", type=existing, default=None,
                 help="A smaller engine with the same tokenizer that drafts the --speculative-tokens (e.g. built "
                      "from `trtbuild convert --num-layers N`) instead of prompt lookup."),
)


def speculative_config(speculative_tokens: int, prompt_lookup_max: int, draft_engine: Path | None = None
                       ):  # -> SpeculativeConfig | None
    from trtbuild.runtime.speculative import SpeculativeConfig

    if not speculative_tokens:
        if draft_engine is not None:
            raise click.UsageError("--draft-engine drafts --speculative-tokens tokens per step; add "
                                   "--speculative-tokens K (e.g. 4).")
        return None
    if draft_engine is not None:
        return SpeculativeConfig(speculative_tokens, method="draft_model", draft_engine_dir=str(draft_engine))
    return SpeculativeConfig(speculative_tokens, prompt_lookup_max=prompt_lookup_max)


# The fields of RuntimeConfig (runtime/config.py) as flags, for the commands that serve an engine.
serving_options = options(
    click.option("--kv-cache-memory", type=float, default=None,
                 help="KV cache budget: bytes (> 1) or a fraction of available memory (<= 1)."),
    click.option("--kv-cache-blocks", type=int, default=None,
                 help="Exact number of KV blocks (overrides --kv-cache-memory)."),
    click.option("--policy", type=click.Choice(["guaranteed_no_evict", "max_utilization"]), default="max_utilization",
                 help="guaranteed_no_evict reserves a request's whole lifetime; max_utilization preempts when full."),
    click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of shared prompt prefixes."),
    click.option("--max-state-snapshots", type=int, default=None,
                 help="Recurrent states (linear attention, Mamba2) kept after prompts and answers for prefix reuse "
                      "[default: 2 per sequence of a batch + 8, within 10%% of available memory; 0: such a model "
                      "reuses no prefix]."),
    click.option("--max-batch-size", type=int, default=None, help="[default: the engine's]"),
    click.option("--max-num-tokens", type=int, default=None, help="[default: the engine's]"),
    click.option("--max-prefill-chunk", type=int, default=None,
                 help="Prefill tokens of one request per step [default: the whole token budget]."),
    click.option("--max-queue-size", type=int, default=256,
                 help="Unfinished requests held at most; more are refused (retry later)."),
    click.option("--max-queued-tokens", type=int, default=None,
                 help="Prompt tokens of unfinished requests held at most; more are refused (retry later) "
                      "[default: 4x the KV cache's tokens, at least max_seq_len]."),
    speculative_options,
    click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads."),
    click.option("--rank-cpus", default=None,
                 help="A tensor-parallel engine's CPUs, rank by rank: '0-31|32-63' [default: a NUMA node's (or a "
                      "run of nodes) per rank where there are as many as ranks, else none pinned]."),
)


def runtime_config(kv_cache_memory: float | None, kv_cache_blocks: int | None, policy: str, no_prefix_caching: bool,
                   max_state_snapshots: int | None, max_batch_size: int | None, max_num_tokens: int | None,
                   max_prefill_chunk: int | None,
                   max_queue_size: int, max_queued_tokens: int | None, speculative_tokens: int, prompt_lookup_max: int,
                   draft_engine: Path | None,
                   threads: int | None,
                   rank_cpus: str | None):  # -> RuntimeConfig, which checks every value (ConfigError names the field)
    from trtbuild.runtime.config import RuntimeConfig

    return RuntimeConfig(kv_cache_memory=kv_cache_memory, kv_cache_blocks=kv_cache_blocks, policy=policy,
                         enable_prefix_caching=not no_prefix_caching, max_state_snapshots=max_state_snapshots,
                         max_batch_size=max_batch_size,
                         max_num_tokens=max_num_tokens, max_prefill_chunk=max_prefill_chunk,
                         max_queue_size=max_queue_size, max_queued_tokens=max_queued_tokens, num_threads=threads,
                         rank_cpus=rank_cpus,
                         speculative=speculative_config(speculative_tokens, prompt_lookup_max, draft_engine))
