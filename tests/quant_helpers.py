"""Test helpers for quantized engines: write a quantized checkpoint with numpy (the format of docs/quantization.md,
simple absmax scales), and a float64 numpy reference of a Llama/Qwen2 decoder that applies each format's math and
the quantized KV cache exactly as the engine's step semantics imply (importable as `quant_helpers`)."""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from trtbuild.builder.convert.checkpoint import CONFIG_FILE, copy_tokenizer_files, load_checkpoint, save_rank
from trtbuild.configs.quant_config import QuantConfig
from trtbuild.quantization import pack_int4, unpack_int4

LINEARS = ("attention.q", "attention.k", "attention.v", "attention.dense", "mlp.gate", "mlp.fc", "mlp.proj")
_HF_NAMES = {"attention.q": "self_attn.q_proj", "attention.k": "self_attn.k_proj", "attention.v": "self_attn.v_proj",
             "attention.dense": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj",
             "mlp.proj": "mlp.down_proj"}
BOUND = {"fp8": 448.0, "int8": 127.0}


def fp8_round(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fake_quant(x: np.ndarray, scale: float, kind: str, narrow: bool = False) -> np.ndarray:
    """quantize(x / scale) and back, with the division in float32 as ONNX Runtime does it."""
    y = (x.astype(np.float32) / np.float32(scale)).astype(np.float64)
    q = fp8_round(y) if kind == "fp8" else np.clip(np.rint(y), -127 if narrow else -128, 127)
    return q * np.float64(np.float32(scale))


def calibrate(hf_dir: Path, ids: list[int]) -> dict[str, float]:
    """amax of every linear's input (keyed by checkpoint prefix) and of K / V projections' outputs (`{i}.k|v`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for ours, hf in _HF_NAMES.items():
            module = layer.get_submodule(hf)
            prefix = f"transformer.layers.{i}.{ours}"
            hooks.append(module.register_forward_hook(
                lambda m, args, out, p=prefix: amax.update({p: float(args[0].abs().max()), p + ".out": float(
                    out.abs().max())})))
    hooks.append(model.lm_head.register_forward_hook(lambda m, args, out: amax.update(
        {"lm_head": float(args[0].abs().max())})))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def quantize_checkpoint(src: Path, dst: Path, algo: str | None, kv_algo: str | None, amax: dict[str, float],
                        group_size: int = 32, exclude: tuple[str, ...] = ("lm_head",), shared_prequant: bool = True,
                        seed: int = 0, per_token: bool = False, lm_head_int8: bool = False) -> Path:
    """Quantize checkpoint `src` into `dst` in the format of docs/quantization.md (absmax scales); `lm_head_int8`:
    lm_head (excluded from `algo`) gets int8 weight-only (int8_wo) per-channel scales."""
    config, tensors = load_checkpoint(src)
    rng = np.random.default_rng(seed)
    out = dict(tensors)
    layers = config.num_hidden_layers
    for i in range(layers + 1):  # the extra round is lm_head
        prequants = {}  # Q/K/V and gate/up read one tensor: equal pre-scales let the engine merge their kernels
        for name in LINEARS if i < layers else ("lm_head",):
            p = f"transformer.layers.{i}.{name}" if i < layers else name
            if algo is None or any(fnmatch.fnmatchcase(p, e) for e in exclude):
                continue
            w = tensors[p + ".weight"].double().numpy()
            shared = {"attention.q": "qkv", "attention.k": "qkv", "attention.v": "qkv", "mlp.gate": "gate_up",
                      "mlp.fc": "gate_up"}.get(name) if shared_prequant else None
            s = prequants.setdefault(shared or p, rng.uniform(0.5, 2.0, w.shape[1]))
            t = {}
            if algo == "fp8":
                wscale = np.abs(w).max() / 448
                t["weight"] = torch.from_numpy(fp8_round(w / wscale).astype(np.float32)).to(torch.float8_e4m3fn)
                t["weights_scaling_factor"] = torch.tensor(wscale, dtype=torch.float32)
                t["activation_scaling_factor"] = torch.tensor(amax[p] / 448, dtype=torch.float32)
            elif algo == "int4_awq":
                wp = (w / s).reshape(w.shape[0], -1, group_size)
                scale = np.abs(wp).max(axis=2) / 7
                q = np.clip(np.rint(wp / scale[:, :, None]), -8, 7).reshape(w.shape).astype(np.int8)
                t["weight"] = torch.from_numpy(pack_int4(q))
                t["weights_scaling_factor"] = torch.from_numpy(scale.astype(np.float32))
                t["prequant_scaling_factor"] = torch.from_numpy(s.astype(np.float32))
            else:  # int8_sq
                wp = w / s
                scale = np.abs(wp).max(axis=1) / 127
                t["weight"] = torch.from_numpy(np.clip(np.rint(wp / scale[:, None]), -127, 127).astype(np.int8))
                t["weights_scaling_factor"] = torch.from_numpy(scale.astype(np.float32))
                if not per_token:  # per token: the scale is computed from each token at run time
                    xs_amax = amax[p] * s.max()
                    t["activation_scaling_factor"] = torch.tensor(xs_amax / 127, dtype=torch.float32)
                t["prequant_scaling_factor"] = torch.from_numpy(s.astype(np.float32))
            out.update({f"{p}.{k}": v for k, v in t.items()})
        if kv_algo and i < layers:
            k_amax = amax[f"transformer.layers.{i}.attention.k.out"] * 1.2  # RoPE mixes pairs of K values
            v_amax = amax[f"transformer.layers.{i}.attention.v.out"]
            out[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.tensor(
                [k_amax / BOUND[kv_algo], v_amax / BOUND[kv_algo]], dtype=torch.float32)
    if lm_head_int8:
        w = tensors["lm_head.weight"].double().numpy()
        scale = np.abs(w).max(axis=1) / 127
        out["lm_head.weight"] = torch.from_numpy(np.rint(w / scale[:, None]).astype(np.int8))
        out["lm_head.weights_scaling_factor"] = torch.from_numpy(scale.astype(np.float32))
    # the flag states the truth: fp8 weight scales are per linear here, so only prequant formats can share
    quant = QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv_algo,
                        group_size=group_size if algo == "int4_awq" else None,
                        pre_quant_scale=algo in ("int4_awq", "int8_sq"), exclude_modules=exclude if algo else (),
                        shared_input_scales=shared_prequant and algo in ("int4_awq", "int8_sq") and not per_token,
                        per_token_activations=per_token, lm_head_quant_algo="int8_wo" if lm_head_int8 else None)
    dst.mkdir(parents=True)
    save_rank(dst, 0, out)
    copy_tokenizer_files(src, dst)
    dataclasses.replace(config, quantization=quant).save(dst / CONFIG_FILE)
    return dst


class Reference:
    """A float64 numpy decoder over checkpoint tensors with each format's math, stepping like CpuEngine.step; with a
    quantized KV cache every key and value attended (past or this chunk's own) is the stored one, dequantized."""

    def __init__(self, config, tensors: dict[str, torch.Tensor]) -> None:
        self.c, self.q = config, config.quantization
        self.t = tensors
        self.past: dict[object, list[list[np.ndarray]]] = {}
        self.kv_scales = None
        if self.q.kv_cache_quant_algo:
            self.kv_scales = [self.f(f"transformer.layers.{i}.attention.kv_cache_scaling_factor")
                              for i in range(config.num_hidden_layers)]
        d = config.head_size
        inv_freq = 1.0 / (config.rotary_base ** (np.arange(0, d, 2, dtype=np.float64) / d))
        self.inv_freq = inv_freq.astype(np.float32).astype(np.float64)

    def f(self, name: str) -> np.ndarray:
        return self.t[name].double().numpy()

    def linear(self, x: np.ndarray, p: str) -> np.ndarray:
        if p + ".weights_scaling_factor" not in self.t:
            y = x @ self.f(p + ".weight").T
        else:
            w, wscale = self.t[p + ".weight"], self.f(p + ".weights_scaling_factor")
            if p + ".prequant_scaling_factor" in self.t:
                x = x * self.f(p + ".prequant_scaling_factor")
            algo = self.q.algo_of(p)
            if algo == "int8_wo":
                y = x @ (w.double().numpy() * wscale[:, None]).T
            elif algo == "fp8":
                x = fake_quant(x, self.f(p + ".activation_scaling_factor"), "fp8")
                y = x @ (w.double().numpy() * wscale).T
            elif algo == "int4_awq":
                q = unpack_int4(w.numpy()).astype(np.int64)
                y = x @ (q * np.repeat(wscale, self.q.group_size, axis=1)).T
            else:
                if self.q.per_token_activations:  # max |x| of each token / 127, in float32 as the engine
                    amax = np.maximum(np.abs(x.astype(np.float32)).max(-1, keepdims=True), np.float32(1e-30))
                    ascale = (amax / np.float32(127)).astype(np.float32)
                else:
                    ascale = self.f(p + ".activation_scaling_factor")
                xq = fake_quant(x, ascale, "int8") / ascale.astype(np.float32)
                y = (xq @ w.double().numpy().T) * (np.float64(np.float32(ascale)) * wscale)
        return y + self.f(p + ".bias") if p + ".bias" in self.t else y

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.c.norm_epsilon) * self.f(name)

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:  # x [T, heads, D]
        angles = (positions[:, None].astype(np.float32) * self.inv_freq[None].astype(np.float32)).astype(np.float64)
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)

    def store(self, x: np.ndarray, layer: int, which: int) -> np.ndarray:
        if self.kv_scales is None:
            return x.astype(np.float32).astype(np.float64)
        return fake_quant(x, self.kv_scales[layer][which], self.q.kv_cache_quant_algo, narrow=True)

    def chunk(self, seq, ids: list[int], start: int, num_logits: int) -> np.ndarray:
        c = self.c
        past = self.past.setdefault(seq, [[np.zeros((0, c.num_key_value_heads, c.head_size))] * 2
                                          for _ in range(c.num_hidden_layers)])
        assert past[0][0].shape[0] == start
        n, pos = len(ids), np.arange(start, start + len(ids))
        x = self.f("transformer.vocab_embedding.weight")[ids]
        group = c.num_attention_heads // c.num_key_value_heads
        mask = np.where(np.arange(start + n)[None, :] <= pos[:, None], 0.0, -np.inf)
        for i in range(c.num_hidden_layers):
            p = f"transformer.layers.{i}."
            h = self.norm(x, p + "input_layernorm.weight")
            q = self.rope(self.linear(h, p + "attention.q").reshape(n, -1, c.head_size), pos)
            k = self.rope(self.linear(h, p + "attention.k").reshape(n, -1, c.head_size), pos)
            v = self.linear(h, p + "attention.v").reshape(n, -1, c.head_size)
            k, v = self.store(k, i, 0), self.store(v, i, 1)  # attention reads every K/V as the cache holds it
            keys, values = np.concatenate([past[i][0], k]), np.concatenate([past[i][1], v])
            keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, keys) * c.head_size**-0.5 + mask
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            attn = np.einsum("hts,shd->thd", probs / probs.sum(-1, keepdims=True), values).reshape(n, -1)
            past[i] = [np.concatenate([past[i][0], k]), np.concatenate([past[i][1], v])]
            x = x + self.linear(attn, p + "attention.dense")
            h = self.norm(x, p + "post_layernorm.weight")
            gate, up = self.linear(h, p + "mlp.gate"), self.linear(h, p + "mlp.fc")
            x = x + self.linear(gate / (1 + np.exp(-gate)) * up, p + "mlp.proj")
        h = self.norm(x[n - num_logits:], "transformer.ln_f.weight")
        return self.linear(h, "lm_head")

    def step(self, chunks) -> np.ndarray:
        return np.concatenate([self.chunk(c.seq_id, c.token_ids, c.start, c.num_logits) for c in chunks])


def compare_logits(result, ckpt: Path, source: Path, ids: torch.Tensor) -> tuple[float, float, float]:
    """(weights-path error, full error / quantization error (max), same (mean)) of the checkpoint's reference model
    against modelopt's simulated model."""
    from trtbuild.quantize.reference import reference_model, weights_only
    from trtbuild.quantize.source import build_torch_model, read_source

    sim = result.model
    with torch.no_grad():
        with weights_only(sim):
            sim_w = sim(ids).logits
        ref_w = reference_model(ckpt, activations=False, kv_cache=False)(ids).logits
        sim_full, ref_full = sim(ids).logits, reference_model(ckpt)(ids).logits
        fp32 = build_torch_model(read_source(source))(ids).logits
    weights = ((sim_w - ref_w).abs().max() / sim_w.abs().max()).item()
    d, qerr = (sim_full - ref_full).abs(), (sim_full - fp32).abs()
    return weights, (d.max() / qerr.max()).item(), (d.mean() / qerr.mean()).item()


def quantize_random(family: str, work: Path, qformat: str, kv: str | None = None, from_checkpoint: bool = False,
                    **options) -> tuple:
    """A tiny random `family` model (tests/helpers.py, vocab 512, stories260K's tokenizer) quantized by `trtbuild
    quantize` from its HF folder, or from its `trtbuild convert` checkpoint: (QuantizeResult, checkpoint, HF folder)."""
    import shutil

    from helpers import STORIES260K, make_random_hf_model, require_shared_models

    from trtbuild.builder.convert.convert import convert
    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize

    require_shared_models()
    hf = make_random_hf_model(family, work / "hf", overrides={"vocab_size": 512})
    shutil.copy(STORIES260K / "tokenizer.json", hf / "tokenizer.json")
    if from_checkpoint:
        convert(hf, work / "plain")
    result = quantize(QuantizeOptions(work / "plain" if from_checkpoint else hf, work / "ckpt", qformat,
                                      kv_cache_qformat=kv, calib_size=8, calib_max_seq_len=64, **options))
    return result, work / "ckpt", hf


def assert_computes_simulation(result, ckpt: Path, hf: Path) -> None:
    """The checkpoint, rebuilt from itself alone, computes modelopt's simulated model (test_quantize's bounds)."""
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    weights, full_max, full_mean = compare_logits(result, ckpt, hf, ids)
    assert weights <= 1e-4 and full_max <= 0.3 and full_mean <= 0.15, (weights, full_max, full_mean)
