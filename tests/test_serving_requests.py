"""The front-end layer every server shares (serving/requests.py): decoding a client's fields, following a request's
stream with cancellation, and adding its deltas up, over a real AsyncEngine."""

from __future__ import annotations

import pytest

from trtbuild.errors import ConfigError
from trtbuild.runtime.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.serving.requests import Accumulated, ErrorKind, error_kind, follow, prompt_of, sampling_params

PROMPT = [5, 6, 7]


@pytest.fixture()
def engine(llama_engine):
    engine = AsyncEngine(EngineCore(llama_engine, RuntimeConfig(num_threads=1)))
    yield engine
    engine.shutdown()


def test_client_fields_become_sampling_params_and_errors_name_the_wire_field():
    assert sampling_params({"max_tokens": 3, "seed": 7}) == SamplingParams(max_tokens=3, seed=7)
    with pytest.raises(ConfigError, match=r"^random_seed must be") as e:
        sampling_params({"seed": -1}, {"seed": "random_seed"})
    assert e.value.field == "random_seed"
    with pytest.raises(ConfigError, match=r"^top_p must be"):
        sampling_params({"top_p": 0.0}, {"seed": "random_seed"})


@pytest.mark.parametrize(("text", "ids", "message"), [
    ("x", [1], "got both"), (None, None, "got neither"), ("", None, "prompt is empty"),
    (None, [], "prompt_token_ids is empty")])
def test_prompt_is_text_or_token_ids(text, ids, message):
    assert prompt_of("Once", None) == "Once" and prompt_of(None, (1, 2)) == [1, 2]
    with pytest.raises(ValueError, match=message):
        prompt_of(text, ids)


def test_errors_sort_into_kinds():
    assert [error_kind(e) for e in (ValueError("x"), ConfigError("top_p", "bad"), QueueFullError("full"),
                                    EngineDeadError("dead"), RuntimeError("bug"))] == [
        ErrorKind.INVALID_ARGUMENT, ErrorKind.INVALID_ARGUMENT, ErrorKind.QUEUE_FULL, ErrorKind.UNAVAILABLE,
        ErrorKind.INTERNAL]


def test_follow_adds_up_to_what_the_engine_generates(engine):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    deltas = list(follow(engine.submit(PROMPT, params), lambda: False, poll_s=0.01))
    whole = Accumulated()
    for delta in deltas:
        whole.add(delta)
    assert whole.finished and whole.finish_reason == "length" and len(whole.token_ids) == 6
    assert whole.token_ids == [t for d in deltas for t in d.new_token_ids]
    assert [lp.token_id for lp in whole.logprobs] == whole.token_ids
    assert whole.last.num_output_tokens == 6 and engine.finish_reasons["length"] == 1


def test_follow_cancels_when_the_client_is_gone_and_frees_the_blocks(engine):
    stream = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    outputs = []
    for output in follow(stream, lambda: bool(outputs), poll_s=0.0):  # gone once the first delta arrived
        outputs.append(output)
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort" and len(outputs) < 200
    assert engine.finish_reasons["abort"] == 1 and engine.num_unfinished == 0


def test_follow_closed_early_cancels_and_drains(engine):
    stream = engine.submit(PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
    outputs = follow(stream, lambda: False, poll_s=0.01)
    next(outputs)
    outputs.close()  # as when a gRPC handler's client disconnects mid-stream
    assert stream.finished and engine.finish_reasons["abort"] == 1
    core = engine.core
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
