"""Build-time limits of an engine (what TensorRT would call optimization profiles)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import ConfigError
from trtbuild.quantization import KVPoolDtype

TARGETS = ("cpu", "cuda", "tensorrt")
# compute dtypes of the cuda target (weights, activations and the KV pool); the CPU target computes in float32
DTYPES = ("float32", "float16", "bfloat16")
# ONNX Runtime MatMulNBits accuracy levels the CPU engine offers for int4 weights: 1 = fp32 compute (bit-faithful
# to the checkpoint format), 4 = int8 compute (activations quantized per block, VNNI kernels; faster).
INT4_ACCURACY_LEVELS = (1, 4)
# build-time tactic selection (builder/autotune.py): off, fast (the shapes of a single user), full (more shapes)
AUTOTUNE_MODES = ("off", "fast", "full")
# how the engine takes speculative drafts: none (the runtime verifies them from logits rows), draft-tokens (the
# engine's SpeculativeAccept op verifies up to max_draft_len drafts per sequence, plugins/speculative_accept.py)
SPECULATIVE_DECODING_MODES = ("none", "draft-tokens")
# how the CPU target computes PagedAttention (builder/lower_cpu.py): native (trtbuild's custom-op library, cpu_ops/),
# split or concat (standard ONNX ops); auto: the autotuner's choice, else native where the library builds
ATTENTION_MODES = ("auto", "native", "split", "concat")
# how the CPU target computes 4/8-bit linears in blocks of 16 or 32 (builder/native_linears.py): native
# (trtbuild::BlockQuantMatMul, cpu_ops/) or ort (MatMulNBits); auto: the autotuner's choice, else native where it runs
QUANT_LINEARS_MODES = ("auto", "native", "ort")
# how the CPU target computes unquantized linears (builder/dense_linears.py): native (trtbuild::DenseMatMul over the
# weights in the narrowest float type exact for them, cpu_ops/) or ort (MatMul on float32 weights); auto: as above
FLOAT_LINEARS_MODES = ("auto", "native", "ort")
# what an engine computes for the rows it is asked for: generate (logits over the vocabulary) or embed (the final
# hidden state, after the last norm: an embedding model's last-token pooling, as vLLM's --task embed)
TASKS = ("generate", "embed")
# the engine input of an engine built with LoRA adapters: each packed token's adapter (0: none; builder/lora.py)
LORA_IDS_INPUT = "lora_ids"


NO_LORA_ADAPTERS = "it was built without any (`trtbuild build --lora NAME=PATH`)"


def lora_index(names: tuple[str, ...], name: str | None, field: str = "lora", owner: str = "this engine",
               none: str = NO_LORA_ADAPTERS) -> int:
    """A request's LoRA adapter as the engine's lora_ids count them: 0 for None (the base model), else 1 + its place
    in `names` (BuildConfig.lora_names); ValueError naming the request's `field` for a name `owner` lacks (`none`:
    what to say when it has no adapters at all)."""
    if name is None:
        return 0
    if name not in names:
        raise unknown_lora(names, name, field, owner, none)
    return 1 + names.index(name)


def unknown_lora(names: tuple[str, ...], name: str, field: str = "lora", owner: str = "this engine",
                 none: str = NO_LORA_ADAPTERS) -> ValueError:
    """The error of a request naming LoRA adapter `name` that `owner` lacks (lora_index)."""
    return ValueError(f"{field}: {owner} has no LoRA adapter {name!r}; " + (f"it has {', '.join(names)}" if names
                                                                             else none))


@dataclass(frozen=True)
class BuildConfig:
    target: str = "cpu"
    max_batch_size: int = 16
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence
    max_num_tokens: int = 2048  # tokens packed into one engine call (prefill chunks + decode tokens)
    tokens_per_block: int = 16  # paged-KV block size
    fuse: bool = True  # run the fusion passes (off only to test them)
    # INT4_ACCURACY_LEVELS: MatMulNBits' compute on the CPU target, for int4 and int8 weight-only (int8_wo) linears
    int4_accuracy_level: int = 4
    # KVPoolDtype of an unquantized KV pool: float16 halves its bytes (attention still computes in float32); a
    # quantized one is the checkpoint's kv_cache_quant_algo (trtbuild.quantization.kv_pool_dtype). Builds from a
    # checkpoint get builder/build.py's default_kv_pool_dtype unless given
    kv_pool_dtype: str = KVPoolDtype.FLOAT32.value
    autotune: str = "off"  # AUTOTUNE_MODES: time the engine's tactics on this machine and keep the fastest
    speculative_decoding_mode: str = "none"  # SPECULATIVE_DECODING_MODES
    max_draft_len: int = 0  # drafts per sequence the accept op takes (draft-tokens mode: at least 1)
    dtype: str = "float32"  # DTYPES: the cuda target's compute dtype; the CPU target computes in float32
    attention: str = "auto"  # ATTENTION_MODES (CPU target)
    quant_linears: str = "auto"  # QUANT_LINEARS_MODES (CPU target)
    float_linears: str = "auto"  # FLOAT_LINEARS_MODES (CPU target)
    # LoRA adapters built in beside the base weights, ((name, PEFT folder or llama.cpp adapter .gguf), ...): a request
    # names the one it runs under (builder/lora.py); the engine's `lora_ids` input says which, per token
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # LoRA slots instead (builder/lora_slots.py): room for max_loras adapters of rank up to max_lora_rank that a
    # running engine loads and unloads (as vLLM's --max-loras / --max-lora-rank); 0: none
    max_loras: int = 0
    max_lora_rank: int = 0
    task: str = "generate"  # TASKS

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConfigError("target", f"must be one of {', '.join(TARGETS)}, got {self.target!r}.")
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}.")
        if self.int4_accuracy_level not in INT4_ACCURACY_LEVELS:
            raise ConfigError("int4_accuracy_level", f"must be one of {', '.join(map(str, INT4_ACCURACY_LEVELS))}, "
                                                     f"got {self.int4_accuracy_level}.")
        if self.autotune not in AUTOTUNE_MODES:
            raise ConfigError("autotune", f"must be one of {', '.join(AUTOTUNE_MODES)}, got {self.autotune!r}.")
        if self.kv_pool_dtype not in tuple(KVPoolDtype):
            raise ConfigError("kv_pool_dtype", f"must be one of {', '.join(KVPoolDtype)}, got {self.kv_pool_dtype!r}.")
        if self.dtype not in DTYPES or (self.target != "cuda" and self.dtype != "float32"):
            raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)} for the cuda target and float32 for the "
                                       f"others, got {self.dtype!r} for {self.target}.")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError("attention", f"must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}.")
        if self.quant_linears not in QUANT_LINEARS_MODES:
            raise ConfigError("quant_linears", f"must be one of {', '.join(QUANT_LINEARS_MODES)}, got "
                                               f"{self.quant_linears!r}.")
        if self.float_linears not in FLOAT_LINEARS_MODES:
            raise ConfigError("float_linears", f"must be one of {', '.join(FLOAT_LINEARS_MODES)}, got "
                                               f"{self.float_linears!r}.")
        if self.speculative_decoding_mode not in SPECULATIVE_DECODING_MODES:
            raise ConfigError("speculative_decoding_mode", f"must be one of {', '.join(SPECULATIVE_DECODING_MODES)}, "
                                                           f"got {self.speculative_decoding_mode!r}.")
        # NOTE: JSON (config.json) gives lists; the frozen config holds tuples, so that equal configs compare equal
        object.__setattr__(self, "lora_adapters", tuple(tuple(map(str, a)) for a in self.lora_adapters))
        names = [a[0] for a in self.lora_adapters]
        if any(len(a) != 2 for a in self.lora_adapters) or len(set(names)) != len(names):
            raise ConfigError("lora_adapters", f"must be distinct (name, path) pairs, got {list(self.lora_adapters)}.")
        self._check_lora_slots()
        if self.task not in TASKS:
            raise ConfigError("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.task == "embed" and (self.target != "cpu" or self.draft_tokens):
            raise ConfigError("task", "embed builds for the cpu target without draft tokens (an embedding request "
                                      f"samples nothing), got target {self.target} and speculative decoding mode "
                                      f"{self.speculative_decoding_mode}.")
        if self.draft_tokens != (self.max_draft_len > 0) or self.max_draft_len < 0:
            raise ConfigError("max_draft_len", "must be at least 1 with speculative_decoding_mode draft-tokens and 0 "
                                               f"without, got {self.max_draft_len}.")

    @property
    def draft_tokens(self) -> bool:
        """The engine verifies drafts itself (SpeculativeAccept)."""
        return self.speculative_decoding_mode == "draft-tokens"

    def _check_lora_slots(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 0 or (self.max_loras > 0) != (self.max_lora_rank > 0):
            raise ConfigError("max_loras", "max_loras and max_lora_rank are both at least 1 (an engine with LoRA "
                                           f"slots) or both 0, got {self.max_loras} and {self.max_lora_rank}.")
        if self.max_loras and self.lora_adapters:
            raise ConfigError("max_loras", "an engine either builds its adapters in (lora_adapters, `--lora`) or "
                                           "has slots to load them at run time (`--max-loras`), not both; with "
                                           "slots, load them with `trtbuild serve --lora-modules NAME=PATH`.")
        if self.max_loras and self.target != "cpu":
            raise ConfigError("max_loras", f"LoRA slots run on the cpu target only, not {self.target}; build the "
                                           "adapters in with `--lora NAME=PATH` instead.")

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The adapters built in, in the order of their `lora_ids` (1, 2, ...; 0 is the base model)."""
        return tuple(a[0] for a in self.lora_adapters)

    @property
    def num_lora_ids(self) -> int:
        """How many adapters a step's `lora_ids` may name (1 .. this; 0 is none): built in, or slots."""
        return self.max_loras or len(self.lora_adapters)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.tokens_per_block)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BuildConfig:
        return cls(**d)
