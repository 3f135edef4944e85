"""Quantized checkpoints -> the standard Q/DQ form of each linear in the unfused network, and what a target can run.

The unfused network carries each format the way TensorRT's ONNX parser takes it (docs/quantization.md):
  fp8       Q/DQ(x, activation scale, float8e4m3fn) -> MatMul <- DequantizeLinear(float8e4m3fn weight, scale)
  int4_awq  Mul(x, prequant) -> MatMul <- DequantizeLinear(int4 weight [in, out], scales [in/g, out], axis 0,
            block_size g)  (signed int4 with the implicit zero point 0, as TensorRT requires)
  int8_sq   Mul(x, prequant) -> Q/DQ(int8, activation scale) -> MatMul <- DequantizeLinear(int8 weight [in, out],
            per-output-channel scales, axis 1); with per_token_activations the Q/DQ is blocked over the whole last
            axis with the scale computed per token: ReduceMax(Abs(x), -1) / 127 (standard ONNX, opset 21+)
  int8_wo   x -> MatMul <- DequantizeLinear(int8 weight [in, out], per-output-channel scales, axis 1)
            (weight-only; `lm_head_quant_algo`)
  weight_only  MatMulNBits(x, codes, scales[, float zero points]) (builder/weight_only_linear.py)
Target lowerings (builder/passes/lower_quant_cpu.py for CPU) rewrite these patterns to low-precision kernels.
A linear is quantized when its checkpoint has `<prefix>.weights_scaling_factor`, in the format
`QuantConfig.algo_of(prefix)` names; `exclude_modules` (lm_head, ...) have none and stay full-precision MatMuls.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from onnx import TensorProto

from trtbuild.builder.convert.checkpoint import expected_shape
from trtbuild.builder.graph import GraphBuilder
from trtbuild.builder.weight_only_linear import emit_nbits_matmul
from trtbuild.configs import BuildConfig, ModelConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.quantization import (
    INT8_MAX,
    LM_HEAD_QUANT_ALGOS,
    PER_TOKEN_MIN_AMAX,
    QUANT_ALGOS,
    KVCacheQuantAlgo,
    KVPoolDtype,
    QuantAlgo,
    unpack_int4,
)

INT4_GROUP_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits block sizes: powers of two from 16
WEIGHT_DTYPES = {QuantAlgo.FP8: torch.float8_e4m3fn, QuantAlgo.INT4_AWQ: torch.uint8, QuantAlgo.INT8_SQ: torch.int8,
                 QuantAlgo.INT8_WO: torch.int8, QuantAlgo.WEIGHT_ONLY: torch.uint8}
KV_SCALE = "attention.kv_cache_scaling_factor"


def check_quantization(config: ModelConfig, build: BuildConfig) -> None:
    """Refuse a checkpoint whose quantization the target cannot run, naming what can."""
    q = config.quantization
    if q.quant_algo not in (None, *QUANT_ALGOS):
        raise TrtbuildError(f"quantization {q.quant_algo!r} cannot be built for target {build.target}; supported "
                            f"quant_algo: {', '.join(QUANT_ALGOS)} (or none).")
    if q.kv_cache_quant_algo not in (None, *KVCacheQuantAlgo):
        raise TrtbuildError(f"KV cache quantization {q.kv_cache_quant_algo!r} cannot be built for target "
                            f"{build.target}; supported kv_cache_quant_algo: {', '.join(KVCacheQuantAlgo)}.")
    if q.kv_cache_quant_algo and build.kv_pool_dtype != KVPoolDtype.FLOAT32:
        raise ConfigError("kv_pool_dtype", f"{build.kv_pool_dtype} applies to unquantized KV caches only, and the "
                                           f"checkpoint's KV cache is quantized ({q.kv_cache_quant_algo}): drop it, or "
                                           "quantize the model without KV cache quantization.")
    if q.lm_head_quant_algo not in (None, *LM_HEAD_QUANT_ALGOS):
        raise TrtbuildError(f"lm_head quantization {q.lm_head_quant_algo!r} cannot be built for target {build.target}; "
                            f"supported lm_head_quant_algo: {', '.join(LM_HEAD_QUANT_ALGOS)}.")
    if q.has_zero_point and q.quant_algo != QuantAlgo.WEIGHT_ONLY:
        raise TrtbuildError("quantization with zero points (has_zero_point=true) is not supported; re-quantize with "
                            "symmetric scales (`trtbuild quantize` writes those).")
    if q.per_token_activations and config.mapping.tp_size > 1:
        raise TrtbuildError("per-token activation scales need tp_size 1 (a row-parallel rank does not hold all the "
                            "input features a token's scale is taken over); re-quantize with --tp-size 1.")
    if q.quant_algo == QuantAlgo.INT4_AWQ:
        g = q.group_size or 128
        if g not in INT4_GROUP_SIZES:
            raise TrtbuildError(f"int4_awq group_size {g} cannot run on the {build.target} target (MatMulNBits "
                                f"takes block sizes {', '.join(map(str, INT4_GROUP_SIZES))}); re-quantize with "
                                "--awq-block-size 128.")
        bad = [n for n, k in (("hidden_size", config.hidden_size), ("intermediate_size", config.intermediate_size),
                              ("num_attention_heads * head_size", config.q_size)) if k % g]
        if bad:
            raise TrtbuildError(f"int4_awq group_size {g} does not divide the model's {', '.join(bad)}; re-quantize "
                                "with a group size that does.")


# Linears of a layer that read one tensor, and the scales `shared_input_scales: true` promises are equal among them.
SIBLINGS = (("attention.q", "attention.k", "attention.v"), ("mlp.gate", "mlp.fc"))
SHARED_SCALES = {QuantAlgo.FP8: ("activation_scaling_factor", "weights_scaling_factor"),
                 QuantAlgo.INT4_AWQ: ("prequant_scaling_factor",),
                 QuantAlgo.INT8_SQ: ("prequant_scaling_factor", "activation_scaling_factor")}


def check_shared_scales(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """With `shared_input_scales: true`, q/k/v and gate/up of every layer must carry identical input scales (and fp8
    weight scales): engines that trust the flag run them as one GEMM. Refuses a checkpoint that breaks the promise."""
    q = config.quantization
    if not q.shared_input_scales or q.quant_algo not in SHARED_SCALES:
        return
    for i in range(config.num_hidden_layers):
        for group in SIBLINGS:
            for scale in SHARED_SCALES[q.quant_algo]:
                names = [f"transformer.layers.{i}.{s}.{scale}" for s in group]
                present = [tensors[n] for n in names if n in tensors]
                if any(not torch.equal(present[0], t) for t in present[1:]):
                    raise TrtbuildError(f"the checkpoint sets shared_input_scales=true but {', '.join(names)} differ; "
                                        "it is inconsistent, re-run `trtbuild quantize`.")


def kv_cache_scales(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> np.ndarray | None:
    """[layers, 2] float32 (K scale, V scale) of a quantized KV cache, or None when it is full precision."""
    if not config.quantization.kv_cache_quant_algo:
        return None
    names = [f"transformer.layers.{i}.{KV_SCALE}" for i in range(config.num_hidden_layers)]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise TrtbuildError(f"the checkpoint sets kv_cache_quant_algo={config.quantization.kv_cache_quant_algo} but "
                            f"lacks {missing[0]}; re-run `trtbuild quantize`.")
    scales = np.stack([tensors[n].to(torch.float32).reshape(2).numpy() for n in names])
    if not np.all(np.isfinite(scales) & (scales > 0)):
        raise TrtbuildError("the checkpoint's kv_cache_scaling_factor values must be positive and finite.")
    return scales


def _fp8(t: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    return t.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


class QuantizedLinears:
    """Emits quantized linears into a GraphBuilder; activation Q/DQ and pre-scaling are shared by linears that read
    the same tensor with bit-identical scales (Q/K/V, gate/up of a `shared_input_scales` checkpoint, or fp8 q/k/v
    whose activation amax is naturally equal), so later passes see one quantized input per group. Linears with
    their own scales get their own Mul / Q/DQ, and the target lowering then keeps them as separate kernels."""

    def __init__(self, g: GraphBuilder, config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                 accuracy_level: int) -> None:
        self.g, self.config, self.quant, self.tensors = g, config, config.quantization, tensors
        self.accuracy_level = accuracy_level
        self._shared: dict[tuple, str] = {}
        check_shared_scales(config, tensors)

    def is_quantized(self, prefix: str) -> bool:
        algo = self.quant.algo_of(prefix)
        if not algo or prefix + ".weights_scaling_factor" not in self.tensors:
            return False
        name = prefix + ".weight"
        # NOTE: a lazily read checkpoint (SafetensorsFile) tells the dtype from its header, without reading the weight
        got = self.tensors.dtype(name) if hasattr(self.tensors, "dtype") else self.tensors[name].dtype
        want = WEIGHT_DTYPES[algo]
        if got != want:
            raise TrtbuildError(f"{prefix}.weight is {got} but its format {algo} stores {want}; the checkpoint "
                                "is inconsistent, re-run `trtbuild quantize`.")
        return True

    def _f32(self, name: str) -> np.ndarray:
        return self.tensors[name].to(torch.float32).numpy()

    def _once(self, key: tuple, make) -> str:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def _prescale(self, x: str, prefix: str) -> str:
        name = prefix + ".prequant_scaling_factor"
        if name not in self.tensors:
            return x
        s = self._f32(name).reshape(-1)
        return self._once(("prescale", x, s.tobytes()), lambda: self.g.op(
            "Mul", [x, self.g.weight(name, s)], name=prefix + "_prescale"))

    def _act_qdq(self, x: str, prefix: str, zero: np.ndarray) -> str:
        """DequantizeLinear(QuantizeLinear(x, s, zero), s, zero): the activation fake-quant with the static scale."""
        scale = self._f32(prefix + ".activation_scaling_factor").reshape(())

        def make() -> str:
            s, z = self.g.weight(prefix + ".activation_scaling_factor", scale), self.g.const(zero, "zero_point")
            xq = self.g.op("QuantizeLinear", [x, s, z], name=prefix + "_act_quant")
            return self.g.op("DequantizeLinear", [xq, s, z], name=prefix + "_act_dequant")

        return self._once(("act_qdq", x, zero.dtype.str, scale.tobytes()), make)

    def _act_per_token(self, x: str, prefix: str, features: int) -> str:
        """Blocked Q/DQ(int8) of x with one dynamic scale per token: max(max |x|, floor) / 127 over the last axis."""
        def make() -> str:
            g = self.g
            amax = g.op("ReduceMax", [g.op("Abs", [x], name=prefix + "_act_token_abs"),
                                      g.const(np.array([-1], dtype=np.int64), "axes")], keepdims=1,
                        name=prefix + "_act_token_amax")
            amax = g.op("Max", [amax, g.const(np.float32(PER_TOKEN_MIN_AMAX), "min_amax")],
                        name=prefix + "_act_token_floor")
            s = g.op("Div", [amax, g.const(np.float32(INT8_MAX), "int8_max")], name=prefix + "_act_token_scale")
            xq = g.op("QuantizeLinear", [x, s], name=prefix + "_act_quant", axis=-1, block_size=features,
                      output_dtype=TensorProto.INT8)
            return g.op("DequantizeLinear", [xq, s], name=prefix + "_act_dequant", axis=-1, block_size=features)

        return self._once(("act_per_token", x), make)

    def matmul(self, x: str, prefix: str, outputs: list[str] | None = None) -> str:
        """x @ dequant(W)^T for the quantized linear `prefix` in this checkpoint's format."""
        import ml_dtypes

        algo = self.quant.algo_of(prefix)
        if algo == QuantAlgo.WEIGHT_ONLY:
            in_features = expected_shape(prefix + ".weight", self.config)[1]
            return emit_nbits_matmul(self.g, x, prefix, self.tensors, in_features, self.accuracy_level, outputs)
        g, w = self.g, self.tensors[prefix + ".weight"]
        wscale = self._f32(prefix + ".weights_scaling_factor")
        if algo == QuantAlgo.FP8:
            x = self._act_qdq(x, prefix, np.array(0, dtype=ml_dtypes.float8_e4m3fn))
            weight = g.weight(prefix + ".weight", _fp8(w).T)  # [in, out], one byte per weight
            dq = g.op("DequantizeLinear", [weight, g.weight(prefix + ".weights_scaling_factor", wscale.reshape(()))],
                      name=prefix + "_weight_dequant")
        elif algo == QuantAlgo.INT4_AWQ:
            x = self._prescale(x, prefix)
            q = unpack_int4(w.numpy())  # [out, in]
            want = (q.shape[0], q.shape[1] // self.quant.weight_group_size)
            if wscale.shape != want:
                raise TrtbuildError(f"{prefix}.weights_scaling_factor has shape {list(wscale.shape)}; int4_awq with "
                                    f"group_size {self.quant.weight_group_size} needs {list(want)}.")
            weight = g.weight(prefix + ".weight", q.T.astype(ml_dtypes.int4))  # [in, out], packed 2 per byte
            dq = g.op("DequantizeLinear", [weight, g.weight(prefix + ".weights_scaling_factor", wscale.T)],
                      name=prefix + "_weight_dequant", axis=0, block_size=self.quant.weight_group_size)
        else:  # int8_sq: static per-tensor or dynamic per-token activation scales; int8_wo: weight-only
            if algo == QuantAlgo.INT8_SQ:
                x = self._prescale(x, prefix)
                x = (self._act_per_token(x, prefix, w.shape[1]) if self.quant.per_token_activations
                     else self._act_qdq(x, prefix, np.array(0, dtype=np.int8)))
            weight = g.weight(prefix + ".weight", w.numpy().T)  # int8 [in, out]
            dq = g.op("DequantizeLinear", [weight, g.weight(prefix + ".weights_scaling_factor", wscale.reshape(-1))],
                      name=prefix + "_weight_dequant", axis=1)
        return g.op("MatMul", [x, dq], name=prefix, outputs=outputs)
