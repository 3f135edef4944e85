"""EngineCore and LLM requests: stop conditions, min_tokens, validation naming the field, runtime limits, tokenizers."""

from __future__ import annotations

import re

import numpy as np
import pytest
from engine_core_helpers import GREEDY, VOCAB, config
from helpers import assert_pool_full

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.configs import BuildConfig
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

STORY = ", there was a little girl named Lily. She loved to play outside in the park."


# ---- stop conditions (stories260K, greedy) ---------------------------------------------------------------------


def test_greedy_story_and_stop_string(stories_engine):
    llm = LLM(stories_engine, config())
    full = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40))[0]
    assert full.text.startswith(STORY) and full.finish_reason == "length"
    stopped = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop=("Lily",)))[0]
    assert stopped.text == ", there was a little girl named " and stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]  # the token completing "Lily" is the last
    assert llm.core.tokenizer.decode(stopped.token_ids).endswith("Lily")
    kept = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop=["park", "Lily"],
                                                              include_stop_str_in_output=True))[0]
    assert kept.text == ", there was a little girl named Lily" and kept.finish_reason == "stop"
    # the stop string completes on the very token that also reaches max_tokens: still "stop", text cut
    exact = llm.generate(["Once upon a time"], SamplingParams(max_tokens=len(stopped.token_ids), stop="Lily"))[0]
    assert (exact.text, exact.finish_reason) == (stopped.text, "stop")
    assert_pool_full(llm.core)


def test_stop_token_ids_and_max_tokens(stories_engine):
    llm = LLM(stories_engine, config())
    full = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40))[0]
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    # the stop token's own text is not part of the output (as vLLM), the text before it is
    assert out.text == llm.generate(["Once upon a time"], SamplingParams(max_tokens=first))[0].text
    assert full.text.startswith(out.text) and len(out.text) < len(full.text)
    short = llm.generate(["Once upon a time"], SamplingParams(max_tokens=5))[0]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:5]
    assert full.text.startswith(short.text) and short.text
    # min_tokens masks stop token ids until enough tokens were generated
    later = llm.generate(["Once upon a time"], SamplingParams(max_tokens=40, stop_token_ids=[stop_id],
                                                               min_tokens=first + 1))[0]
    assert stop_id not in later.token_ids[: first + 1] and later.token_ids[:first] == full.token_ids[:first]


def test_min_tokens_masks_eos(llama_engine):
    """A greedy request that ends with EOS; with min_tokens beyond that point EOS is never picked before it."""
    llm = LLM(llama_engine, config())
    candidates = [np.random.default_rng(seed).integers(3, VOCAB, size=6).tolist() for seed in range(64)]
    runs = llm.generate(candidates, SamplingParams(max_tokens=40))
    eos = llm.core.eos_token_ids
    hits = [(p, c) for p, c in zip(candidates, runs, strict=True) if c.finish_reason == "stop"
            and len(c.token_ids) >= 3]
    assert hits, "no prompt of the random model ends with EOS within 40 tokens"
    prompt, base = hits[0]
    assert base.token_ids[-1] in eos and not set(base.token_ids[:-1]) & set(eos)
    k = len(base.token_ids) - 1
    out = llm.generate([prompt], SamplingParams(max_tokens=40, min_tokens=k + 4))[0]
    assert out.token_ids[:k] == base.token_ids[:k]
    assert not set(out.token_ids[: k + 4]) & set(eos) and len(out.token_ids) >= k + 4
    ignored = llm.generate([prompt], SamplingParams(max_tokens=k + 3, ignore_eos=True))[0]
    assert ignored.token_ids[: k + 1] == base.token_ids and ignored.finish_reason == "length"


# ---- validation ------------------------------------------------------------------------------------------------


def test_make_request_validation_names_the_field(llama_engine, stories_engine):
    core = EngineCore(llama_engine, config())
    ok = SamplingParams()
    cases = [
        ([], ok, "prompt is empty"),
        ([5] * 256, ok, "prompt has 256 tokens.*max_seq_len is 256"),
        ([5, VOCAB], ok, r"prompt_token_ids: .*\[320\].*outside the vocabulary"),
        ([-1, 5], ok, r"prompt_token_ids: .*\[-1\]"),
        ("hello", ok, "prompt: this engine has no tokenizer"),
        ([5, 6], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids must be token ids below"),
        ([5, 6], SamplingParams(bad_words_ids=[[1, VOCAB + 3]]), "bad_words_ids must be token ids below"),
        ([5, 6], SamplingParams(bad_words=["x"]), "bad_words need a tokenizer"),
    ]
    for prompt, params, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            core.make_request(prompt, params)
    for field, value in (("temperature", -1), ("top_p", 0), ("top_k", -2), ("max_tokens", 0), ("seed", -1),
                         ("min_p", 2), ("logprobs", 99)):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    small = EngineCore(llama_engine, config(kv_cache_blocks=4))  # 32 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks but the whole cache holds 4"):
        small.make_request([5] * 20, SamplingParams(max_tokens=20))
    small.make_request([5] * 20, SamplingParams(max_tokens=12))
    # LLM validates every prompt before queuing any
    llm = LLM(llama_engine, config())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[5, 6], [5, VOCAB]], ok)
    with pytest.raises(ValueError, match="params: got 1 for 2 prompts"):
        llm.generate([[5, 6], [7]], [ok])
    assert not llm.core.has_unfinished() and not llm.core.tracked
    assert not core.has_unfinished() and not core.tracked  # validation left no trace
    text_core = EngineCore(stories_engine, config())
    request = text_core.make_request("Once upon a time", SamplingParams(bad_words=["Lily"]))
    assert request.prompt_ids[0] == 1 and len(request.prompt_ids) > 1  # BOS + text


def test_runtime_config_beyond_the_engine_is_refused(llama_engine):
    with pytest.raises(ValueError, match="max_batch_size 9 exceeds the engine's build limit 8"):
        EngineCore(llama_engine, config(max_batch_size=9))
    with pytest.raises(ValueError, match="max_num_tokens 129 exceeds the engine's build limit 128"):
        EngineCore(llama_engine, config(max_num_tokens=129))
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineCore(llama_engine, config(policy="fifo"))
    with pytest.raises(ValueError, match="kv_cache_blocks must be at least 1"):
        EngineCore(llama_engine, config(kv_cache_blocks=0))


def test_runtime_config_resolves_against_the_build_limits():
    build = BuildConfig(max_batch_size=8, max_num_tokens=128)
    assert RuntimeConfig().resolve(build) == RuntimeConfig(max_batch_size=8, max_num_tokens=128)
    assert RuntimeConfig(max_batch_size=2).resolve(build).max_batch_size == 2
    with pytest.raises(ConfigError, match="max_batch_size 9 exceeds the engine's build limit 8") as e:
        RuntimeConfig(max_batch_size=9).resolve(build)
    assert e.value.field == "max_batch_size" and "--" not in str(e.value)  # the CLI adds flag names


def test_kv_pool_is_sized_from_the_engine_io_spec(llama_engine):
    info = read_engine_config(llama_engine)
    per_block = info.kv_cache_bytes_per_block
    m, b = info.model, info.build
    assert per_block == m.num_hidden_layers * 2 * m.num_key_value_heads * b.tokens_per_block * m.head_size * 4
    core = EngineCore(llama_engine, config(kv_cache_memory=5.5 * per_block, kv_cache_blocks=None))
    assert core.engine.kv.num_blocks == core.kv.pool.num_blocks == 5  # allocated once, at the size asked
    assert core.engine.kv.bytes_per_block == per_block
    with pytest.raises(ConfigError, match=f"holds no KV block \\({per_block} bytes each\\)"):
        EngineCore(llama_engine, config(kv_cache_memory=per_block - 1.0, kv_cache_blocks=None))


def test_request_ids_are_unique(llama_engine):
    core = EngineCore(llama_engine, config())
    core.add_request(core.make_request([5, 6], GREEDY, request_id="x"))
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        core.add_request(core.make_request([7], GREEDY, request_id="x"))
    core.abort_request("x")
    assert_pool_full(core)


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", b'{"version": "1.0", "model": ', r"tokenizer\.json is not a valid tokenizer \("),
    ("generation_config.json", b"{not json", r"generation_config\.json is not a valid generation config \("),
    ("generation_config.json", b'{"eos_token_id": "two"}', r"generation_config\.json is not a valid generation "
                                                            r"config \(eos_token_id 'two' is not a token id"),
])
def test_corrupt_tokenizer_files_are_one_line_errors_naming_the_file(stories_engine, tmp_path, name, content, message):
    import shutil

    from click.testing import CliRunner

    from trtbuild.cli import main

    engine = tmp_path / "engine"
    shutil.copytree(stories_engine, engine)
    (engine / name).write_bytes(content)
    with pytest.raises(TrtbuildError, match=message):
        EngineCore(engine, config(warm_up=False))
    result = CliRunner().invoke(main, ["run", "--engine", str(engine), "--prompt", "Once", "--max-tokens", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.search(message, result.output) and len(result.output.strip().splitlines()) == 1


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(stories_engine, monkeypatch):
    core = EngineCore(stories_engine, config())
    limit = core.scheduler.config.max_seq_len * core.tokenizer.max_token_bytes
    monkeypatch.setattr(core.tokenizer, "encode", lambda *_: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(ValueError, match=rf"prompt: {limit + 1} bytes cannot fit in the engine's max_seq_len"):
        core.make_request("a" * (limit + 1), GREEDY)
    with pytest.raises(ValueError, match="bytes cannot fit"):
        core.make_request("é" * (limit // 2 + 1), GREEDY)  # counted in UTF-8 bytes, not characters
