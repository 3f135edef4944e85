"""A checkpoint's quantization (`config.json: quantization`, docs/quantization.md): which format each linear and the
KV cache are in, and the scale tensors each quantized linear carries."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from trtbuild.errors import CheckpointError
from trtbuild.quantization import LM_HEAD_QUANT_ALGOS, QUANT_ALGOS, KVCacheQuantAlgo, QuantAlgo

# Scale tensors each quantized linear `P` carries besides `P.weight` (format: docs/quantization.md).
QUANT_SCALES: dict[str, tuple[str, ...]] = {
    QuantAlgo.FP8: ("weights_scaling_factor", "activation_scaling_factor"),
    QuantAlgo.INT4_AWQ: ("weights_scaling_factor", "prequant_scaling_factor"),
    QuantAlgo.INT8_SQ: ("weights_scaling_factor", "activation_scaling_factor", "prequant_scaling_factor"),
    QuantAlgo.INT8_WO: ("weights_scaling_factor",),
    QuantAlgo.WEIGHT_ONLY: ("weights_scaling_factor",),  # + weights_zero_point where the linear has one
}


@dataclass(frozen=True)
class QuantConfig:
    """Quantization of weights and KV cache; all None means full precision (docs/quantization.md)."""

    quant_algo: str | None = None  # QUANT_ALGOS (trtbuild.quantization)
    kv_cache_quant_algo: str | None = None  # KVCacheQuantAlgo
    # int4_awq: input features per weight scale (128 unless set); weight_only: the one group size of every linear
    # (null: per output channel, or differing between linears)
    group_size: int | None = None
    has_zero_point: bool = False  # weight_only: some linears carry weights_zero_point
    pre_quant_scale: bool = False  # linears carry prequant_scaling_factor (int4_awq, int8_sq)
    exclude_modules: tuple[str, ...] = ()  # fnmatch patterns over linear prefixes kept unquantized
    # q/k/v and gate/up of each layer carry identical prequant / activation (and fp8 weight) scales, so an engine
    # may fuse them into one GEMM (TensorRT-LLM style); false: every linear keeps its own calibrated scales
    shared_input_scales: bool = False
    smoothquant_alpha: float | None = None  # int8_sq: SmoothQuant migration strength in [0, 1] (null: unrecorded)
    # int8_sq: activations quantized per token with a dynamic scale (max |x| of the token / 127, computed at run
    # time; no activation_scaling_factor) instead of one static calibrated scale per linear
    per_token_activations: bool = False
    # lm_head in its own format (LM_HEAD_QUANT_ALGOS) while `exclude_modules` keeps it out of quant_algo
    lm_head_quant_algo: str | None = None
    # weight_only: the embedding table is stored in the weight_only form too (8-bit or symmetric 4-bit, no zero
    # points) and gathered by ONNX Runtime's GatherBlockQuantized
    embedding_weight_only: bool = False

    def __post_init__(self) -> None:
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"checkpoint quantization config: {what}; re-run `trtbuild quantize`.")

        if self.quant_algo not in (None, *QUANT_ALGOS):
            raise bad(f"quant_algo {self.quant_algo!r} is not one of {', '.join(QUANT_ALGOS)} or null")
        if self.kv_cache_quant_algo not in (None, *KVCacheQuantAlgo):
            raise bad(f"kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not one of "
                      f"{', '.join(KVCacheQuantAlgo)} or null")
        if self.has_zero_point and self.quant_algo != QuantAlgo.WEIGHT_ONLY:
            raise bad("has_zero_point=true (asymmetric weights) is only supported with quant_algo weight_only")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise bad(f"group_size {self.group_size!r} is not a positive integer")
        if self.group_size is not None and self.quant_algo not in (QuantAlgo.INT4_AWQ, QuantAlgo.WEIGHT_ONLY):
            raise bad(f"group_size is only meaningful for int4_awq and weight_only, not {self.quant_algo!r}")
        if bool(self.pre_quant_scale) != (self.quant_algo in (QuantAlgo.INT4_AWQ, QuantAlgo.INT8_SQ)):
            raise bad(f"pre_quant_scale={self.pre_quant_scale} does not match quant_algo {self.quant_algo!r}")
        if not all(isinstance(p, str) for p in self.exclude_modules):
            raise bad("exclude_modules must be a list of strings")
        if not isinstance(self.shared_input_scales, bool):
            raise bad(f"shared_input_scales {self.shared_input_scales!r} is not true or false")
        if self.shared_input_scales and self.quant_algo is None:
            raise bad("shared_input_scales=true needs a quant_algo")
        if not isinstance(self.per_token_activations, bool):
            raise bad(f"per_token_activations {self.per_token_activations!r} is not true or false")
        if self.per_token_activations and self.quant_algo != QuantAlgo.INT8_SQ:
            raise bad(f"per_token_activations is only meaningful for int8_sq, not {self.quant_algo!r}")
        alpha = self.smoothquant_alpha
        if alpha is not None and self.quant_algo != QuantAlgo.INT8_SQ:
            raise bad(f"smoothquant_alpha is only meaningful for int8_sq, not {self.quant_algo!r}")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                                  or not 0.0 <= alpha <= 1.0):
            raise bad(f"smoothquant_alpha {alpha!r} is not a number in [0, 1]")
        if self.embedding_weight_only is not False and (self.embedding_weight_only is not True
                                                         or self.quant_algo != QuantAlgo.WEIGHT_ONLY):
            raise bad(f"embedding_weight_only={self.embedding_weight_only!r} needs quant_algo weight_only")
        if self.lm_head_quant_algo not in (None, *LM_HEAD_QUANT_ALGOS):
            raise bad(f"lm_head_quant_algo {self.lm_head_quant_algo!r} is not one of {', '.join(LM_HEAD_QUANT_ALGOS)} "
                      "or null")
        if self.lm_head_quant_algo is not None and not self.is_excluded("lm_head"):
            raise bad(f"lm_head_quant_algo={self.lm_head_quant_algo} but exclude_modules does not exclude lm_head from "
                      f"quant_algo {self.quant_algo}")

    @property
    def weight_group_size(self) -> int:
        """int4_awq group size (input features per scale)."""
        return self.group_size or 128

    def is_excluded(self, prefix: str) -> bool:
        """Whether the linear with checkpoint prefix `prefix` (e.g. `lm_head`) stays unquantized."""
        return self.quant_algo is None or any(fnmatch.fnmatchcase(prefix, p) for p in self.exclude_modules)

    def algo_of(self, prefix: str) -> str | None:
        """The format of the linear `prefix`: quant_algo, lm_head_quant_algo for lm_head, or None (full precision)."""
        if prefix == "lm_head" and self.lm_head_quant_algo is not None:
            return self.lm_head_quant_algo
        return None if self.is_excluded(prefix) else self.quant_algo

    def scale_names(self, prefix: str) -> tuple[str, ...]:
        """Scale tensors the linear `prefix` carries (none when excluded or unquantized)."""
        algo = self.algo_of(prefix)
        if algo is None:
            return ()
        names = QUANT_SCALES[algo]
        if self.per_token_activations and algo == self.quant_algo:
            names = tuple(n for n in names if n != "activation_scaling_factor")
        return tuple(f"{prefix}.{s}" for s in names)
