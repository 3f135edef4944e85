"""The model's Triton tensors (names as TensorRT-LLM's Triton users know them) and their mapping to the runtime.

Pure numpy: `parse_request` takes {tensor name: array} as Triton hands it (a leading batch dimension of 1) and
returns the prompt and SamplingParams; `response_arrays` builds the output arrays of one response. Invalid inputs
raise ValueError naming the tensor. Every tensor is documented in serving/triton_backend/README.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trtbuild.configs import lora_index
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving import requests


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # config.pbtxt data type
    dims: tuple[int, ...]  # without the batch dimension


_S, _L = (1,), (-1,)  # a scalar, a list
# NOTE: integer inputs are INT64. Triton's HTTP front end converts a JSON number to the declared type without a range
# check, so under INT32 `input_ids: [1, 4294967396]` arrived as [1, 100] and max_tokens 4294967301 as 5. Under INT64
# every JSON integer arrives whole (beyond int64, Triton's JSON parser refuses it) and is range-checked here.
INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", _S), TensorSpec("input_ids", "TYPE_INT64", _L),
    TensorSpec("input_lengths", "TYPE_INT64", _S), TensorSpec("max_tokens", "TYPE_INT64", _S),
    TensorSpec("request_output_len", "TYPE_INT64", _S), TensorSpec("stream", "TYPE_BOOL", _S),
    TensorSpec("streaming", "TYPE_BOOL", _S), TensorSpec("temperature", "TYPE_FP32", _S),
    TensorSpec("top_k", "TYPE_INT64", _S), TensorSpec("top_p", "TYPE_FP32", _S), TensorSpec("min_p", "TYPE_FP32", _S),
    TensorSpec("repetition_penalty", "TYPE_FP32", _S), TensorSpec("presence_penalty", "TYPE_FP32", _S),
    TensorSpec("frequency_penalty", "TYPE_FP32", _S), TensorSpec("random_seed", "TYPE_UINT64", _S),
    TensorSpec("min_tokens", "TYPE_INT64", _S), TensorSpec("stop_words", "TYPE_STRING", _L),
    TensorSpec("bad_words", "TYPE_STRING", _L), TensorSpec("end_id", "TYPE_INT64", _S),
    TensorSpec("pad_id", "TYPE_INT64", _S), TensorSpec("ignore_eos", "TYPE_BOOL", _S),
    TensorSpec("return_log_probs", "TYPE_BOOL", _S), TensorSpec("exclude_input_in_output", "TYPE_BOOL", _S),
    TensorSpec("beam_width", "TYPE_INT64", _S), TensorSpec("lora_name", "TYPE_STRING", _S),
)
OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", _S), TensorSpec("output_ids", "TYPE_INT32", _L),
    TensorSpec("sequence_length", "TYPE_INT32", _S), TensorSpec("output_log_probs", "TYPE_FP32", _L),
    TensorSpec("cum_log_probs", "TYPE_FP32", _S), TensorSpec("finish_reason", "TYPE_STRING", _S),
)
INPUT_NAMES = tuple(t.name for t in INPUTS)
OUTPUT_NAMES = tuple(t.name for t in OUTPUTS)

# tensor -> SamplingParams field, for the scalars that map one to one (ValueErrors are renamed to the tensor)
_SCALARS = {"max_tokens": "max_tokens", "request_output_len": "max_tokens", "temperature": "temperature",
            "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "random_seed": "seed", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
_WIRE_NAMES = {"seed": "random_seed", "stop": "stop_words", "stop_token_ids": "end_id"}  # for error messages
STREAMING_NEEDS_DECOUPLED = ("streaming is only supported if the model is deployed in decoupled mode (write the "
                             "repository with `trtbuild triton-repo --decoupled`), or send stream=false")


@dataclass
class ParsedRequest:
    prompt: str | None  # the text, when text_input was sent
    prompt_ids: list[int] | None  # the ids, when input_ids was sent (text is tokenized by the model)
    params: SamplingParams
    stream: bool = False
    return_log_probs: bool = False
    exclude_input_in_output: bool = False
    max_tokens_input: str | None = None  # the tensor that set max_tokens, if any (else the default applies)
    lora: str | None = None  # the engine's LoRA adapter to run under (lora_name); None: the base model


def _bytes(name: str, x: object) -> str:
    try:
        return x.decode("utf-8") if isinstance(x, bytes | np.bytes_) else str(x)
    except UnicodeDecodeError:
        raise ValueError(f"{name} must be UTF-8 text, got {bytes(x)[:40]!r}") from None


def _value(name: str, array: np.ndarray) -> np.ndarray:
    """Strip the batch dimension, which must be 1 (one prompt per request)."""
    array = np.asarray(array)
    if array.ndim == 0 or array.shape[0] != 1:
        raise ValueError(f"{name}: the batch size must be 1 (one prompt per request; send several requests to batch "
                         f"them), got shape {list(array.shape)}")
    return array[0].reshape(-1)


def _scalar(name: str, array: np.ndarray) -> object:
    value = _value(name, array)
    if value.size != 1:
        raise ValueError(f"{name} must hold one value, got {value.size}")
    item = value[0]
    if isinstance(item, np.bool_):
        return bool(item)
    if isinstance(item, np.integer):
        return int(item)
    return float(item) if isinstance(item, np.floating) else _bytes(name, item)


def _lora(inputs: Mapping[str, np.ndarray], lora_names: tuple[str, ...] | None) -> str | None:
    """The adapter lora_name names ("" or absent: None, the base model), checked against the engine's if given."""
    name = _scalar("lora_name", inputs["lora_name"]) if "lora_name" in inputs else ""
    if not name:
        return None
    if lora_names is not None:
        lora_index(lora_names, name, "lora_name")
    return name


def parse_request(inputs: Mapping[str, np.ndarray], vocab_size: int | None = None,
                  lora_names: tuple[str, ...] | None = None) -> ParsedRequest:
    """The prompt and sampling options of one request's input tensors (ValueError names the tensor at fault).
    `lora_names`: the engine's LoRA adapters, which lora_name must name (None: not checked here)."""
    unknown = sorted(set(inputs) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"unknown input tensors {unknown}; this model takes {', '.join(INPUT_NAMES)}")
    prompt = prompt_ids = None
    if "text_input" in inputs:
        prompt = _scalar("text_input", inputs["text_input"])
    if "input_ids" in inputs:
        prompt_ids = [int(i) for i in _value("input_ids", inputs["input_ids"])]
        if "input_lengths" in inputs:
            n = _scalar("input_lengths", inputs["input_lengths"])
            if not 0 < n <= len(prompt_ids):
                raise ValueError(f"input_lengths must be in [1, {len(prompt_ids)}] (the length of input_ids), got {n}")
            prompt_ids = prompt_ids[:n]
        bad = [i for i in prompt_ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
        if bad:
            raise ValueError(f"input_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    requests.prompt_of(prompt, prompt_ids, text_name="text_input", ids_name="input_ids")
    if "max_tokens" in inputs and "request_output_len" in inputs:
        raise ValueError("send max_tokens or request_output_len (the same thing), not both")
    kwargs: dict[str, object] = {field_: _scalar(name, inputs[name]) for name, field_ in _SCALARS.items()
                                 if name in inputs}
    for name, field_ in (("stop_words", "stop"), ("bad_words", "bad_words")):
        if name in inputs:  # empty strings are "none" (TensorRT-LLM clients often send [""])
            kwargs[field_] = [w for w in (_bytes(name, x) for x in _value(name, inputs[name])) if w]
    if "end_id" in inputs:
        end_id = _scalar("end_id", inputs["end_id"])
        if end_id < 0 or (vocab_size is not None and end_id >= vocab_size):
            raise ValueError(f"end_id must be a token id in [0, {vocab_size}), got {end_id}")
        if not kwargs.get("ignore_eos"):  # end_id replaces the model's EOS tokens
            kwargs.update(ignore_eos=True, stop_token_ids=[end_id])
    if "beam_width" in inputs and _scalar("beam_width", inputs["beam_width"]) != 1:
        raise ValueError("beam_width must be 1: this backend returns one sequence per request (beam search is served "
                         "by `trtbuild serve`: gRPC beam_width, OpenAI use_beam_search)")
    flags = {name: bool(_scalar(name, inputs[name])) for name in ("stream", "streaming", "return_log_probs",
                                                                  "exclude_input_in_output") if name in inputs}
    if flags.get("return_log_probs"):
        kwargs["logprobs"] = 0  # the chosen token's log prob only
    params = requests.sampling_params(kwargs, _WIRE_NAMES)
    max_tokens_input = next((n for n in ("max_tokens", "request_output_len") if n in inputs), None)
    return ParsedRequest(prompt, prompt_ids, params, flags.get("stream", False) or flags.get("streaming", False),
                         flags.get("return_log_probs", False), flags.get("exclude_input_in_output", False),
                         max_tokens_input, _lora(inputs, lora_names))


def check_output_len(parsed: ParsedRequest, prompt_len: int, max_seq_len: int) -> None:
    """Refuse a max_tokens / request_output_len the engine's max_seq_len cannot hold after the prompt (as vLLM and
    the OpenAI front end do) instead of silently generating fewer tokens. A prompt that fills max_seq_len by itself
    is left to the scheduler, which refuses it."""
    room = max_seq_len - prompt_len
    if parsed.max_tokens_input and room >= 1 and parsed.params.max_tokens > room:
        raise ValueError(f"{parsed.max_tokens_input} must be in [1, {room}] (the engine's max_seq_len {max_seq_len} "
                         f"minus the prompt's {prompt_len} tokens), got {parsed.params.max_tokens}")


def response_arrays(text: str, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None,
                    cum_log_prob: float | None = None) -> dict[str, np.ndarray]:
    """Output arrays of one response (batch dimension 1). Log probs are empty (cum_log_probs 0) unless
    return_log_probs was set; cum_log_prob defaults to the sum of `logprobs`."""
    lps = np.asarray(logprobs or [], dtype=np.float32)
    cum = (float(lps.sum()) if cum_log_prob is None else cum_log_prob) if logprobs is not None else 0.0
    return {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.asarray([token_ids], dtype=np.int32).reshape(1, -1),
        "sequence_length": np.array([[len(token_ids)]], dtype=np.int32),
        "output_log_probs": lps.reshape(1, -1),
        "cum_log_probs": np.array([[cum]], dtype=np.float32),
        "finish_reason": np.array([[(finish_reason or "").encode()]], dtype=np.object_),
    }
