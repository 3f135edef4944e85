"""LFM2: short convolution layers beside attention layers, their state (each token's B * x row) kept in the paged KV
pool as windowed cache layers (configs/kv_groups.py, plugins/short_conv.py). From the released config.json and from
llama.cpp's `lfm2` GGUF keys; served end to end: chunked prefill, batching, prefix reuse, preemption and speculative
decoding give Hugging Face's greedy tokens. Logits against transformers are in test_hf_parity.py (lfm2, lfm2_wide),
the GGUF round trip in test_gguf_convert.py, the op in test_short_conv.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import RUNTIME_ENGINE_OPTIONS
from helpers import assert_pool_full, drive

from trtbuild.builder.buildable import check_buildable
from trtbuild.builder.convert.convert import convert
from trtbuild.builder.convert.gguf_config import GGUF_ARCHITECTURES, hf_config
from trtbuild.configs import BuildConfig, QuantConfig
from trtbuild.configs.from_hf import model_config_from_hf
from trtbuild.errors import ConfigError, TrtbuildError
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.speculative import SpeculativeConfig

# the form of LiquidAI/LFM2-1.2B's config.json
LFM2_1_2B = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "block_auto_adjust_ff_dim": True,
             "block_dim": 2048, "block_ff_dim": 12288, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
             "block_norm_eps": 1e-05, "conv_L_cache": 3, "conv_bias": False, "conv_dim": 2048,
             "full_attn_idxs": [2, 5, 8, 10, 12, 14], "hidden_size": 2048, "max_position_embeddings": 128000,
             "norm_eps": 1e-05, "num_attention_heads": 32, "num_heads": 32, "num_hidden_layers": 16,
             "num_key_value_heads": 8, "rope_theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16",
             "vocab_size": 65536, "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0}
FULL = (2, 5, 8, 10, 12, 14)


def test_the_released_config_and_the_gguf_keys_give_the_same_model():
    c = model_config_from_hf(LFM2_1_2B)
    assert (c.intermediate_size, c.conv_kernel, c.conv_bias, c.tie_word_embeddings, c.head_size) == (
        8192, 3, False, True, 64)
    assert c.layer_types == tuple("full_attention" if i in FULL else "conv" for i in range(16))
    assert (c.qk_norm, c.qk_norm_full, c.norm_epsilon, c.rotary_base) == (True, False, 1e-5, 1e6)
    meta = {f"lfm2.{k}": v for k, v in {
        "embedding_length": 2048, "attention.head_count": 32, "block_count": 16, "feed_forward_length": 8192,
        "attention.head_count_kv": [8 if i in FULL else 0 for i in range(16)], "rope.freq_base": 1e6,
        "context_length": 128000, "attention.layer_norm_rms_epsilon": 1e-5, "shortconv.l_cache": 3}.items()}
    from_gguf = model_config_from_hf(hf_config(meta, "lfm2", GGUF_ARCHITECTURES["lfm2"],
                                               {"token_embd.weight": (65536, 2048)}, {}))
    for field in ("intermediate_size", "conv_kernel", "layer_types", "num_key_value_heads", "head_size",
                  "tie_word_embeddings", "qk_norm", "norm_epsilon"):
        assert getattr(from_gguf, field) == getattr(c, field), field


# the form of LiquidAI/LFM2-8B-A1B's config.json
LFM2_8B_A1B = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "conv_L_cache": 3,
               "conv_bias": False, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
               "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8, "num_dense_layers": 2,
               "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True, "use_expert_bias": True,
               "routed_scaling_factor": 1.0, "norm_eps": 1e-05, "rope_theta": 1000000.0, "vocab_size": 65536,
               "max_position_embeddings": 128000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]}


def test_the_mixture_of_experts_config_and_its_gguf_keys_give_the_same_model():
    """LFM2-MoE: two dense layers, then 32 experts of 1792 features, 4 a token, chosen by sigmoid + a bias."""
    c = model_config_from_hf(LFM2_8B_A1B)
    assert (c.family, c.intermediate_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok) == (
        "lfm2_moe", 7168, 1792, 32, 4)
    assert (c.moe_dense_layers, c.moe_scoring, c.moe_selection_bias, c.moe_normalize_topk) == (2, "sigmoid", True, True)
    assert [c.has_experts(i) for i in range(3)] == [False, False, True] and c.layer_types.count("conv") == 18
    meta = {f"lfm2moe.{k}": v for k, v in {
        "embedding_length": 2048, "attention.head_count": 32, "block_count": 24, "feed_forward_length": 7168,
        "attention.head_count_kv": [0 if t == "conv" else 8 for t in LFM2_8B_A1B["layer_types"]],
        "rope.freq_base": 1e6, "context_length": 128000, "attention.layer_norm_rms_epsilon": 1e-5,
        "shortconv.l_cache": 3, "expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 1792,
        "leading_dense_block_count": 2, "expert_gating_func": 2}.items()}
    shapes = {"token_embd.weight": (65536, 2048), "blk.2.exp_probs_b.bias": (32,)}
    from_gguf = model_config_from_hf(hf_config(meta, "lfm2moe", GGUF_ARCHITECTURES["lfm2moe"], shapes, {}))
    for field in ("intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "layer_types",
                  "moe_dense_layers", "moe_scoring", "moe_selection_bias", "moe_normalize_topk", "moe_routed_scale",
                  "conv_kernel", "tie_word_embeddings"):
        assert getattr(from_gguf, field) == getattr(c, field), field


@pytest.fixture(scope="module")
def lfm2(random_hf_model, engine_from_hf):
    from transformers import AutoModelForCausalLM

    hf_dir = random_hf_model("lfm2")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return hf, engine_from_hf(hf_dir, **RUNTIME_ENGINE_OPTIONS)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


PROMPTS = [list(range(3, 40)), [7, 11, 13] * 5, list(range(100, 121))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_chunked_batched_decoding_matches_hf_and_convolution_groups_hold_a_window(lfm2):
    """Three prompts prefilled 8 tokens a step beside each other's decode steps: each one's greedy tokens are HF's.
    The convolution groups (window 3) hold at most 2 blocks of a sequence at once, the attention group all of them."""
    hf, engine = lfm2
    core = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    assert core.kv.windows == (None, 3, 3, 3)
    held = []
    update = core.scheduler.update

    def recording(*args, **kwargs):
        out = update(*args, **kwargs)
        held.extend([len([b for b in t if b >= 0]) for t in tables] for tables in core.kv.blocks.values())
        return out

    core.scheduler.update = recording
    tokens = drive(core, PROMPTS, GREEDY)[0]
    assert tokens == [hf_greedy(hf, p, 24) for p in PROMPTS]
    assert_pool_full(core)
    assert max(h[0] for h in held) == 8 and max(max(h[1:]) for h in held) == 2


def test_prefix_reuse_revives_the_convolution_state_inside_its_window(lfm2):
    hf, engine = lfm2
    core = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    first = drive(core, [PROMPTS[0]], GREEDY)[0]
    again, finals, _ = drive(core, [PROMPTS[0]], GREEDY)
    assert finals[0].metrics.num_prefix_cached_tokens == 32 and again == first == [hf_greedy(hf, PROMPTS[0], 24)]


def test_preemption_and_speculative_decoding_keep_the_tokens(lfm2):
    """16-token steps and a pool of 26 blocks: the longest request fits (its 10 attention blocks and 4 per convolution
    group), the three together do not, so requests are preempted and recomputed. Prompt-lookup speculation writes
    rejected tokens' rows, which later steps overwrite."""
    hf, engine = lfm2
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = [hf_greedy(hf, p, 40) for p in PROMPTS]
    small = EngineCore(engine, RuntimeConfig(num_threads=1, max_num_tokens=16, kv_cache_blocks=26, warm_up=False))
    tokens, _, stats = drive(small, PROMPTS, params)
    assert tokens == want and any(s.num_preempted for s in stats)
    spec = EngineCore(engine, RuntimeConfig(num_threads=1, speculative=SpeculativeConfig(3)))
    tokens, finals, _ = drive(spec, PROMPTS, params)
    assert tokens == want and sum(f.metrics.num_accepted_draft_tokens for f in finals) > 0


def test_beam_forks_copy_the_convolution_state_and_equal_hf_beams(lfm2):
    """3 beams over 12 tokens: forks share or copy their blocks in every group, the convolution groups' included;
    the answers are HF generate(num_beams=3)'s."""
    hf, engine = lfm2
    core = EngineCore(engine, RuntimeConfig(num_threads=1, max_prefill_chunk=8))
    _, finals, _ = drive(core, [PROMPTS[2]], SamplingParams(beam_width=3, max_tokens=12, ignore_eos=True))
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPTS[2]]), num_beams=3, num_return_sequences=3, do_sample=False,
                          max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert [list(b.token_ids) for b in finals[0].beams] == [seq[len(PROMPTS[2]):] for seq in out.tolist()]


def test_a_target_and_splits_without_convolutions_refuse_it_before_any_work(random_hf_model, tmp_path):
    hf_dir = random_hf_model("lfm2")
    config = model_config_from_hf(__import__("json").loads((hf_dir / "config.json").read_text()))
    with pytest.raises(TrtbuildError, match="short convolution layers have no tensorrt kernel yet; build it with "
                                            "--target cpu or cuda"):
        check_buildable(config, BuildConfig(target="tensorrt"))
    quantized_kv = dataclasses.replace(config, quantization=QuantConfig(kv_cache_quant_algo="int8"))
    with pytest.raises(TrtbuildError, match="without --kv-cache-qformat"):
        check_buildable(quantized_kv, BuildConfig())
    with pytest.raises(ConfigError, match="use --tp-size 1"):
        convert(hf_dir, tmp_path / "tp2", tp_size=2)
    assert not (tmp_path / "tp2").exists()


def test_verify_and_perplexity_run_it(lfm2, random_hf_model, tmp_path):
    """verify compares the native convolution with its standard-op lowering; eval lays out every group's blocks."""
    from trtbuild.bench.perplexity import evaluate
    from trtbuild.bench.verify import verify_engine

    convert(random_hf_model("lfm2"), tmp_path / "ckpt")
    report = verify_engine(lfm2[1], tmp_path / "ckpt", num_threads=1)
    assert report.passed, report.table()
    result = evaluate(lfm2[1], [(7 * i + 3) % 300 + 5 for i in range(150)], max_seq_len=64, num_threads=1)
    assert result.num_tokens == 149 and result.perplexity > 1


def test_the_vision_language_folder_converts_its_text_decoder(tmp_path):
    """LFM2-VL ships as Lfm2VlForConditionalGeneration: its text decoder (`model.language_model.*`) builds, and the
    engine's logits are the HF model's on text."""
    import numpy as np
    import transformers
    from helpers import RANDOM_CONFIGS, prefill_logits, save_with_nontrivial_norms

    from trtbuild.builder.build import build_engine

    text = dict(RANDOM_CONFIGS["lfm2"][1], model_type="lfm2")
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_patches=16, patch_size=16)
    torch.manual_seed(0)
    model = transformers.Lfm2VlForConditionalGeneration(transformers.Lfm2VlConfig(
        text_config=text, vision_config=vision, architectures=["Lfm2VlForConditionalGeneration"])).eval()
    save_with_nontrivial_norms(model, tmp_path / "hf")
    config = convert(tmp_path / "hf", tmp_path / "ckpt")
    assert config.architecture == "Lfm2ForCausalLM" and config.layer_types.count("conv") == 3
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, tokens_per_block=8)
    ids = np.random.default_rng(0).integers(3, 256, size=20).tolist()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(prefill_logits(engine, ids) - want).max() <= 1e-4 * np.abs(want).max()


def test_lora_adapters_of_every_linear_built_in_and_loaded_match_peft(random_hf_model, tmp_path):
    """A PEFT adapter of every linear (the convolution layers' in_proj / out_proj, the attention's q / k / v /
    out_proj, the MLP's w1 / w2 / w3): built into an engine, and loaded into a slot of another, the logits are PEFT's.
    An adapter that names a linear a layer lacks is refused."""
    import numpy as np
    from helpers import make_peft_adapter, peft_logits

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.lora import LoraError, read_adapter
    from trtbuild.runtime.engine import SequenceChunk, in_every_group

    hf_dir = random_hf_model("lfm2")
    adapter = make_peft_adapter(hf_dir, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    convert(hf_dir, tmp_path / "ckpt")
    ids = [3, 17, 42, 9, 100, 5, 77, 12, 60, 1, 250, 31]
    want, base = peft_logits(hf_dir, adapter, ids), peft_logits(hf_dir, None, ids)
    assert np.abs(want - base).max() > 0.1
    built = build_engine(tmp_path / "ckpt", tmp_path / "built", max_seq_len=64, tokens_per_block=8,
                         lora_adapters=(("a", str(adapter)),))
    slots = build_engine(tmp_path / "ckpt", tmp_path / "slots", max_seq_len=64, tokens_per_block=8, max_loras=2,
                         max_lora_rank=8)
    for engine, loaded in ((built, False), (slots, True)):
        core = EngineCore(engine, RuntimeConfig(num_threads=1, warm_up=False))
        if loaded:
            core.load_lora(core.lora.prepare("a", adapter))
        chunks = in_every_group([SequenceChunk(0, ids, 0, len(ids), [0, 1], lora_id=1)], 4, 8)
        np.testing.assert_allclose(core.engine.step(chunks), want, atol=2e-5, rtol=0)
    wrong = make_peft_adapter(hf_dir, tmp_path / "w", seed=1, r=4, lora_alpha=8, target_modules=["in_proj"],
                              layers_to_transform=[0]) / "adapter_model.safetensors"
    wrong.write_bytes(wrong.read_bytes().replace(b"layers.0.", b"layers.1."))  # layer 1 attends
    with pytest.raises(LoraError, match="layer 1 is a full_attention layer, which has no such linear"):
        read_adapter("w", tmp_path / "w", model_config_from_hf(__import__("json").loads(
            (hf_dir / "config.json").read_text())))
