"""QuantizeOptions and the checkpoint's QuantConfig: bad settings refused on creation, the quant config they give."""

from __future__ import annotations

import pytest

from trtbuild.errors import ConfigError
from trtbuild.quantization import KVCacheQuantAlgo, QuantAlgo
from trtbuild.quantize.options import QuantizeOptions


@pytest.mark.parametrize(("options", "field", "problem"), [
    (dict(qformat="weight_only"), "qformat", "'weight_only' is not one of fp8, int4_awq, int8_sq, full_prec."),
    (dict(qformat="full_prec"), "qformat", "full_prec keeps the weights as they are, so it needs a KV cache format"),
    (dict(qformat="full_prec", kv_cache_qformat="int8", lm_head_qformat="int8_wo"), "lm_head_qformat",
     "the full_prec format keeps every linear as it is"),
    (dict(kv_cache_qformat="float16"), "kv_cache_qformat", "'float16' is not one of fp8, int8."),
    (dict(qformat="int4_awq", awq_block_size=48), "awq_block_size", "48 must be a power of two from 16 to 256"),
    (dict(lm_head_qformat="int4"), "lm_head_qformat", "'int4' is not one of int8_wo."),
    (dict(lm_head_qformat="int8_wo", exclude=()), "lm_head_qformat", "exclude patterns (none) leave lm_head"),
    (dict(per_token_activations=True), "per_token_activations", "applies to the int8_sq format only, not fp8."),
    (dict(smoothquant_alpha=0.5), "smoothquant_alpha", "applies to the int8_sq format only, not fp8."),
    (dict(qformat="int8_sq", smoothquant_alpha=1.5), "smoothquant_alpha", "1.5 must be in [0, 1]"),
    (dict(calib_size=0), "calib_size", "must be at least 1, got 0."),
    (dict(calib_max_seq_len=0), "calib_max_seq_len", "must be at least 1, got 0."),
    (dict(awq_grid=5), "awq_grid", "applies to the int4_awq format only, not fp8."),
    (dict(qformat="int4_awq", awq_grid=1), "awq_grid", "1 must be at least 2"),
    (dict(qformat="int8_sq", per_token_activations=True, tp_size=2), "per_token_activations",
     "needs one tensor-parallel rank, not 2"),
])
def test_quantize_options_are_checked_on_creation(options, field, problem):
    """QuantizeOptions refuses bad options at once, as ConfigError naming the field (front ends spell it): the problem
    names no command-line flag."""
    with pytest.raises(ConfigError) as error:
        QuantizeOptions(**{"model": "m", "output": "o", "qformat": "fp8", **options})
    assert error.value.field == field and problem in error.value.problem and "--" not in error.value.problem


def test_full_precision_quantizes_the_kv_cache_only():
    q = QuantizeOptions("m", "o", "full_prec", kv_cache_qformat="int8", exclude=("lm_head",)).quant_config()
    assert (q.quant_algo, q.kv_cache_quant_algo, q.exclude_modules, q.pre_quant_scale) == (None, "int8", (), False)


def test_quantize_options_quant_config():
    """The checkpoint config of the options: int8_sq's default alpha, int4_awq's group size, plain-string formats."""
    q = QuantizeOptions("m", "o", QuantAlgo.INT8_SQ, kv_cache_qformat=KVCacheQuantAlgo.INT8,
                        per_token_activations=True).quant_config()
    assert (q.quant_algo, q.kv_cache_quant_algo, q.smoothquant_alpha, q.pre_quant_scale) == ("int8_sq", "int8", 0.5,
                                                                                              True)
    assert type(q.quant_algo) is str and type(q.kv_cache_quant_algo) is str
    q = QuantizeOptions("m", "o", "int4_awq", awq_block_size=64, exclude=["lm_head"], lm_head_qformat="int8_wo",
                        smoothquant_alpha=None).quant_config()
    assert (q.group_size, q.exclude_modules, q.lm_head_quant_algo, q.smoothquant_alpha) == (64, ("lm_head",),
                                                                                            "int8_wo", None)


def test_quant_config_validation():
    from trtbuild.configs import QuantConfig
    from trtbuild.errors import CheckpointError

    q = QuantConfig("int4_awq", "int8", 64, False, True, ("lm_head", "transformer.layers.0.*"))
    assert q.is_excluded("lm_head") and q.is_excluded("transformer.layers.0.mlp.fc")
    assert not q.is_excluded("transformer.layers.10.mlp.fc")
    assert q.scale_names("transformer.layers.1.mlp.fc") == ("transformer.layers.1.mlp.fc.weights_scaling_factor",
                                                             "transformer.layers.1.mlp.fc.prequant_scaling_factor")
    for bad in (dict(quant_algo="int3"), dict(quant_algo="fp8", kv_cache_quant_algo="int4"),
                dict(quant_algo="int4_awq", pre_quant_scale=True, group_size=0),
                dict(quant_algo="fp8", group_size=128), dict(quant_algo="int8_sq", pre_quant_scale=False),
                dict(quant_algo="fp8", has_zero_point=True), dict(shared_input_scales=True),
                dict(quant_algo="fp8", shared_input_scales="yes"), dict(quant_algo="fp8", smoothquant_alpha=0.5),
                dict(quant_algo="int8_sq", pre_quant_scale=True, smoothquant_alpha=1.5),
                dict(quant_algo="int8_sq", pre_quant_scale=True, smoothquant_alpha=True),
                dict(quant_algo="fp8", per_token_activations=True), dict(lm_head_quant_algo="int4_awq"),
                dict(quant_algo="fp8", lm_head_quant_algo="int8_wo")):  # lm_head left to fp8 too
        with pytest.raises(CheckpointError, match="checkpoint quantization config"):
            QuantConfig(**bad)
    # config.json written before these fields existed still loads (per-linear scales, alpha unrecorded)
    doc = {"quant_algo": "int8_sq", "pre_quant_scale": True, "exclude_modules": ["lm_head"]}
    q = QuantConfig(**doc)
    assert q.shared_input_scales is False and q.smoothquant_alpha is None and q.per_token_activations is False
    q = QuantConfig("int8_sq", pre_quant_scale=True, per_token_activations=True)
    assert q.scale_names("lm_head") == ("lm_head.weights_scaling_factor", "lm_head.prequant_scaling_factor")
    assert QuantConfig("int8_sq", pre_quant_scale=True, smoothquant_alpha=0).smoothquant_alpha == 0
    q = QuantConfig("int8_sq", pre_quant_scale=True, per_token_activations=True, exclude_modules=("lm_head",),
                    lm_head_quant_algo="int8_wo")
    assert q.algo_of("lm_head") == "int8_wo" and q.algo_of("transformer.layers.0.mlp.fc") == "int8_sq"
    assert q.scale_names("lm_head") == ("lm_head.weights_scaling_factor",)
    assert QuantConfig(lm_head_quant_algo="int8_wo").scale_names("lm_head") == ("lm_head.weights_scaling_factor",)
