"""Engine logits and greedy tokens match Hugging Face transformers (fp32) for every supported family.

Tolerance: max |engine - HF| / max |HF| <= 1e-4 over every compared logit row (relative to the row scale).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import STORIES260K, TINYSTORIES656K, require_shared_models

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

RTOL = 1e-4
MODELS = ["stories260K", "tinystories-656K", "llama", "llama_bias", "llama3_rope", "qwen2", "qwen2_yarn", "qwen3",
          "mistral", "mistral_window", "phi3", "phi3_longrope", "phi3_partial", "smollm3", "gemma", "gemma2", "gemma3",
          "granite", "olmo2", "olmo3", "qwen3_moe", "mixtral", "olmoe", "granitemoe", "qwen2_moe", "gpt_oss",
          "ernie4_5", "glm4", "exaone4", "exaone4_window", "cohere", "cohere2",
          "ministral3", "arcee", "starcoder2", "hunyuan_dense", "lfm2", "lfm2_wide",
          "lfm2_moe", "lfm2_moe_raw", "granite4", "granite4_nope", "granite4_moe",
          "granitemoeshared", "apertus", "afmoe", "glm", "qwen3_5", "qwen3_5_moe",
          "granite4_h", "granite4_h_moe", "nemotron_h", "mamba2"]


@pytest.fixture(scope="module")
def hf_and_engine(request, random_hf_model, engine_from_hf):
    cache = {}

    def get(name: str):
        if name not in cache:
            if name in ("stories260K", "tinystories-656K"):
                require_shared_models()
                path = STORIES260K if name == "stories260K" else TINYSTORIES656K
            else:
                path = random_hf_model(name)
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None  # compare full-length greedy runs
            cache[name] = (hf, engine_from_hf(path, max_batch_size=4, max_num_tokens=256))
        return cache[name]

    return get


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    err = np.abs(actual - expected).max() / np.abs(expected).max()
    assert err <= RTOL, f"relative logit error {err:.2e} > {RTOL}"


def chunk(seq: int, ids: list[int], start: int, num_logits: int = 1, groups: int = 1) -> SequenceChunk:
    """A chunk of test sequence `seq` (of at most 3), which owns blocks seq*32 .. seq*32+31 (enough for 256 tokens of
    8), and as many 96 blocks further for each other KV cache group (Gemma 2 / 3, OLMo 3)."""
    return in_every_group([SequenceChunk(seq, ids, start, num_logits, list(range(seq * 32, seq * 32 + 32)))],
                          groups, 96)[0]


def engine_of(engine_dir) -> tuple[CpuEngine, int]:
    """A CPU engine with blocks for 3 test sequences (`chunk`) in each of its KV cache groups, and their number."""
    groups = len(read_engine_config(engine_dir).kv_cache_groups)
    return CpuEngine(engine_dir, num_threads=1, num_blocks=96 * groups), groups


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=length).tolist()


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_32_decode_steps(name, hf_and_engine):
    hf, engine_dir = hf_and_engine(name)
    engine, groups = engine_of(engine_dir)
    ids = prompt(hf.config.vocab_size, 13, seed=1)
    with torch.no_grad():
        full = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0].tolist()
    expected = hf_logits(hf, full)
    got = engine.step([chunk(0, ids, 0, num_logits=len(ids), groups=groups)])
    assert_close(got, expected[: len(ids)])
    for pos in range(len(ids), len(full)):  # 32 decode steps fed with HF's greedy tokens
        got = engine.step([chunk(0, [full[pos]], pos, groups=groups)])
        assert_close(got[0], expected[pos])


def test_yarn_past_its_original_context(hf_and_engine):
    """qwen2_yarn was trained on 64 positions and scaled to 256: a 240-token prefill and decode steps up to position
    247 match transformers."""
    hf, engine_dir = hf_and_engine("qwen2_yarn")
    engine, groups = engine_of(engine_dir)
    ids = prompt(hf.config.vocab_size, 248, seed=5)
    expected = hf_logits(hf, ids)
    assert_close(engine.step([chunk(0, ids[:240], 0, num_logits=240, groups=groups)]), expected[:240])
    for pos in range(240, len(ids)):
        assert_close(engine.step([chunk(0, [ids[pos]], pos, groups=groups)])[0], expected[pos])


def test_decode_steps_after_a_long_context(random_hf_model, engine_from_hf):
    """A 700-token prompt in chunks of 256, then decode steps up to position 711: a decode step of one sequence over
    more than 512 keys splits each token's keys into ranges, a task each, combined by their log-sum-exps
    (cpu_ops/attention_task.h); prefill and decode logits match transformers."""
    from transformers import AutoModelForCausalLM

    path = random_hf_model("qwen2_long")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = CpuEngine(engine_from_hf(path, max_batch_size=1, max_num_tokens=256, max_seq_len=1024), num_threads=2,
                       num_blocks=130)
    ids = prompt(hf.config.vocab_size, 712, seed=7)
    expected, blocks = hf_logits(hf, ids), list(range(128))
    for start in range(0, 700, 256):
        n = min(256, 700 - start)
        got = engine.step([SequenceChunk(0, ids[start:start + n], start, n, blocks)])
        assert_close(got, expected[start:start + n])
    for pos in range(700, len(ids)):
        assert_close(engine.step([SequenceChunk(0, [ids[pos]], pos, 1, blocks)])[0], expected[pos])


@pytest.mark.parametrize("name", MODELS)
def test_mixed_batch_and_chunked_prefill(name, hf_and_engine):
    """One step holding a decode token, a first prefill chunk and a continuing prefill chunk of different lengths."""
    hf, engine_dir = hf_and_engine(name)
    engine, groups = engine_of(engine_dir)
    a, b, c = (prompt(hf.config.vocab_size, n, seed=s) for n, s in ((21, 2), (7, 3), (17, 4)))
    engine.step([chunk(0, a[:20], 0, num_logits=0, groups=groups), chunk(2, c[:9], 0, num_logits=0, groups=groups)])
    got = engine.step([
        chunk(0, a[20:], 20, groups=groups),  # decode: past 20
        chunk(1, b, 0, num_logits=len(b), groups=groups),  # whole prompt
        chunk(2, c[9:], 9, num_logits=len(c) - 9, groups=groups),  # second chunk of a split prefill
    ])
    assert got.shape[0] == 1 + len(b) + len(c) - 9
    assert_close(got[0], hf_logits(hf, a)[-1])
    assert_close(got[1 : 1 + len(b)], hf_logits(hf, b))
    assert_close(got[1 + len(b) :], hf_logits(hf, c)[9:])


@pytest.mark.parametrize("name", MODELS)
def test_greedy_64_tokens_identical_to_generate(name, hf_and_engine):
    hf, engine_dir = hf_and_engine(name)
    prompts = [prompt(hf.config.vocab_size, n, seed=10 + n) for n in (5, 16, 9)]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0].tolist()
        expected.append(out[len(ids) :])
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for chunk_limit in (None, 4):  # whole prompts, then prefill chunks of 4 tokens
        llm = LLM(engine_dir, RuntimeConfig(num_threads=1, max_prefill_chunk=chunk_limit))
        assert [c.token_ids for c in llm.generate(prompts, params)] == expected
        assert llm.core.kv.pool.num_free == llm.core.kv.pool.num_blocks  # every block went back to the pool
