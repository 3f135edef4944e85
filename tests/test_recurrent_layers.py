"""Models with recurrent layers: Qwen3.5's gated DeltaNet (linear attention) among gated attention layers, Granite
4.0-H's and Nemotron-H's Mamba2 layers. Logits against transformers: tests/test_hf_parity.py (qwen3_5, qwen3_5_moe,
granite4_h, granite4_h_moe, nemotron_h); the ops: tests/test_gated_delta.py, tests/test_mamba2.py. Here: the configs
of the released models, the state slots the KV cache manager hands out (exact ids), what recomputes instead of
sharing a state (preemption, beam forks, prefixes) with its answers unchanged, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtbuild.builder.buildable import check_buildable
from trtbuild.configs import BuildConfig
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.kv_cache_manager import NO_PREFIX, KVCacheManager
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.request import Request
from trtbuild.runtime.sampling import SamplingParams

# the text part of Qwen3.5-0.8B's config.json (a vision-language model's, as released); values as published
QWEN35_08B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584,
                              "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                              "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
                              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                              "full_attention_interval": 4, "vocab_size": 248320, "tie_word_embeddings": True,
                              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                  "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                                  "mrope_section": [11, 11, 10]}},
              "torch_dtype": "bfloat16", "tie_word_embeddings": True}


def test_the_released_config_reads_as_its_text_model():
    c = model_config_from_hf(QWEN35_08B)
    assert (c.architecture, c.family, c.dtype, c.attention_output_gate, c.qk_norm) == (
        "Qwen3_5ForCausalLM", "qwen3_5", "bfloat16", True, True)
    assert c.recurrent_layers == tuple(i for i in range(24) if (i + 1) % 4)
    assert c.recurrent_state_shape == (16, 128, 128) and c.conv_kernel == 4 and c.rotary_dim == 64
    assert c.conv_channels(0) == 3 * 2048 and c.rotary_base == 1e7 and c.tie_word_embeddings


def test_the_mixture_of_experts_reads_as_qwen2_moe_experts_beside_linear_attention():
    """A config in the shape of Qwen3.5-35B-A3B's text model (values illustrative): 256 experts, 8 a token,
    renormalized, beside a sigmoid-gated shared expert; twice as many value heads as key heads."""
    text = {**QWEN35_08B["text_config"], "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
            "num_attention_heads": 16, "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False}
    c = model_config_from_hf({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text})
    assert (c.architecture, c.family, c.num_experts, c.num_experts_per_tok, c.moe_normalize_topk) == (
        "Qwen3_5MoeForCausalLM", "qwen3_5_moe", 256, 8, True)
    assert (c.shared_expert_intermediate_size, c.shared_expert_gated, c.recurrent_state_shape) == (512, True,
                                                                                                   (32, 128, 128))
    assert len(c.recurrent_layers) == 30 and not c.linear_value_heads_tiled


def request(rid: str, n: int = 5) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def test_the_manager_gives_each_running_request_a_state_slot():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True, windows=(None, 4),
                        num_state_slots=2)
    a, b, c = request("a"), request("b"), request("c")
    assert kv.allocate(a, 5) and kv.allocate(b, 5)
    assert (kv.state_slot(a), kv.state_slot(b), kv.state_slot(c)) == (0, 1, -1)
    free = kv.pool.num_free
    assert not kv.allocate(c, 5)  # no slot left: nothing taken
    assert kv.pool.num_free == free and kv.state_slot(c) == -1 and "c" not in kv.blocks
    kv.free(a)
    assert kv.allocate(c, 5) and kv.state_slot(c) == 0 and kv.allocate(c, 9) and kv.state_slot(c) == 0
    assert kv.fork(b, request("b2")) is None  # a state is not shared: the beam recomputes
    kv.num_cached["b"] = 0
    b.num_computed_tokens = 5
    kv.cache_full_blocks(b)
    assert kv.computed_prefix(request("d", 9)) is NO_PREFIX  # no prefix reuse without the state after it


@pytest.fixture(scope="module")
def qwen3_5(random_hf_model, engine_from_hf):
    from transformers import AutoModelForCausalLM

    path = random_hf_model("qwen3_5")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf, engine_from_hf(path, max_batch_size=4, max_num_tokens=256)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 320, size=int(rng.integers(4, 20))).tolist() for _ in range(n)]


def test_preempted_requests_recompute_their_states(qwen3_5):
    """Eight requests in a pool too small for all of them: preempted ones give back their slots and recompute from
    position 0; every answer is the one a roomy pool gives."""
    _, engine = qwen3_5
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = [c.token_ids for c in LLM(engine, RuntimeConfig(num_threads=1)).generate(prompts(8), params)]
    tight = LLM(engine, RuntimeConfig(num_threads=1, kv_cache_blocks=30, max_batch_size=4))
    preempted = []
    original = tight.core.scheduler.schedule

    def schedule():
        out = original()
        preempted.extend(out.preempted)
        return out

    tight.core.scheduler.schedule = schedule
    assert [c.token_ids for c in tight.generate(prompts(8), params)] == roomy
    assert preempted, "the pool was meant to be too small"
    assert sorted(tight.core.kv.state_slots.free) == [0, 1, 2, 3] and not tight.core.kv.state_slots.held


def test_beam_search_equals_hugging_face(qwen3_5):
    """Beams fork by recomputing the parent's tokens (no state is shared); the answers are transformers'."""
    hf, engine = qwen3_5
    ids = prompts(1)[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                          max_new_tokens=8, length_penalty=1.0)
    expected = [seq[len(ids):] for seq in out.tolist()]
    llm = LLM(engine, RuntimeConfig(num_threads=1))
    (done,) = llm.generate([ids], SamplingParams(max_tokens=8, beam_width=3, ignore_eos=True))
    assert [list(b.token_ids) for b in done.beams] == expected
    assert not llm.core.kv.state_slots.held


def test_what_a_recurrent_state_cannot_do_is_refused():
    """The tensorrt target has no kernel for the scans (drafts: tests/test_recurrent_speculation.py)."""
    config = model_config_from_hf(QWEN35_08B)
    with pytest.raises(TrtbuildError, match="no tensorrt kernel"):
        check_buildable(config, BuildConfig(target="tensorrt"))
    check_buildable(config, BuildConfig(speculative_decoding_mode="draft-tokens", max_draft_len=2))


def test_a_gguf_keeps_llama_cpps_order_of_the_value_heads(tmp_path, monkeypatch):
    """With more value heads than key heads llama.cpp's converter tiles the value heads in every tensor they index;
    the checkpoint keeps that order (`linear_value_heads_tiled`) and the engine's logits are transformers' (the
    round trip of a GGUF with as many of each: tests/test_gguf_convert.py)."""
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
    from helpers import require_shared_models
    from transformers import AutoModelForCausalLM

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert
    from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_dir = make_hf_folder("qwen3_5", tmp_path / "hf")
    config = convert(write_gguf_like_llama_cpp(hf_dir, tmp_path / "m.gguf", "qwen3_5"), tmp_path / "ckpt")
    assert config.linear_value_heads_tiled and config.recurrent_state_shape == (4, 16, 16)
    build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(max_batch_size=2, max_num_tokens=64,
                                                                     max_seq_len=64))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = prompts(1)[0][:12]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    engine = CpuEngine(tmp_path / "engine", num_threads=1, num_blocks=64)
    groups = len(engine.kv.groups)
    got = np.concatenate([engine.step(in_every_group([SequenceChunk(0, ids[:9], 0, 9, list(range(4)))], groups, 16)),
                          *(engine.step(in_every_group([SequenceChunk(0, [ids[p]], p, 1, list(range(4)))], groups,
                                                       16)) for p in range(9, len(ids)))])
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()


def test_ranks_and_calibration_are_refused_with_what_to_do(tmp_path, random_hf_model):
    from trtbuild.builder.convert.convert import convert
    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    path = random_hf_model("qwen3_5")
    for option in ("tp_size", "pp_size"):
        with pytest.raises(ConfigError, match="not split over ranks"):
            convert(path, tmp_path / option, **{option: 2})
    calib = tmp_path / "calib.txt"
    calib.write_text("Some text to calibrate on.\n")
    with pytest.raises(ConfigError, match="trtbuild convert"):
        quantize(QuantizeOptions(model=path, output=tmp_path / "q", qformat="fp8", calib_dataset=calib))


def test_nemotron_h_layers_pair_each_mixer_with_the_mlp_after_it():
    """Nemotron-H's one-block layers (M: Mamba2, *: attention, -: MLP) as trtbuild's mixer + MLP layers: a mixer
    without an MLP after it makes a layer without one; experts and an MLP after no mixer are refused."""
    hf = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "vocab_size": 320,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 8,
          "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "hybrid_override_pattern": "M-M*-M-"}
    c = model_config_from_hf(hf)
    assert (c.family, c.num_hidden_layers, c.layer_types, c.mlp_free_layers) == (
        "nemotron_h", 4, ("mamba", "mamba", "full_attention", "mamba"), (1,))
    assert (c.hidden_act, c.gated_mlp, c.no_rope_layers, c.recurrent_state_shape) == (
        "relu2", False, (0, 1, 2, 3), (8, 16, 16))
    for pattern, match in (("-M", "follows no mixer"), ("ME", "experts")):
        with pytest.raises(TrtbuildError, match=match):
            model_config_from_hf({**hf, "hybrid_override_pattern": pattern})


def test_a_nemotron_h_gguf_converts_like_its_hf_folder(tmp_path, monkeypatch):
    """llama.cpp's nemotron_h keeps one block a GGUF layer (its kinds told by the KV heads and feed-forward
    features each layer has) and a context of 2^20, which the HF folder is given here too."""
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
    from helpers import require_shared_models
    from test_gguf_convert import assert_same_checkpoint

    from trtbuild.builder.convert.convert import convert

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("nemotron_h", tmp_path / "hf", {"max_position_embeddings": 2**20})
    convert(hf, tmp_path / "from_hf")
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "nemotron_h"), tmp_path / "from_gguf")
    assert config.family == "nemotron_h" and config.mlp_free_layers == (1,)
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")


def test_a_mamba2_model_and_its_gguf_are_mamba2_layers_without_mlps(tmp_path, monkeypatch):
    """Mamba2ForCausalLM (Codestral Mamba): a Nemotron-H of Mamba2 layers only, no attention and no MLP; llama.cpp's
    mamba2 file (no attention heads, no feed-forward features) converts like its HF folder."""
    from gguf_helpers import make_hf_folder, write_gguf_like_llama_cpp
    from helpers import require_shared_models
    from test_gguf_convert import assert_same_checkpoint

    from trtbuild.builder.convert.convert import convert

    require_shared_models()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = make_hf_folder("mamba2", tmp_path / "hf", {"max_position_embeddings": 2**20})
    config = convert(hf, tmp_path / "from_hf")
    assert (config.architecture, config.family, config.mlp_free_layers, config.recurrent_layers) == (
        "Mamba2ForCausalLM", "nemotron_h", (0, 1, 2), (0, 1, 2))
    assert config.recurrent_state_shape == (8, 16, 16) and config.mamba_num_groups == 2
    config = convert(write_gguf_like_llama_cpp(hf, tmp_path / "m.gguf", "mamba2"), tmp_path / "from_gguf")
    assert (config.architecture, config.mlp_free_layers) == ("Mamba2ForCausalLM", (0, 1, 2))
    assert_same_checkpoint(tmp_path / "from_hf", tmp_path / "from_gguf")
