"""The Triton kernels of gpu_kernels/paged_attention.py behind the calling convention of a TensorRT AOT plugin: the
kernel's runtime parameters are the plugin's input pointers, then its extra scalar arguments, then its output
pointers. Everything else (shapes, strides, scale) is fixed per node, so it is compiled in as constexprs.

`compile_ptx` compiles one of them for a GPU architecture (no GPU needed: PTX only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from trtbuild.gpu_kernels.paged_attention import LOG2E, MIN_DOT, _paged_attention_kernel, _rope_k_kernel

TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@triton.jit
def trt_rotary_k(k_ptr, pos_ptr, cos_ptr, sin_ptr, num_tokens, out_ptr, KV_HEADS: tl.constexpr,
                 HALF_D: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr):
    if tl.program_id(0) < num_tokens:
        _rope_k_kernel(k_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, KV_HEADS, HALF_D, KV_HEADS * 2 * HALF_D,
                       KV_HEADS * 2 * HALF_D, HALF_D, HALF_D, HEADS, HALF)


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
            LAYER: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF_D: tl.constexpr,
            BS: tl.constexpr, W: tl.constexpr, LAYERS: tl.constexpr, QK_SCALE: tl.constexpr, GROUP: tl.constexpr,
            GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
            ROTARY: tl.constexpr, PRECISION: tl.constexpr):
    head = 2 * HALF_D
    slot = BS * head
    # the pool [NB, L, 2, KVH, BS, D], contiguous: this layer's view starts LAYER * 2 * KVH * BS * D in
    _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, cache_ptr + LAYER * 2 * KV_HEADS * slot, tables_ptr, past_ptr, qsl_ptr, pos_ptr,
        cos_ptr, sin_ptr, q_ptr, out_ptr, out_ptr, out_ptr, out_ptr, QK_SCALE, 1.0, 1.0, HALF_D, BS, HEADS,
        0, 0.0,  # no window, no softcap, no sinks (builder/tensorrt/plan.py refuses all three)
        HEADS * head, KV_HEADS * head, head, KV_HEADS * head, head, HEADS * head,
        LAYERS * 2 * KV_HEADS * slot, KV_HEADS * slot, slot, head, W, HALF_D, HALF_D,
        GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, HALF, ROTARY, PRECISION, 1, False, False, False)


@triton.jit
def trt_paged_attention_rotary(q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, pos_ptr, cos_ptr,
                               sin_ptr, num_tokens, out_ptr, LAYER: tl.constexpr, HEADS: tl.constexpr,
                               KV_HEADS: tl.constexpr, HALF_D: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
                               LAYERS: tl.constexpr, QK_SCALE: tl.constexpr, GROUP: tl.constexpr,
                               GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                               HALF: tl.constexpr, PRECISION: tl.constexpr):
    _attend(q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
            LAYER, HEADS, KV_HEADS, HALF_D, BS, W, LAYERS, QK_SCALE, GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, HALF, True,
            PRECISION)


@triton.jit
def trt_paged_attention(q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, num_tokens, out_ptr,
                        LAYER: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF_D: tl.constexpr,
                        BS: tl.constexpr, W: tl.constexpr, LAYERS: tl.constexpr, QK_SCALE: tl.constexpr,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        HALF: tl.constexpr, PRECISION: tl.constexpr):
    # rotary=0: the rope pointers are never read (ROTARY is a constexpr False), any valid pointer will do
    _attend(q_ptr, k_ptr, v_ptr, cache_ptr, tables_ptr, past_ptr, qsl_ptr, past_ptr, q_ptr, q_ptr, out_ptr,
            LAYER, HEADS, KV_HEADS, HALF_D, BS, W, LAYERS, QK_SCALE, GROUP, GROUP_PAD, BLOCK_Q, BLOCK_N, HALF, False,
            PRECISION)


@dataclass(frozen=True)
class AttentionShape:
    """What one attention plugin node's kernel is compiled for (plugin attributes + the pool's fixed dims)."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    tokens_per_block: int
    max_blocks_per_seq: int
    num_layers: int
    scale: float
    rotary: bool
    dtype: str = "float32"

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def attention_constexprs(s: AttentionShape, block_m: int, block_n: int) -> dict[str, Any]:
    """The constexprs of trt_paged_attention(_rotary) for one node and one tile tactic (as the launcher picks
    them in gpu_kernels/paged_attention.py)."""
    group_pad = triton.next_power_of_2(s.group)
    half = s.head_size // 2
    return {"LAYER": s.layer_idx, "HEADS": s.num_heads, "KV_HEADS": s.num_kv_heads, "HALF_D": half,
            "BS": s.tokens_per_block, "W": s.max_blocks_per_seq, "LAYERS": s.num_layers,
            "QK_SCALE": float(s.scale * LOG2E), "GROUP": s.group, "GROUP_PAD": group_pad,
            "BLOCK_Q": max(1, block_m // group_pad), "BLOCK_N": max(MIN_DOT, block_n),
            "HALF": max(MIN_DOT, triton.next_power_of_2(half)),
            "PRECISION": "ieee" if s.dtype == "float32" else "tf32"}


def attention_signature(s: AttentionShape) -> dict[str, str]:
    """Runtime parameter types in plugin order: inputs (int64 metadata), the extra arg, the output."""
    f = "*" + TRITON_TYPES[s.dtype]
    names = ["q_ptr", "k_ptr", "v_ptr", "cache_ptr"]
    sig = dict.fromkeys(names, f)
    sig.update({"tables_ptr": "*i64", "past_ptr": "*i64", "qsl_ptr": "*i64"})
    if s.rotary:
        sig.update({"pos_ptr": "*i64", "cos_ptr": f, "sin_ptr": f})
    sig.update({"num_tokens": "i32", "out_ptr": f})
    return sig


def rotary_k_constexprs(num_kv_heads: int, head_size: int) -> dict[str, Any]:
    half = head_size // 2
    return {"KV_HEADS": num_kv_heads, "HALF_D": half, "HEADS": triton.next_power_of_2(num_kv_heads),
            "HALF": max(MIN_DOT, triton.next_power_of_2(half))}


def rotary_k_signature(dtype: str = "float32") -> dict[str, str]:
    f = "*" + TRITON_TYPES[dtype]
    return {"k_ptr": f, "pos_ptr": "*i64", "cos_ptr": f, "sin_ptr": f, "num_tokens": "i32", "out_ptr": f}


def compile_ptx(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int,
                num_warps: int = 4) -> Any:
    """triton.compile of one wrapper for sm_{arch}: the compiled kernel (metadata.name, asm["ptx"]). TensorRT
    passes only the plugin's own arguments, so a kernel that needs Triton's global scratch memory is refused."""
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    if getattr(compiled.metadata, "global_scratch_size", 0):
        raise RuntimeError(f"{compiled.metadata.name} needs {compiled.metadata.global_scratch_size} bytes of "
                           "Triton global scratch memory, which a TensorRT AOT plugin does not provide")
    return compiled
