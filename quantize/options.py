"""What `trtbuild quantize` is asked to do: one frozen, validated set of options (cheap to import: no torch)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from trtbuild.configs import QuantConfig
from trtbuild.errors import ConfigError
from trtbuild.quantization import (
    CALIBRATED_QUANT_ALGOS,
    FULL_PRECISION,
    LM_HEAD_QUANT_ALGOS,
    KVCacheQuantAlgo,
    QuantAlgo,
)

# SmoothQuant migration strength for int8_sq when smoothquant_alpha is not given, by per-token activations or not:
# the most accurate of those measured on SmolLM2-135M (docs/quantization-results.md). Static per-tensor activation
# scales need the outliers moved into the weights; per-token scales absorb them and keep the weights easy.
DEFAULT_SMOOTHQUANT_ALPHA = {False: 0.7, True: 0.5}


@dataclass(frozen=True)
class QuantizeOptions:
    """Options of one quantization, named as the `trtbuild quantize` fields they come from; checked on creation.

    Errors are `ConfigError(field, problem)`: each front end names the field its own way (the CLI as its flag).
    """

    model: Path  # HF folder, .gguf file or unquantized trtbuild checkpoint folder
    output: Path  # checkpoint folder to create
    qformat: str  # CALIBRATED_QUANT_ALGOS, or FULL_PRECISION (the KV cache only)
    kv_cache_qformat: str | None = None  # KVCacheQuantAlgo, or None: the KV cache stays in the checkpoint dtype
    calib_dataset: Path | None = None  # None: the default corpus (quantize/calib.py)
    calib_size: int = 512
    calib_max_seq_len: int = 512
    awq_block_size: int | None = None  # int4_awq: None picks the largest of 128/64/32 dividing every linear
    awq_grid: int | None = None  # int4_awq: alphas searched per linear (None: DEFAULT_GRID_POINTS, quantize/awq.py)
    smoothquant_alpha: float | None = None  # int8_sq: None is DEFAULT_SMOOTHQUANT_ALPHA
    per_token_activations: bool = False  # int8_sq: dynamic per-token activation scales instead of static ones
    # q/k/v and gate/up of each layer share their input (and fp8 weight) scales, so engines may fuse them (costs
    # accuracy); otherwise each linear keeps its own
    shared_input_scales: bool = False
    exclude: tuple[str, ...] = ("lm_head",)  # fnmatch patterns of linears kept unquantized
    lm_head_qformat: str | None = None  # LM_HEAD_QUANT_ALGOS: lm_head, excluded from qformat, in its own format
    dtype: str = "auto"
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        object.__setattr__(self, "output", Path(self.output))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        if self.calib_dataset is not None:
            object.__setattr__(self, "calib_dataset", Path(self.calib_dataset))
        self._check_formats()
        self._check_format_options()

    def _check_formats(self) -> None:
        qformat = self.qformat
        if qformat not in (*CALIBRATED_QUANT_ALGOS, FULL_PRECISION):
            raise ConfigError("qformat", f"{qformat!r} is not one of {', '.join(CALIBRATED_QUANT_ALGOS)}, "
                                         f"{FULL_PRECISION}.")
        if self.kv_cache_qformat not in (None, *KVCacheQuantAlgo):
            raise ConfigError("kv_cache_qformat", f"{self.kv_cache_qformat!r} is not one of "
                                                  f"{', '.join(KVCacheQuantAlgo)}.")
        if qformat == FULL_PRECISION and self.kv_cache_qformat is None:
            raise ConfigError("qformat", f"{FULL_PRECISION} keeps the weights as they are, so it needs a KV cache "
                                         f"format ({', '.join(KVCacheQuantAlgo)}): nothing else would be quantized "
                                         "(`trtbuild convert` writes a full-precision checkpoint).")
        if qformat == FULL_PRECISION and self.lm_head_qformat is not None:
            raise ConfigError("lm_head_qformat", f"the {FULL_PRECISION} format keeps every linear as it is, lm_head "
                                                 "included: drop lm_head's format, or pick a weight format.")
        block = self.awq_block_size
        if qformat == QuantAlgo.INT4_AWQ and block is not None and (not 16 <= block <= 256 or block & (block - 1)):
            raise ConfigError("awq_block_size", f"{block} must be a power of two from 16 to 256 (what ONNX Runtime's "
                                                "MatMulNBits runs), e.g. 64 or 128.")
        head = self.lm_head_qformat
        if head is not None:
            if head not in LM_HEAD_QUANT_ALGOS:
                raise ConfigError("lm_head_qformat", f"{head!r} is not one of {', '.join(LM_HEAD_QUANT_ALGOS)}.")
            if not any(fnmatch.fnmatchcase("lm_head", p) for p in self.exclude):
                raise ConfigError("lm_head_qformat", f"{head} gives lm_head its own format, but the exclude patterns "
                                                     f"({' '.join(self.exclude) or 'none'}) leave lm_head to the "
                                                     f"{qformat} format; exclude lm_head too.")

    def _check_format_options(self) -> None:
        qformat = self.qformat
        if self.per_token_activations and qformat != QuantAlgo.INT8_SQ:
            raise ConfigError("per_token_activations", f"applies to the int8_sq format only, not {qformat}.")
        alpha = self.smoothquant_alpha
        if alpha is not None:
            if qformat != QuantAlgo.INT8_SQ:
                raise ConfigError("smoothquant_alpha", f"applies to the int8_sq format only, not {qformat}.")
            if not 0.0 <= alpha <= 1.0:  # also refuses nan
                raise ConfigError("smoothquant_alpha", f"{alpha} must be in [0, 1] (0: no migration to the weights, "
                                                       "1: all of it).")
        for name in ("calib_size", "calib_max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}.")
        if self.awq_grid is not None and qformat != QuantAlgo.INT4_AWQ:
            raise ConfigError("awq_grid", f"applies to the int4_awq format only, not {qformat}.")
        if self.awq_grid is not None and self.awq_grid < 2:
            raise ConfigError("awq_grid", f"{self.awq_grid} must be at least 2 (alpha 0 and 1).")
        if self.per_token_activations and self.tp_size > 1:
            raise ConfigError("per_token_activations", f"needs one tensor-parallel rank, not {self.tp_size}: a "
                                                       "token's scale is the max over all its input features, which a "
                                                       "row-parallel rank does not hold.")

    def quant_config(self) -> QuantConfig:
        """The checkpoint's quantization config (int4_awq's default group size is chosen later, per model)."""
        qformat, alpha = self.qformat, self.smoothquant_alpha
        if qformat == QuantAlgo.INT8_SQ and alpha is None:
            alpha = DEFAULT_SMOOTHQUANT_ALPHA[bool(self.per_token_activations)]
        weights = qformat != FULL_PRECISION
        return QuantConfig(quant_algo=str(qformat) if weights else None,
                           kv_cache_quant_algo=_plain(self.kv_cache_qformat),
                           group_size=self.awq_block_size if qformat == QuantAlgo.INT4_AWQ else None,
                           pre_quant_scale=qformat in (QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ),
                           exclude_modules=self.exclude if weights else (),
                           shared_input_scales=bool(self.shared_input_scales),
                           smoothquant_alpha=None if alpha is None else float(alpha),
                           per_token_activations=bool(self.per_token_activations),
                           lm_head_quant_algo=_plain(self.lm_head_qformat))


def _plain(value: str | None) -> str | None:
    """A format name as the plain string config.json stores (an enum member given by a caller becomes its value)."""
    return None if value is None else str(value)
