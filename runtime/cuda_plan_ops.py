"""The kernels a CUDA plan's steps name (builder/cuda_plan.py), over torch tensors on one device.

Each op takes the step's input tensors, its attributes and the loaded kernel modules, and returns its outputs. The
Triton kernels run compiled on a GPU, or in Triton's interpreter on CPU tensors (gpu_kernels/load.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

Kernels = dict[str, ModuleType]
Op = Callable[..., tuple[torch.Tensor, ...]]


def gather_rows(k: Kernels, a: dict[str, Any], x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows of x: an activation's selected tokens, or (plan kernel `embedding`) the embedding table's token ids."""
    return (x.index_select(0, rows),)


def rmsnorm(k: Kernels, a: dict[str, Any], x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RMSNorm over the last axis; a per-head norm (Qwen3's q/k, [T, heads, D]) runs as [T * heads, D] rows."""
    out, _ = k["rmsnorm"].add_rmsnorm(x.reshape(-1, x.shape[-1]), weight, a["eps"])
    return (out.reshape(x.shape),)


def add_rmsnorm(k: Kernels, a: dict[str, Any], x: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return k["rmsnorm"].add_rmsnorm(x, weight, a["eps"], residual=residual)


def layernorm(k: Kernels, a: dict[str, Any], x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """LayerNorm over the last axis with a weight, and a bias or none (Cohere's), computed in float32."""
    bias = None if bias is None else bias.float()
    return (F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias, a["eps"]).to(x.dtype),)


def linear(k: Kernels, a: dict[str, Any], x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x @ W^T with W [out, in]: cuBLAS on a GPU (float32, float16, bfloat16)."""
    return (F.linear(x, weight),)


def weight_only_linear(k: Kernels, a: dict[str, Any], x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       zero_points: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    t = a.get("tactics", {})
    return (k["weight_only_gemm"].weight_only_gemm(x, codes, scales, zero_points, **t),)


def int8_linear(k: Kernels, a: dict[str, Any], x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                w_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """SmoothQuant's W8A8: x quantized with its (static or per-token) scale, int8 x int8 in gpu_kernels/int8_gemm.py."""
    return (k["int8_gemm"].int8_gemm(x, x_scale, weight, w_scale),)


@functools.cache
def _scaled_mm_runs(device: torch.device) -> bool:
    """torch._scaled_mm's e4m3 GEMM: on the CPU, and on GPUs of compute capability 8.9 and up (asked once a device,
    not every step)."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(k: Kernels, a: dict[str, Any], x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
               w_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x quantized to e4m3 (x / s_x saturated to +-448, as ONNX QuantizeLinear), times the e4m3 weight [N, K]:
    torch._scaled_mm (float32 accumulation, both scales applied after) where it runs, else the same products in
    float32 (GPUs before compute capability 8.9, and dimensions that are not multiples of 16)."""
    xq = (x.float() / x_scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    n_out, k_in = weight.shape
    if _scaled_mm_runs(x.device) and n_out % 16 == 0 and k_in % 16 == 0:
        return (torch._scaled_mm(xq, weight.t(), scale_a=x_scale.reshape(()), scale_b=w_scale.reshape(()),
                                 out_dtype=x.dtype),)
    return (((xq.float() @ weight.float().t()) * (x_scale * w_scale)).to(x.dtype),)


def add(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x + y,)


def mul(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Elementwise: a LoRA branch's mask (builder/lora.py)."""
    return (x * y,)


def concat(k: Kernels, a: dict[str, Any], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.cat(xs, dim=a["axis"]),)


def split(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.split(x, a["sizes"], dim=a["axis"]))


def reshape(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    shape = [x.shape[i] if d == 0 else d for i, d in enumerate(a["shape"])]  # ONNX: 0 keeps that dimension
    return (x.reshape(shape),)


def swiglu(k: Kernels, a: dict[str, Any], gate_up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (k["swiglu"].swiglu(gate_up),)


def silu_mul(k: Kernels, a: dict[str, Any], gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.silu(gate) * up,)


def geglu(k: Kernels, a: dict[str, Any], gate_up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (k["swiglu"].geglu(gate_up),)


def gelu_mul(k: Kernels, a: dict[str, Any], gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.gelu(gate, approximate=a["approximate"]) * up,)


def gelu(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (F.gelu(x, approximate=a["approximate"]),)


def tanh(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.tanh(x),)


def relu(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.relu(x),)


def sigmoid(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.sigmoid(x),)


def div(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x / y,)


def sub(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x - y,)


def minimum(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.minimum(x, y.to(x.dtype)),)


def greater(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x > y,)


def where(k: Kernels, a: dict[str, Any], condition: torch.Tensor, x: torch.Tensor,
          y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.where(condition, x, y),)


def exp(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.exp(x),)


def maximum(k: Kernels, a: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.maximum(x, y.to(x.dtype)),)


def abs(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: A001 (ONNX's name)
    return (torch.abs(x),)


def reduce_max(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.amax(x, dim=a["axes"], keepdim=a["keepdims"]),)


def log(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.log(x),)


def topk(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    values, indices = torch.topk(x, a["k"], dim=a["axis"])
    return values, indices


def gather_elements(k: Kernels, a: dict[str, Any], x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.gather(x, a["axis"], index),)


def scatter_elements(k: Kernels, a: dict[str, Any], x: torch.Tensor, index: torch.Tensor,
                     updates: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.scatter(x, a["axis"], index, updates.to(x.dtype)),)


def reduce_sum(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x.sum(dim=a["axes"], keepdim=a["keepdims"]),)


def full_like(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x's shape and dtype filled with a constant (ONNX Expand of a scalar to Shape(x))."""
    return (torch.full_like(x, a["value"]),)


def scale(k: Kernels, a: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x times a constant scalar: Gemma's embedding multiplier, and the two around its final-logit Tanh."""
    return (x * a["value"],)


def paged_attention(k: Kernels, a: dict[str, Any], q: torch.Tensor, key: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, block_tables: torch.Tensor, past_lengths: torch.Tensor,
                    query_start_loc: torch.Tensor, *extra: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`extra`: position_ids, rope_cos, rope_sin (rotary), then the sinks when attribute `sinks` is set (so the sinks
    are last whether or not the node rotates). NOTE: `max_query_len` comes from the host (the engine knows it), so
    the launch never reads it back."""
    sinks, extra = (extra[-1], extra[:-1]) if a.get("sinks") else (None, extra)
    position_ids, rope_cos, rope_sin = extra or (None, None, None)
    return k["paged_attention"].paged_attention(
        q, key, v, kv_cache, block_tables, past_lengths, query_start_loc, layer_idx=a["layer_idx"],
        num_heads=a["num_heads"], num_kv_heads=a["num_kv_heads"], head_size=a["head_size"], scale=a["scale"],
        position_ids=position_ids, rope_cos=rope_cos, rope_sin=rope_sin, max_query_len=a["max_query_len"],
        window=a.get("window", 0), softcap=a.get("softcap", 0.0), sinks=sinks,
        kv_cache_quant_algo=a.get("kv_cache_quant_algo"), kv_cache_scale=a.get("kv_cache_scale"),
        **a.get("tactics", {}))


def kv_write(k: Kernels, a: dict[str, Any], kv_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This step's K/V of one layer into their pool slots, [T, KVH, D] each: O(T), on the device. An int8 pool
    (`kv_cache_scale` (K scale, V scale)) stores round(x / scale), half to even, clipped to +-127, as
    runtime/kv_cache.py: quantize_kv does for the CPU engine."""
    block_size = kv_cache.shape[4]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    layer = a["layer_idx"]
    scales = a.get("kv_cache_scale")
    for i, x in enumerate((k_new, v_new)):
        if scales is not None:  # NOTE: float32 division, whatever the compute dtype: the CPU engine's values
            x = torch.round(x.float() / scales[i]).clamp_(-127, 127)
        kv_cache[blocks, layer, i, :, offsets] = x.to(kv_cache.dtype)
    return ()


def short_conv(k: Kernels, a: dict[str, Any], x: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               past_lengths: torch.Tensor, query_start_loc: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """LFM2's convolution over this step's rows and the pool's (`max_query_len` from the host, as attention's)."""
    return (k["short_conv"].paged_short_conv(x, kv_cache, block_tables, past_lengths, query_start_loc, weight, bias,
                                             layer_idx=a["layer_idx"], max_query_len=a["max_query_len"]),)


def conv_write(k: Kernels, a: dict[str, Any], kv_cache: torch.Tensor, x: torch.Tensor,
               slot_mapping: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k["short_conv"].write_rows(kv_cache, x, slot_mapping, a["layer_idx"])
    return ()


def gated_delta(k: Kernels, a: dict[str, Any], *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3.5's linear attention over the engine's recurrent states (updated in place)."""
    return (k["recurrent"].gated_delta(*args, state_layer=a["state_layer"], epsilon=a["epsilon"],
                                       tiled=bool(a.get("tiled", 0))),)


def mamba2_scan(k: Kernels, a: dict[str, Any], *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A Mamba2 layer's scan over the engine's recurrent states (updated in place)."""
    return (k["recurrent"].mamba2_scan(*args, state_layer=a["state_layer"], num_groups=a["num_groups"],
                                       epsilon=a["epsilon"]),)


def moe(k: Kernels, a: dict[str, Any], x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
        down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A mixture of experts' output for the normalized hidden states x and the router's logits."""
    return (k["fused_moe"].fused_moe(x, logits, gate_up, down, a["k"], a["normalize"], gate_up_bias, down_bias,
                                     a["alpha"], a["beta"], a["limit"], **a.get("tactics", {})),)


def speculative_accept(k: Kernels, a: dict[str, Any], logits: torch.Tensor, accept_rows: torch.Tensor,
                       draft_tokens: torch.Tensor, draft_lens: torch.Tensor, temperatures: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return k["speculative_accept"].speculative_accept(logits, accept_rows, draft_tokens, draft_lens, temperatures,
                                                      uniforms)


OPS: dict[str, Op] = {f.__name__: f for f in (
    gather_rows, rmsnorm, add_rmsnorm, layernorm, linear, weight_only_linear, add, mul, concat, split, reshape, swiglu,
    silu_mul, geglu, gelu_mul, gelu, tanh, relu, sigmoid, log, topk, gather_elements, scatter_elements, reduce_sum,
    full_like, scale, paged_attention, kv_write, short_conv, conv_write, moe, speculative_accept, int8_linear,
    fp8_linear, div, maximum, abs, reduce_max, sub, minimum, greater, where, exp, gated_delta, mamba2_scan)}
OPS["embedding"] = gather_rows
