"""Calibration layer by layer (`quantize/layerwise.py`) and the AWQ search from input statistics (`quantize/awq.py`):
the same calibrated model as modelopt's own whole-model calibration, progress once per decoder layer, and the
`--awq-grid` option."""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import STORIES260K, make_random_hf_model, require_shared_models

from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.cli import main
from trtbuild.quantize import awq as awq_module
from trtbuild.quantize import calibrate as calibrate_module
from trtbuild.quantize.awq import AWQLayerCalibrator, alpha_grid, search_linear
from trtbuild.quantize.calibrate import calibrate, import_mtq, mtq_config
from trtbuild.quantize.layerwise import calibrate_layerwise
from trtbuild.quantize.options import QuantizeOptions
from trtbuild.quantize.quantize import quantize

LAYERS = 3


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A random 3-layer llama (hidden 64, GQA) with stories260K's tokenizer (vocab 512)."""
    require_shared_models()
    hf = make_random_hf_model("llama", tmp_path_factory.mktemp("tiny") / "hf",
                              overrides={"vocab_size": 512, "num_hidden_layers": LAYERS})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES260K / name, hf / name)
    return hf


@pytest.fixture(scope="module")
def tiny_model(tiny_hf) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()


def samples(n: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 512, (n, seq), generator=torch.Generator().manual_seed(n * 1000 + seq))


def modelopt_calibrated(model: torch.nn.Module, config: dict, ids: torch.Tensor, batch: int) -> torch.nn.Module:
    """modelopt's own calibration: one forward loop over the whole model."""
    mtq = import_mtq()

    def loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for b in ids.split(batch):
                m.model(input_ids=b, use_cache=False)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(model, config, loop)


def quantizer_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight, amax and pre-quant scale of the calibrated model."""
    out = {}
    for name, module in model.named_modules():
        for attr in ("_amax", "_pre_quant_scale"):
            if isinstance(getattr(module, attr, None), torch.Tensor):
                out[f"{name}.{attr}"] = getattr(module, attr)
        if isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            out[f"{name}.weight"] = module.weight
    return out


def assert_same_state(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    a, b = quantizer_state(ours), quantizer_state(theirs)
    assert a.keys() == b.keys()
    assert any(k.endswith("_amax") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("qformat,kv", [("fp8", None), ("int8_sq", "int8"), ("int8_sq", None)])
def test_layerwise_equals_whole_model_calibration(tiny_model, qformat, kv):
    """Each layer calibrated alone, on the activations captured in front of it, ends bit-equal to modelopt's
    calibration of the whole model (weights, pre-quant scales, weight / activation / KV amaxes)."""
    config = mtq_config(qformat, kv, 32, [], False, 0.7 if qformat == "int8_sq" else None)
    ids = samples(5, 24)
    ours = calibrate(copy.deepcopy(tiny_model), config, ids, 2, call_lm_head=False)
    assert_same_state(ours, modelopt_calibrated(copy.deepcopy(tiny_model), config, ids, 2))


@pytest.mark.parametrize("n,seq,kv", [(5, 24, None), (2, 8, None), (5, 24, "int8")])
def test_awq_search_is_modelopts_awq_lite(tiny_model, n, seq, kv):
    """Every grid point's loss equals modelopt awq_lite's (which runs each linear once per point), the same alpha
    wins everywhere, and the model ends bit-equal to modelopt's (batches of unequal size: 2, 2, 1). 120 tokens
    keep second moments, 16 (fewer than a linear's inputs) the scaled rows; an int8 KV cache, which quantizes in
    modelopt's search pass, takes a second stream of activations."""
    config = mtq_config("int4_awq", kv, 32, [], False)
    ids = samples(n, seq)
    awq = AWQLayerCalibrator(alpha_grid(), search_stream=kv is not None)
    ours = copy.deepcopy(tiny_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_mtq().quantize(ours, {**config, "algorithm": None})
    calibrate_layerwise(ours, list(ids.split(2)), awq)
    theirs = modelopt_calibrated(copy.deepcopy(tiny_model), {
        **config, "algorithm": {**config["algorithm"], "debug": True}}, ids, 2)
    names = {m: name for name, m in ours.named_modules()}
    assert len(awq.losses) == 7 * LAYERS
    for module, losses in awq.losses.items():
        reference = {a: float(v) for a, v in theirs.get_submodule(names[module]).awq_lite.loss.items()}
        assert list(losses) == list(reference) == alpha_grid()
        for alpha, loss in losses.items():
            assert loss == pytest.approx(reference[alpha], rel=1e-4), (names[module], alpha)
        assert min(losses, key=losses.get) == min(reference, key=reference.get), names[module]
    for m in theirs.modules():  # debug mode kept modelopt's search state on the modules
        if hasattr(m, "awq_lite"):
            del m.awq_lite
    assert_same_state(ours, theirs)
    assert_same_state(calibrate(copy.deepcopy(tiny_model), config, ids, 2, call_lm_head=False), theirs)


def test_progress_once_per_decoder_layer(tiny_model, monkeypatch):
    """The progress callback, and the default progress bar, advance once per decoder layer (for every algorithm)."""
    for qformat in ("int4_awq", "int8_sq"):
        calls = []
        calibrate(copy.deepcopy(tiny_model), mtq_config(qformat, None, 32, [], False, 0.7), samples(4, 16), 2,
                  call_lm_head=False, progress=lambda done, total, calls=calls: calls.append((done, total)))
        assert calls == [(i + 1, LAYERS) for i in range(LAYERS)]

    bars = []

    class Bar:
        def __init__(self, total: int, **kwargs) -> None:
            self.total, self.n, self.updates = total, 0, []
            bars.append(self)

        def update(self, k: int) -> None:
            self.n += k
            self.updates.append(k)

        def close(self) -> None:
            pass

    monkeypatch.setattr(calibrate_module, "tqdm", Bar)
    calibrate(copy.deepcopy(tiny_model), mtq_config("int4_awq", None, 32, [], False), samples(4, 16), 2,
              call_lm_head=False)
    assert [(b.total, b.updates) for b in bars] == [(LAYERS, [1] * LAYERS)]


def test_quantized_lm_head_is_calibrated_after_the_layers(tiny_model):
    config = mtq_config("int8_sq", None, 32, [], quantize_lm_head=True, smoothquant_alpha=0.7)
    ids = samples(4, 16)
    ours = calibrate(copy.deepcopy(tiny_model), config, ids, 2, call_lm_head=True)
    theirs = copy.deepcopy(tiny_model)
    mtq = import_mtq()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = mtq.quantize(theirs, config, lambda m: [m(input_ids=b, use_cache=False) for b in ids.split(2)])
    assert ours.lm_head.input_quantizer.pre_quant_scale is not None
    assert_same_state(ours, theirs)


def test_alpha_grid():
    assert alpha_grid() == [k.item() for k in torch.arange(0, 1.1, 0.1)]  # modelopt's alpha_step 0.1
    assert alpha_grid(3) == [0.0, 0.5, 1.0]
    for points in range(2, 22):
        grid = alpha_grid(points)
        assert len(grid) == points and grid[0] == 0 and grid[-1] == pytest.approx(1.0)


def test_awq_grid_option(tiny_hf, tmp_path, monkeypatch):
    """--awq-grid 3 searches alpha 0, 0.5, 1 only; it applies to int4_awq alone and needs 2 points or more."""
    searched = []

    def spy(module, stats, alphas):
        searched.append(tuple(alphas))
        return search_linear(module, stats, alphas)

    monkeypatch.setattr(awq_module, "search_linear", spy)
    runner = CliRunner()
    args = ["quantize", "--model", str(tiny_hf), "--calib-size", "4", "--calib-max-seq-len", "32"]
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "g3"), "--qformat", "int4_awq",
                                  "--awq-block-size", "32", "--awq-grid", "3"])
    assert result.exit_code == 0, result.output
    assert set(searched) == {(0.0, 0.5, 1.0)} and len(searched) == 7 * LAYERS
    g3 = load_checkpoint(tmp_path / "g3")[1]
    g11 = quantize(QuantizeOptions(tiny_hf, tmp_path / "g11", "int4_awq", calib_size=4, calib_max_seq_len=32,
                                   awq_block_size=32))
    assert g11.config.quantization.group_size == 32
    assert g3.keys() == load_checkpoint(tmp_path / "g11")[1].keys()
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "x"), "--qformat", "int8_sq", "--awq-grid", "5"])
    assert result.exit_code != 0 and "--awq-grid applies to the int4_awq format only, not int8_sq" in result.stderr
    result = runner.invoke(main, [*args, "--output", str(tmp_path / "y"), "--qformat", "int4_awq", "--awq-grid", "1"])
    assert result.exit_code != 0 and "--awq-grid" in result.stderr
