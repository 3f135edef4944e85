"""Layer-by-layer calibration of a transformers decoder model.

The inputs of the first decoder layer are captured once for every calibration batch; then each layer in turn is
calibrated on all batches (`calib_layer(layer, replay)`, where `replay` runs the layer over the cached inputs, as
modelopt's calibration functions take a model and a forward loop) and its outputs become the next layer's inputs.
Calibrated statistics are taken on the unquantized activations (quantizers only observe during calibration), so
the result is the same as calibrating the whole model with one forward loop, while memory holds one layer's
activations and progress can be reported per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

ForwardLoop = Callable[[torch.nn.Module], None]
CalibLayer = Callable[[torch.nn.Module, ForwardLoop], None]
Progress = Callable[[int, int], None]  # (layers done, layers in all)


class _Captured(Exception):
    """Stops the model's forward at the first decoder layer once its inputs are recorded."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.get_submodule("model.layers")


def capture_first_layer_inputs(model: torch.nn.Module, batches: Sequence[torch.Tensor]
                               ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(args, kwargs) of the first decoder layer's call for each batch of token ids [b, seq]: the embeddings, and
    the position embeddings and attention mask the model computes once for all layers."""
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, kwargs))
        raise _Captured

    handle = decoder_layers(model)[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                with contextlib.suppress(_Captured):
                    model.get_submodule("model")(input_ids=batch, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != len(batches):
        raise RuntimeError("the first decoder layer was not called once per calibration batch")
    return captured


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class Replay:
    """The forward loop of one stage (a decoder layer, or final norm + lm_head) over the cached inputs of every
    batch. Called as a modelopt forward loop it runs the stage on the captured hidden states and keeps the outputs;
    `run` runs it on other hidden states of the same shapes (with the same position embeddings and mask)."""

    def __init__(self, stage: Callable[..., Any], inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.stage = stage
        self.inputs = inputs
        self.outputs: list[torch.Tensor] | None = None

    @property
    def hidden(self) -> list[torch.Tensor]:
        return [_hidden(args, kwargs) for args, kwargs in self.inputs]

    def run(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outputs = []
        for h, (args, kwargs) in zip(hidden, self.inputs, strict=True):
            args, kwargs = _with_hidden(args, kwargs, h)
            out = self.stage(*args, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return outputs

    def __call__(self, _: torch.nn.Module) -> None:
        self.outputs = self.run(self.hidden)


def calibrate_layerwise(model: torch.nn.Module, batches: Sequence[torch.Tensor], calib_layer: CalibLayer,
                        calib_lm_head: bool = False, progress: Progress | None = None) -> None:
    """Calibrate every decoder layer of `model` (then lm_head after the final norm, with `calib_lm_head`) with
    `calib_layer(module, replay)`; `progress(done, total)` is called once after each decoder layer."""
    inputs = capture_first_layer_inputs(model, batches)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        replay = Replay(layer, inputs)
        with torch.no_grad():
            calib_layer(layer, replay)
        if replay.outputs is None:
            raise RuntimeError(f"calibrating decoder layer {index} did not run it over the calibration data")
        inputs = [_with_hidden(args, kwargs, out) for out, (args, kwargs) in zip(replay.outputs, inputs, strict=True)]
        del replay
        if progress is not None:
            progress(index + 1, len(layers))
    if calib_lm_head:
        norm, head = model.get_submodule("model.norm"), model.get_submodule("lm_head")

        def norm_and_head(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return head(norm(hidden_states))

        with torch.no_grad():
            calib_layer(head, Replay(norm_and_head, inputs))
