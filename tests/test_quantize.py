"""`trtbuild quantize`: the checkpoint format and its agreement with modelopt's calibration and simulated model.

Also: excluded linears, tensor-parallel shards, the sources it reads, dequantized checkpoints, int4 packing.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from helpers import STORIES260K
from quant_helpers import compare_logits
from safetensors.torch import load_file

from trtbuild.builder.convert.checkpoint import expected_tensors, load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.sharding import merge_shards
from trtbuild.configs import ModelConfig
from trtbuild.quantization import (
    FP8_E4M3_MAX,
    INT4_MAX,
    INT8_MAX,
    pack_int4,
    pack_int4_torch,
    unpack_int4,
    unpack_int4_torch,
)
from trtbuild.quantize.formats import dequantize_weight
from trtbuild.quantize.reference import dequantize_checkpoint, reference_model, write_dequantized_checkpoint

TINY = dict(hidden=64, inter=96, q=64, kv=32, layers=2, vocab=512)
LINEARS = {"attention.q": ("q", "hidden", "col"), "attention.k": ("kv", "hidden", "col"),
           "attention.v": ("kv", "hidden", "col"), "attention.dense": ("hidden", "q", "row"),
           "mlp.gate": ("inter", "hidden", "col"), "mlp.fc": ("inter", "hidden", "col"),
           "mlp.proj": ("hidden", "inter", "row")}


def spec(qformat: str, prefix: str, group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The format of docs/quantization.md, written out independently of the exporter."""
    out_dim, in_dim, _ = LINEARS[prefix.split(".", 3)[-1]]
    n_out, n_in = TINY[out_dim], TINY[in_dim]
    f32 = torch.float32
    if qformat == "fp8":
        return {"weight": (torch.float8_e4m3fn, (n_out, n_in)), "weights_scaling_factor": (f32, ()),
                "activation_scaling_factor": (f32, ())}
    if qformat == "int4_awq":
        return {"weight": (torch.uint8, (n_out, n_in // 2)), "weights_scaling_factor": (f32, (n_out, n_in // group)),
                "prequant_scaling_factor": (f32, (n_in,))}
    return {"weight": (torch.int8, (n_out, n_in)), "weights_scaling_factor": (f32, (n_out,)),
            "activation_scaling_factor": (f32, ()), "prequant_scaling_factor": (f32, (n_in,))}


FORMATS = [("fp8", None), ("fp8", "fp8"), ("int4_awq", None), ("int4_awq", "int8"), ("int8_sq", "int8"),
           ("int8_sq", "fp8")]


@pytest.mark.parametrize(("qformat", "kv"), FORMATS)
def test_checkpoint_tensors_dtypes_shapes_and_config(qformat, kv, runs, unquantized):
    result, ckpt = runs(qformat, kv)
    config, tensors = load_checkpoint(ckpt)
    q = config.quantization
    assert (q.quant_algo, q.kv_cache_quant_algo, q.exclude_modules, q.has_zero_point) == (qformat, kv, ("lm_head",),
                                                                                          False)
    assert q.group_size == (32 if qformat == "int4_awq" else None)
    assert q.pre_quant_scale == (qformat != "fp8")
    doc = json.loads((ckpt / "config.json").read_text())
    assert ModelConfig.from_dict(doc).to_dict() == doc == config.to_dict()
    want: dict[str, tuple] = {}
    for layer in range(TINY["layers"]):
        for suffix in LINEARS:
            prefix = f"transformer.layers.{layer}.{suffix}"
            want.update({f"{prefix}.{k}": v for k, v in spec(qformat, prefix, 32).items()})
        if kv:
            want[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"] = (torch.float32, (2,))
    for name, t in unquantized.items():  # everything else: bit-equal to `trtbuild convert` (lm_head excluded)
        want.setdefault(name, (t.dtype, tuple(t.shape)))
        if not name.endswith(tuple(f"{s}.weight" for s in LINEARS)):
            assert torch.equal(tensors[name], t), name
    assert {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} == want
    assert set(tensors) == set(expected_tensors(config, range(2), True, True))
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "generation_config.json", "rank0.safetensors",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert len(result.quantized) == 14 and result.excluded == ["lm_head"]


@pytest.mark.parametrize(("qformat", "kv"), FORMATS)
def test_checkpoint_is_modelopts_calibration(qformat, kv, runs):
    """Each tensor is the calibrated quantizer's state: dequantized weights equal modelopt's fake-quantized weights,
    prequant equals pre_quant_scale, activation / KV scales equal amax / bound."""
    result, ckpt = runs(qformat, kv)
    tensors = load_file(ckpt / "rank0.safetensors")
    model = result.model
    bound = FP8_E4M3_MAX if qformat == "fp8" else INT8_MAX
    for layer in range(TINY["layers"]):
        for suffix, hf in (("attention.q", "self_attn.q_proj"), ("attention.dense", "self_attn.o_proj"),
                           ("mlp.fc", "mlp.up_proj"), ("mlp.proj", "mlp.down_proj")):
            p, module = f"transformer.layers.{layer}.{suffix}", model.get_submodule(f"model.layers.{layer}.{hf}")
            with torch.no_grad():
                simulated = module.weight_quantizer(module.weight).float()
            ours = dequantize_weight(qformat, tensors[f"{p}.weight"], tensors[f"{p}.weights_scaling_factor"], 32)
            torch.testing.assert_close(ours, simulated, rtol=1e-6, atol=1e-9)
            if qformat != "fp8":
                assert torch.equal(tensors[f"{p}.prequant_scaling_factor"], module.input_quantizer.pre_quant_scale)
            if qformat != "int4_awq":
                torch.testing.assert_close(tensors[f"{p}.activation_scaling_factor"],
                                           module.input_quantizer.amax.reshape(()) / bound, rtol=1e-6, atol=0)
        if kv:
            attn = model.get_submodule(f"model.layers.{layer}.self_attn")
            amax = torch.stack([attn.k_bmm_quantizer.amax.reshape(()), attn.v_bmm_quantizer.amax.reshape(())])
            scale = tensors[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]
            torch.testing.assert_close(scale, amax / (FP8_E4M3_MAX if kv == "fp8" else INT8_MAX), rtol=1e-6, atol=0)


SIBLINGS = {"qkv": [f"attention.{x}" for x in "qkv"], "gate_up": ["mlp.gate", "mlp.fc"]}


def sibling_scales(tensors: dict[str, torch.Tensor], scale: str, layer: int = 0) -> list[list[torch.Tensor]]:
    return [[tensors[f"transformer.layers.{layer}.{s}.{scale}"] for s in group] for group in SIBLINGS.values()]


def all_equal(ts: list[torch.Tensor]) -> bool:
    return all(torch.equal(t, ts[0]) for t in ts[1:])


@pytest.mark.parametrize("qformat", ["fp8", "int4_awq", "int8_sq"])
def test_per_linear_scales_by_default_shared_on_request(qformat, runs):
    """By default each linear keeps its own calibrated scales (AWQ / SmoothQuant pre-quant scales, fp8 weight amax);
    `shared_input_scales=True` (`--fuse-shared-scales`) makes q/k/v and gate/up share them, and config.json says
    which. Both are exactly modelopt's model (test_checkpoint_is_modelopts_calibration covers the default)."""
    own_scale = {"fp8": "weights_scaling_factor", "int4_awq": "prequant_scaling_factor",
                 "int8_sq": "prequant_scaling_factor"}[qformat]
    shared_scales = {"fp8": ("weights_scaling_factor", "activation_scaling_factor"),
                     "int4_awq": ("prequant_scaling_factor",),
                     "int8_sq": ("prequant_scaling_factor", "activation_scaling_factor")}[qformat]
    # alpha 0.5: with alpha 1 SmoothQuant's pre-quant scale depends on the input alone
    options = {"smoothquant_alpha": 0.5} if qformat == "int8_sq" else {}
    for shared in (False, True):
        _, ckpt = runs(qformat, None, shared_input_scales=shared, **options)
        config, tensors = load_checkpoint(ckpt)
        assert config.quantization.shared_input_scales is shared
        assert json.loads((ckpt / "config.json").read_text())["quantization"]["shared_input_scales"] is shared
        for layer in range(TINY["layers"]):
            groups = sibling_scales(tensors, own_scale, layer)
            if shared:
                for scale in shared_scales:
                    assert all(all_equal(g) for g in sibling_scales(tensors, scale, layer)), (scale, layer)
            else:
                assert not any(all_equal(g) for g in groups), layer  # every sibling has its own
    if qformat == "fp8":  # q/k/v read one tensor: their activation amax is the same without any sharing step
        _, tensors = load_checkpoint(runs(qformat, None)[1])
        assert all(all_equal(g) for g in sibling_scales(tensors, "activation_scaling_factor"))


def test_smoothquant_alpha_reaches_modelopt_and_config(runs):
    """alpha = 1 divides every input channel by its calibrated amax (so x * prequant has amax 1: activation scale
    1/127 for every linear); alpha = 0.5 migrates half; config.json records the value, also the default one."""
    from trtbuild.quantize.options import DEFAULT_SMOOTHQUANT_ALPHA

    result, ckpt = runs("int8_sq", None, smoothquant_alpha=1.0)
    config, tensors = load_checkpoint(ckpt)
    assert config.quantization.smoothquant_alpha == 1.0
    for prefix in result.quantized:
        torch.testing.assert_close(tensors[f"{prefix}.activation_scaling_factor"], torch.tensor(1 / 127),
                                   rtol=1e-5, atol=0)
    # alpha = 1: the pre-quant scale depends on the input only, so siblings agree without a sharing step
    assert all(all_equal(g) for g in sibling_scales(tensors, "prequant_scaling_factor"))
    half_config, half = load_checkpoint(runs("int8_sq", None, smoothquant_alpha=0.5)[1])
    assert half_config.quantization.smoothquant_alpha == 0.5
    assert not torch.equal(half["transformer.layers.0.mlp.proj.prequant_scaling_factor"],
                           tensors["transformer.layers.0.mlp.proj.prequant_scaling_factor"])
    assert load_checkpoint(runs("fp8", None)[1])[0].quantization.smoothquant_alpha is None
    default = load_checkpoint(runs("int8_sq", "int8")[1])[0].quantization
    assert default.smoothquant_alpha == DEFAULT_SMOOTHQUANT_ALPHA[False] == 0.7


# stories260K's mlp.proj has 172 inputs: no int4 group fits. Its lm_head (tied to the embedding) is quantized here.
STORIES_FORMATS = [("fp8", "fp8", {}), ("int4_awq", "int8", {"exclude": ["transformer.layers.*.mlp.proj"]}),
                   ("int8_sq", "int8", {})]


@pytest.mark.parametrize("model", ["tiny", "stories260K"])
def test_reference_logits_match_modelopt_simulation(model, runs, tiny):
    """Logits of a torch model built from the checkpoint alone (dequantized weights, prequant, activation and KV fake
    quantization as the format says) against modelopt's simulated-quantization model.

    Tolerances: with activation / KV quantization off on both sides, max |diff| <= 1e-4 * max |logits| (only float
    rounding differs). With it on, x / scale (the format) and modelopt's x * (bound / amax) can round an activation
    to the neighbouring integer, which later layers amplify; the diff then stays below 30% of the quantization
    error (max) and 15% (mean) - measured at most 11% / 7% on stories260K, 0.5% on the random model.
    """
    path = tiny if model == "tiny" else STORIES260K
    formats = [(f, kv, {}) for f, kv in FORMATS] if model == "tiny" else STORIES_FORMATS
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    for qformat, kv, options in formats:
        result, ckpt = runs(qformat, kv, model=path, **options)
        weights, full_max, full_mean = compare_logits(result, ckpt, path, ids)
        assert weights <= 1e-4, (qformat, kv, weights)
        assert full_max <= 0.3 and full_mean <= 0.15, (qformat, kv, full_max, full_mean)


def test_excluded_modules_stay_unquantized(runs, tiny, unquantized, caplog):
    exclude = ["lm_head", "transformer.layers.0.*", "transformer.layers.1.mlp.gate", "no.such.module"]
    with caplog.at_level(logging.WARNING):
        result, ckpt = runs("int8_sq", None, exclude=exclude)
    assert "'no.such.module' matches no linear" in caplog.text
    config, tensors = load_checkpoint(ckpt)
    assert config.quantization.exclude_modules == tuple(exclude)
    excluded = [f"transformer.layers.0.{s}" for s in LINEARS] + ["transformer.layers.1.mlp.gate", "lm_head"]
    assert sorted(result.excluded) == sorted(excluded) and len(result.quantized) == 6
    for prefix in excluded:
        assert torch.equal(tensors[f"{prefix}.weight"], unquantized[f"{prefix}.weight"]), prefix
        assert not [n for n in tensors if n.startswith(f"{prefix}.") and n.endswith("_factor")], prefix
    assert tensors["transformer.layers.1.mlp.fc.weight"].dtype == torch.int8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize(("qformat", "kv", "options"), [("int4_awq", "int8", {"awq_block_size": 16}),
                                                        ("int8_sq", "fp8", {}), ("fp8", "int8", {})])
def test_tp2_shards_merge_to_tp1(qformat, kv, options, runs):
    _, tp1 = runs(qformat, kv, **options)
    _, tp2 = runs(qformat, kv, tp_size=2, **options)
    config, whole = load_checkpoint(tp1)
    config2, rank0 = load_checkpoint(tp2, 0)
    assert config2.mapping.tp_size == 2 and config2.quantization == config.quantization
    merged = merge_shards([rank0, load_checkpoint(tp2, 1)[1]], config2, config2.mapping)
    assert set(merged) == set(whole)
    for name, t in whole.items():
        assert merged[name].dtype == t.dtype and torch.equal(bits(merged[name]), bits(t)), name
    # the split axes of docs/quantization.md
    dense, q = "transformer.layers.0.attention.dense", "transformer.layers.0.attention.q"
    assert rank0[f"{q}.weight"].shape[0] == whole[f"{q}.weight"].shape[0] // 2
    assert rank0[f"{dense}.weight"].shape[1] == whole[f"{dense}.weight"].shape[1] // 2
    if qformat != "fp8":
        assert torch.equal(rank0[f"{q}.prequant_scaling_factor"], whole[f"{q}.prequant_scaling_factor"])
        assert rank0[f"{dense}.prequant_scaling_factor"].shape[0] == TINY["q"] // 2
    if qformat == "int8_sq":
        assert torch.equal(rank0[f"{dense}.weights_scaling_factor"], whole[f"{dense}.weights_scaling_factor"])
        assert rank0[f"{q}.weights_scaling_factor"].shape[0] == TINY["q"] // 2
    for name in rank0:
        if name.endswith(("activation_scaling_factor", "kv_cache_scaling_factor")):
            assert torch.equal(rank0[name], whole[name])


def test_sources_hf_gguf_and_checkpoint_agree(runs, tiny, tmp_path):
    """A trtbuild checkpoint as input quantizes exactly like its HF source; stories260K's GGUF like its HF folder."""
    convert(tiny, tmp_path / "ckpt")
    from_hf = load_file(runs("fp8", "fp8")[1] / "rank0.safetensors")
    from_ckpt = load_file(runs("fp8", "fp8", model=tmp_path / "ckpt")[1] / "rank0.safetensors")
    assert from_hf.keys() == from_ckpt.keys()
    assert all(torch.equal(bits(from_hf[n]), bits(from_ckpt[n])) for n in from_hf)
    _, gguf_ckpt = runs("int8_sq", None, model=STORIES260K / "stories260K-f32.gguf")
    config, tensors = load_checkpoint(gguf_ckpt)
    assert config.quantization.quant_algo == "int8_sq" and (gguf_ckpt / "tokenizer.json").is_file()
    assert tensors["transformer.layers.4.mlp.proj.weight"].dtype == torch.int8


def test_dequantized_checkpoint_for_fp32_engines(runs, tmp_path):
    """write_dequantized_checkpoint folds prequant into the weights: for int4_awq (weight-only) the plain fp32 model
    it describes computes the quantized model's logits."""
    result, ckpt = runs("int4_awq", None)
    config = write_dequantized_checkpoint(ckpt, tmp_path / "fp32")
    plain, tensors = load_checkpoint(tmp_path / "fp32")
    assert plain.quantization.quant_algo is None and tensors["transformer.layers.0.attention.q.weight"].shape == (
        TINY["q"], TINY["hidden"]) and config == plain
    deq = dequantize_checkpoint(ckpt)
    assert deq["transformer.layers.1.mlp.proj.weight"].dtype == torch.float32
    assert "transformer.layers.1.mlp.proj.prequant_scaling_factor" in deq
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = reference_model(tmp_path / "fp32")(ids).logits
        sim = result.model(ids).logits
    assert ((ref - sim).abs().max() / sim.abs().max()).item() <= 1e-4


def test_int4_packing_is_matmulnbits_layout():
    """The torch and the numpy int4 packing: q + 8, even index in the low nibble, and each other's bytes."""
    q = torch.tensor([[-8, 7, 0, -1, 3, -3]])
    packed = pack_int4_torch(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF0, 0x78, 0x5B]]  # even index in the low nibble
    assert torch.equal(unpack_int4_torch(packed), q.to(torch.int8))
    np_packed = pack_int4(q.numpy().astype(np.int8))
    assert np_packed.dtype == np.uint8 and np_packed.tolist() == [[0xF0, 0x78, 0x5B]]
    assert unpack_int4(np_packed).dtype == np.int8 and unpack_int4(np_packed).tolist() == q.tolist()
    every = np.arange(-8, 8, dtype=np.int8).repeat(16).reshape(16, 16)  # every pair of nibbles, both orders
    every = np.concatenate([every, every.T], axis=1)
    np.testing.assert_array_equal(pack_int4(every), pack_int4_torch(torch.from_numpy(every)).numpy())
    np.testing.assert_array_equal(unpack_int4(pack_int4(every)), every)
    with pytest.raises(ValueError, match="even number"):
        pack_int4(np.zeros((1, 3), dtype=np.int8))
    w = dequantize_weight("int4_awq", pack_int4_torch(torch.full((2, 4), 7)), torch.tensor([[0.5, 2.0], [1.0, 1.0]]),
                          2)
    assert w.tolist() == [[3.5, 3.5, 14.0, 14.0], [7.0, 7.0, 7.0, 7.0]] and INT4_MAX == 7
