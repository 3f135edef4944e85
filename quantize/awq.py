"""int4 AWQ: modelopt's `awq_lite` scale search, computed from each linear's input statistics.

awq_lite gives each quantized linear y = x W^T a pre-quant scale s(a) = x_mean^a / w_mean^(1-a) (normalized), for
the a on a grid over [0, 1] whose fake-quantized output is closest to the float one: it runs the calibration data
through the model once to collect x_mean, then once more computing every linear's output once per grid point.
The loss of one grid point, sum over batches of mean((x_b D Q(W s)^T - x_b W^T)^2) with D = diag(1/s), is
trace(E H E^T) / out_features for the weight error E = Q(W s) D - W and H = sum_b x_b^T x_b / n_b (n_b rows in
batch b). So one pass collects x_mean and H, and each grid point then costs out * in^2 instead of a pass over the
calibration tokens; below `in` tokens the rows x_b / sqrt(n_b) are kept instead of H (out * tokens * in).
Scale, grid, loss and tie-breaking are modelopt 0.47's; the chosen scale is applied with modelopt's own
`apply_pre_quant_scale_and_smooth`, so the model ends in the state awq_lite leaves it in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from trtbuild.quantize.layerwise import Replay

DEFAULT_GRID_POINTS = 11  # modelopt's awq_lite alpha_step 0.1: a = 0, 0.1, ..., 1


def alpha_grid(points: int = DEFAULT_GRID_POINTS) -> list[float]:
    """The alphas searched, as modelopt builds them (`torch.arange(0, 1 + step, step)`, step = 1 / (points - 1))."""
    if points < 2:
        raise ValueError("the AWQ grid needs at least 2 points (alpha 0 and 1)")
    step = 1.0 / (points - 1)
    return [a.item() for a in torch.arange(0, 1.0 + step, step)][:points]


class InputStats:
    """What the search needs from the inputs of one linear (shared by linears reading the same tensor): the mean
    |x| per input channel (modelopt's act_scale) and what gives trace(E H E^T)."""

    def __init__(self) -> None:
        self.act_sum: torch.Tensor | float = 0.0
        self.calls = 0
        self._rows: list[torch.Tensor] = []
        self._num_rows = 0
        self._gram: torch.Tensor | None = None

    def add_activation(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        self.act_sum = self.act_sum + x.abs().mean(0).to(torch.float32)  # modelopt's get_act_scale
        self.calls += 1

    def add_moments(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        rows = x.float() * (1.0 / math.sqrt(x.shape[0]))
        if self._gram is None and self._num_rows + rows.shape[0] <= x.shape[1]:
            self._rows.append(rows)
            self._num_rows += rows.shape[0]
            return
        if self._gram is None:
            self._gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            for r in self._rows:
                self._gram += (r.T @ r).double()
            self._rows = []
        self._gram += (rows.T @ rows).double()

    @property
    def act_scale(self) -> torch.Tensor:
        return self.act_sum / self.calls

    def prepared(self) -> Callable[[torch.Tensor], float]:
        """loss(E) = sum_b ||x_b E^T||^2 / (n_b out) for a weight error E [out, in] (modelopt's loss)."""
        if self._gram is not None:
            gram = self._gram.float()
            return lambda err: float(((err @ gram) * err).sum()) / err.shape[0]
        rows = torch.cat(self._rows)
        return lambda err: float((rows @ err.T).pow(2).sum()) / err.shape[0]


def _weight_scale(weight: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """modelopt awq_lite's get_weight_scale: mean over output rows of |w| / max |w| of its block."""
    shape = weight.shape
    cut = None
    if block_size:
        if shape[-1] % block_size:
            cut = slice(shape[-1])
            weight = torch.nn.functional.pad(weight, (0, block_size - shape[-1] % block_size), "constant", 0)
            shape = weight.shape
        weight = weight.contiguous().view(-1, block_size)
    w_abs = weight.abs()
    scale = (w_abs / (w_abs.amax(dim=1, keepdim=True) + torch.finfo(weight.dtype).tiny)).view(shape)
    if cut is not None:
        scale = scale[..., cut]
    return scale.mean(0).to(torch.float32)


def _awq_scale(act_scale: torch.Tensor, weight_scale: torch.Tensor, alpha: float) -> torch.Tensor:
    """modelopt awq_lite's get_scale (without tensor parallelism)."""
    scales = (act_scale.pow(alpha) / (weight_scale.pow(1 - alpha) + torch.finfo(torch.float32).tiny)).clamp(
        min=1e-4, max=1e4).view(-1)
    return (scales / (scales.max() * scales.min()).sqrt()).view(-1)


def _block_size(module: torch.nn.Module) -> int | None:
    sizes = module.weight_quantizer.block_sizes
    if sizes is None:
        return None
    return sizes.get(-1, sizes.get(1))


def search_linear(module: torch.nn.Module, stats: InputStats, alphas: list[float]
                  ) -> tuple[float, torch.Tensor, dict[float, float]]:
    """(best alpha, its AWQ scale s, the loss of every alpha) of one quantized linear whose weight quantizer has no
    amax yet."""
    w = module.weight
    quantizer = module.weight_quantizer
    act_scale, w_scale = stats.act_scale, _weight_scale(w, _block_size(module))
    loss_of = stats.prepared()
    losses = {}
    try:
        for alpha in alphas:
            scale = _awq_scale(act_scale, w_scale, alpha)
            quantizer.pre_quant_scale = scale.to(w.dtype)
            err = quantizer(w) * (1 / scale).to(w.dtype) - w
            losses[alpha] = loss_of(err)
    finally:
        if hasattr(quantizer, "_pre_quant_scale"):
            delattr(quantizer, "_pre_quant_scale")
    best = min(losses, key=losses.get)  # the first of equal losses, as modelopt
    return best, _awq_scale(act_scale, w_scale, best), losses


class _Observer:
    """Forward pre-hooks on a layer's quantized linears feeding `InputStats` (`adds`: the methods to call); linears
    called one after the other with the very same input tensor (q/k/v, gate/up) share one."""

    def __init__(self, linears: dict[str, torch.nn.Module], stats: dict[str, InputStats], *adds: str) -> None:
        self.stats, self.adds = stats, adds
        self.last: tuple[torch.Tensor | None, InputStats | None] = (None, None)
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]

    def _hook(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            if x is self.last[0]:
                self.stats.setdefault(name, self.last[1])
                return
            own = self.stats.setdefault(name, InputStats())
            for add in self.adds:
                getattr(own, add)(x)
            self.last = (x, own)
        return hook

    def __enter__(self) -> _Observer:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.last = (None, None)


class AWQLayerCalibrator:
    """`calib_layer` for `layerwise.calibrate_layerwise`: one pass over a layer's calibration inputs (the linears'
    input statistics, and modelopt's max calibration of its other quantizers, e.g. the KV cache's), then the scale
    search and modelopt's apply step for each quantized linear.

    `search_stream`: modelopt computes the search losses in a second pass over the data, in which activation
    quantizers calibrated in the first pass (with int4_awq: the KV cache's) already quantize. So with such
    quantizers the second moments come from a second stream of hidden states, carried from layer to layer, in
    which they are on (weights stay float in both); without them the streams are the same and one pass does."""

    def __init__(self, alphas: list[float], search_stream: bool = False) -> None:
        self.alphas = alphas
        self.search_stream = search_stream
        self._stream: list[torch.Tensor] | None = None
        self.losses: dict[torch.nn.Module, dict[float, float]] = {}  # per quantized linear: alpha -> loss
        self.seconds = {"forward": 0.0, "search": 0.0}

    def __call__(self, layer: torch.nn.Module, replay: Replay) -> None:
        from modelopt.torch.quantization.conversion import set_quantizer_by_cfg_context
        from modelopt.torch.quantization.model_calib import apply_pre_quant_scale_and_smooth, max_calibrate
        from modelopt.torch.quantization.utils import is_quantized_linear

        linears = {name: m for name, m in layer.named_modules()
                   if is_quantized_linear(m) and m.weight_quantizer.is_enabled}
        stats: dict[str, InputStats] = {}
        float_weights = [{"quantizer_name": "*weight_quantizer", "enable": False}]
        start = time.perf_counter()
        with set_quantizer_by_cfg_context(layer, float_weights):
            if not self.search_stream:
                with _Observer(linears, stats, "add_activation", "add_moments"):
                    max_calibrate(layer, replay)
            else:
                with _Observer(linears, stats, "add_activation"):
                    max_calibrate(layer, replay)
                search_stats: dict[str, InputStats] = {}
                with _Observer(linears, search_stats, "add_moments"):
                    self._stream = replay.run(replay.hidden if self._stream is None else self._stream)
                for name, s in search_stats.items():
                    s.act_sum, s.calls = stats[name].act_sum, stats[name].calls
                stats = search_stats
        mid = time.perf_counter()
        for name, module in linears.items():
            if name not in stats:
                raise RuntimeError(f"AWQ: {name} saw no calibration data")
            module.weight_quantizer.reset_amax()
            _, scale, self.losses[module] = search_linear(module, stats[name], self.alphas)
            apply_pre_quant_scale_and_smooth(module, 1.0 / scale)
        self.seconds["forward"] += mid - start
        self.seconds["search"] += time.perf_counter() - mid
