"""`trtbuild quantize`: the quantized checkpoint format, its agreement with modelopt's calibrated simulation,
tensor-parallel sharding, the default calibration corpus, and bad input answered by a clear error."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import STORIES260K, make_random_hf_model, require_shared_models
from quant_helpers import compare_logits
from safetensors.torch import load_file

from trtbuild.builder.convert.checkpoint import expected_tensors, load_checkpoint
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.sharding import merge_shards
from trtbuild.cli import main
from trtbuild.configs import ModelConfig
from trtbuild.errors import ConfigError
from trtbuild.quantization import (
    FP8_E4M3_MAX,
    INT4_MAX,
    INT8_MAX,
    KVCacheQuantAlgo,
    QuantAlgo,
    pack_int4,
    pack_int4_torch,
    unpack_int4,
    unpack_int4_torch,
)
from trtbuild.quantize.formats import dequantize_weight
from trtbuild.quantize.options import QuantizeOptions
from trtbuild.quantize.quantize import quantize
from trtbuild.quantize.reference import (
    dequantize_checkpoint,
    reference_model,
    write_dequantized_checkpoint,
)

CALIB = dict(calib_size=8, calib_max_seq_len=64)
TINY = dict(hidden=64, inter=96, q=64, kv=32, layers=2, vocab=512)
LINEARS = {"attention.q": ("q", "hidden", "col"), "attention.k": ("kv", "hidden", "col"),
           "attention.v": ("kv", "hidden", "col"), "attention.dense": ("hidden", "q", "row"),
           "mlp.gate": ("inter", "hidden", "col"), "mlp.fc": ("inter", "hidden", "col"),
           "mlp.proj": ("hidden", "inter", "row")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A random 2-layer llama (hidden 64, GQA) with stories260K's tokenizer (vocab 512)."""
    require_shared_models()
    hf = make_random_hf_model("llama", tmp_path_factory.mktemp("tiny") / "hf", overrides={"vocab_size": 512})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, hf / name)
    return hf


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """factory(qformat, kv, model=tiny, **options) -> (QuantizeResult, checkpoint dir), cached."""
    cache: dict = {}

    def get(qformat: str, kv: str | None = None, model: Path | None = None, **options):
        model = model or tiny
        if qformat == "int4_awq":
            options.setdefault("awq_block_size", 32)
        key = (qformat, kv, str(model), json.dumps(options, sort_keys=True, default=str))
        if key not in cache:
            out = tmp_path_factory.mktemp("q") / "ckpt"
            cache[key] = (quantize(QuantizeOptions(model, out, qformat, kv_cache_qformat=kv, **CALIB, **options)), out)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def unquantized(tiny, tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("conv") / "ckpt"
    convert(tiny, out)
    return load_checkpoint(out)[1]


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


@pytest.mark.parametrize("model", ["tiny", "stories260K"])
def test_per_token_activations(model, runs, tiny):
    """int8_sq --per-token-activations: modelopt's dynamic per-token int8 input quantizers, no activation scale in
    the checkpoint, alpha 0.5 by default, and the checkpoint's reference model computes modelopt's simulation
    (tolerances of test_reference_logits_match_modelopt_simulation)."""
    path = tiny if model == "tiny" else STORIES260K
    result, ckpt = runs("int8_sq", "int8", model=path, per_token_activations=True)
    config, tensors = load_checkpoint(ckpt)
    q = config.quantization
    assert (q.per_token_activations, q.smoothquant_alpha, q.shared_input_scales) == (True, 0.5, False)
    assert not any(n.endswith("activation_scaling_factor") for n in tensors)
    assert set(tensors) == set(expected_tensors(config, range(config.num_hidden_layers), True, True))
    quantizer = result.model.get_submodule("model.layers.0.mlp.down_proj").input_quantizer
    assert quantizer.block_sizes == {-1: None} and quantizer.pre_quant_scale is not None and quantizer.amax is None
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    weights, full_max, full_mean = compare_logits(result, ckpt, path, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)
    static = runs("int8_sq", "int8", model=path, smoothquant_alpha=0.5)[0]
    with torch.no_grad():  # the same smoothing; per-token rounding is closer to fp32 than the static scale
        from trtbuild.quantize.source import build_torch_model, read_source

        fp32 = build_torch_model(read_source(path))(ids).logits
        err = [(m(ids).logits - fp32).abs().mean().item() for m in (result.model, static.model)]
    assert err[0] < err[1], err


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


@pytest.mark.parametrize("qformat", ["int4_awq", "int8_sq"])
def test_lm_head_int8_weight_only(qformat, runs, tiny, unquantized):
    """`--lm-head-qformat int8_wo`: lm_head (excluded from qformat) holds int8 weights with max |row| / 127 scales,
    modelopt's simulated model computes the same weight, and the checkpoint's reference model matches it."""
    result, ckpt = runs(qformat, "int8", lm_head_qformat="int8_wo")
    config, tensors = load_checkpoint(ckpt)
    q = config.quantization
    assert (q.quant_algo, q.lm_head_quant_algo, q.algo_of("lm_head")) == (qformat, "int8_wo", "int8_wo")
    assert "lm_head" in result.excluded and sorted(n for n in tensors if n.startswith("lm_head.")) == [
        "lm_head.weight", "lm_head.weights_scaling_factor"]
    w, scale = tensors["lm_head.weight"], tensors["lm_head.weights_scaling_factor"]
    fp32 = unquantized["lm_head.weight"].float()
    assert w.dtype == torch.int8 and w.shape == fp32.shape and scale.shape == (fp32.shape[0],)
    assert torch.equal(scale, fp32.abs().amax(dim=1) / 127)
    assert w.abs().amax(dim=1).eq(127).all()  # every row uses the whole grid
    dequantized = w.float() * scale[:, None]
    assert ((dequantized - fp32).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest
    assert torch.equal(result.model.lm_head.weight.detach(), dequantized)
    assert torch.equal(tensors["transformer.vocab_embedding.weight"], unquantized["transformer.vocab_embedding.weight"])
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    weights, full_max, full_mean = compare_logits(result, ckpt, tiny, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15


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


def test_default_corpus_is_real_text_and_deterministic():
    from trtbuild.quantize.calib import default_corpus

    docs = default_corpus()
    text = "\n\n".join(docs)
    assert len(docs) > 500 and len(text) > 50_000 and text.count(" the ") > 2_000
    code = ("import hashlib; from trtbuild.quantize.calib import default_corpus; "
            "print(hashlib.sha256('\\n\\n'.join(default_corpus()).encode()).hexdigest())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == hashlib.sha256(text.encode()).hexdigest()  # same after torch/transformers/modelopt imports


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, pattern: str) -> None:
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and pattern in errors[0], result.stderr


def test_cli_quantize_with_calibration_files(tiny, tmp_path):
    (tmp_path / "calib.jsonl").write_text("\n".join(json.dumps({"text": f"Sentence number {i} about cats."})
                                                   for i in range(50)))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("Once upon a time there was a cat. " * 40)
    for i, calib in enumerate([tmp_path / "calib.jsonl", tmp_path / "texts", tmp_path / "texts" / "a.txt"]):
        out = tmp_path / f"out{i}"
        result = invoke("quantize", "--model", tiny, "--output", out, "--qformat", "fp8", "--calib-dataset", calib,
                        "--calib-size", 4, "--calib-max-seq-len", 32)
        assert result.exit_code == 0, (result.output, result.exception)
        assert result.stdout.startswith(f"wrote {out}: fp8, per-linear input scales, KV cache float32, 14 linears "
                                        "quantized, 1 kept in float32, calibrated on 4 x 32 tokens")
        assert load_checkpoint(out)[0].quantization.quant_algo == "fp8"


@pytest.mark.parametrize(("options", "field", "problem"), [
    (dict(qformat="weight_only"), "qformat", "'weight_only' is not one of fp8, int4_awq, int8_sq."),
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


def test_cli_errors(tiny, runs, tmp_path):
    q = ("quantize", "--model", tiny, "--calib-size", 2, "--calib-max-seq-len", 16)
    out = tmp_path / "out"
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int3"), "'int3' is not one of")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 64),
                      "--awq-block-size 64 does not divide the 96 input features of transformer.layers.0.mlp.proj; "
                      "use 32, or exclude those linears.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 48),
                      "must be a power of two")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 64, "--exclude",
                             "lm_head", "--exclude", "*.mlp.proj", "--tp-size", 2),
                      "--tp-size 2 splits the 64 input features of attention.dense into 32 per rank")
    (tmp_path / "empty.txt").write_text(" \n")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "empty.txt"),
                      "has no text")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "bad.jsonl"),
                      'line 1 has no string field "text"')
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "missing.txt"),
                      "does not exist")
    for alpha in ("1.5", "-0.1", "nan"):
        assert_user_error(invoke(*q, "--output", out, "--qformat", "int8_sq", "--smoothquant-alpha", alpha),
                          "must be in [0, 1]")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--smoothquant-alpha", 0.5),
                      "--smoothquant-alpha applies to the int8_sq format only, not fp8.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 32,
                             "--per-token-activations"), "--per-token-activations applies to the int8_sq format only")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int8_sq", "--per-token-activations", "--tp-size", 2),
                      "--per-token-activations needs one tensor-parallel rank, not 2")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--lm-head-qformat", "int8_wo", "--exclude",
                             "transformer.layers.0.*"),
                      "--lm-head-qformat int8_wo gives lm_head its own format, but the exclude patterns "
                      "(transformer.layers.0.*) leave lm_head to the fp8 format; exclude lm_head too.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--lm-head-qformat", "int4"),
                      "'int4' is not 'int8_wo'")
    assert not out.exists()  # a failed run leaves nothing behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    assert_user_error(invoke(*q, "--output", tmp_path / "full", "--qformat", "fp8"), "exists and is not empty")
    assert (tmp_path / "full" / "x").read_text() == "mine"
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--exclude", "*"), "matches every linear")
    _, quantized = runs("fp8", None)
    assert_user_error(invoke("quantize", "--model", quantized, "--output", out, "--qformat", "fp8"),
                      "is already quantized (fp8)")
    assert not out.exists()


def test_quantize_help_imports_nothing_heavy():
    code = ("import sys; from click.testing import CliRunner; from trtbuild.cli import main; "
            "r = CliRunner().invoke(main, ['quantize', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'modelopt', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_in_bfloat16(family, runs, tmp_path):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms) with a bfloat16 checkpoint: unquantized tensors equal
    `convert --dtype bfloat16`, and the checkpoint computes modelopt's simulation."""
    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"vocab_size": 512})
    shutil.copy(STORIES260K / "tokenizer.json", hf / "tokenizer.json")
    result, ckpt = runs("int8_sq", "int8", model=hf, dtype="bfloat16")
    convert(hf, tmp_path / "bf16", dtype="bfloat16")
    plain = load_checkpoint(tmp_path / "bf16")[1]
    config, tensors = load_checkpoint(ckpt)
    assert config.dtype == "bfloat16" and tensors["transformer.layers.0.attention.q.weight"].dtype == torch.int8
    for name in ("transformer.vocab_embedding.weight", "lm_head.weight", "transformer.layers.1.post_layernorm.weight",
                 "transformer.layers.0.attention.q.bias" if family == "qwen2" else
                 "transformer.layers.0.attention.k_norm.weight"):
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], plain[name]), name
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    weights, full_max, full_mean = compare_logits(result, ckpt, hf, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)


@pytest.mark.parametrize(("family", "qformat", "kv"), [
    ("phi3_longrope", "int4_awq", "int8"), ("phi3_partial", "int4_awq", "int8"), ("phi3_partial", "fp8", "fp8")])
def test_phi3_quantizes_through_its_mistral_form(family, qformat, kv, runs, tmp_path):
    """Phi-3 (fused q/k/v and gate/up, LongRoPE, a sliding window) and Phi-4-mini (partial rotary embeddings): the
    quantizer's torch model is the Mistral model of its split weights (Phi-4-mini's: q / k rows in the engine's
    order, on the engine's RoPE), which computes the HF model's logits; the checkpoint computes modelopt's
    simulation."""
    import transformers

    from trtbuild.quantize.source import build_torch_model, read_source

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    hf = make_random_hf_model(family, tmp_path / "hf", overrides={"vocab_size": 512, "sliding_window": 12})
    shutil.copy(STORIES260K / "tokenizer.json", hf / "tokenizer.json")
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
        mistral = build_torch_model(read_source(hf))
        assert type(mistral).__name__ == "MistralForCausalLM"
        assert ((mistral(ids).logits - want).abs().max() / want.abs().max()).item() <= 1e-5
    # the int8 KV cache's reference attention keeps the window (it came 3.3x the quantization error off without it)
    result, ckpt = runs(qformat, kv, model=hf)
    config, tensors = load_checkpoint(ckpt)
    assert config.family == "phi3"
    assert (config.rotary_scaling or {}).get("rope_type") == ("longrope" if family == "phi3_longrope" else None)
    assert config.rotary_dim == (8 if family == "phi3_partial" else None)
    assert tensors["transformer.layers.0.attention.k.weight"].dtype == {"int4_awq": torch.uint8,  # int4 pairs
                                                                        "fp8": torch.float8_e4m3fn}[qformat]
    weights, full_max, full_mean = compare_logits(result, ckpt, hf, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)


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


def test_awq_block_size_defaults_to_the_largest_that_divides_every_linear(runs, caplog):
    """The tiny model's linears read 64 (hidden) and 96 (ffn) features: 128 and 64 do not divide 96, 32 does."""
    with caplog.at_level("WARNING"):
        result, ckpt = runs("int4_awq", awq_block_size=None)
    assert result.config.quantization.group_size == 32
    assert load_checkpoint(ckpt)[0].quantization.group_size == 32
    assert "int4_awq block size 32: the largest of 128/64/32 dividing the input features of every quantized linear " \
           "(64, 96)" in caplog.text
