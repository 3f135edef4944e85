"""Run in a fresh interpreter by tests/test_gpu_kernels_compile.py: every Triton kernel of the CUDA target
(gpu_kernels/), reached through its Python launcher as the CUDA plan calls it, compiled for sm_90 (PTX and cubin
through the ptxas Triton ships) without a GPU and without launching. The interpreter the other kernel tests run in
accepts programs the compiler refuses (tile shapes, dtypes of tl.dot, loop-carried types), so this is the CPU's
only check that the kernels build for a GPU. Prints one line per compiled specialization, then `compiled N`; exits
1 if any failed. A separate process because triton.jit reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8", torch.int8: "*i8", torch.float64: "*fp64"}
compiled: dict[tuple, int] = {}
failed: list[str] = []


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


def compile_instead_of_launch(self, *args, grid, warmup=False, **kwargs):
    """JITFunction.run's stand-in: the launch's signature and constexprs, compiled for sm_90 once each."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    bound = self.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    constexprs = {p.name: values[p.name] for p in self.params if p.is_constexpr}
    signature = {p.name: "constexpr" if p.is_constexpr else _type(values[p.name]) for p in self.params}
    key = (self.fn.__name__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()))
    if key in compiled:
        return
    try:
        src = triton.compiler.ASTSource(fn=self, signature=signature, constexprs=constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        compiled[key] = kernel.metadata.shared
        print("ok", self.fn.__name__, constexprs, "shared", kernel.metadata.shared, flush=True)
    except Exception as e:  # noqa: BLE001 (reported, then the run fails)
        failed.append(self.fn.__name__)
        print("FAIL", self.fn.__name__, constexprs, signature, "".join(traceback.format_exception(e))[-2000:],
              flush=True)


JITFunction.run = compile_instead_of_launch

from trtbuild.gpu_kernels.load import load_kernels  # noqa: E402

K = load_kernels(interpret=False)


def attention(dtype: torch.dtype, heads: int, kv_heads: int, d: int, rotary: bool = True, int8: bool = False,
              **options) -> None:
    tokens = 5  # a 4-token prefill chunk and a decode token
    q = torch.zeros(tokens, heads * d, dtype=dtype)
    k, v = torch.zeros(tokens, kv_heads * d, dtype=dtype), torch.zeros(tokens, kv_heads * d, dtype=dtype)
    pool = torch.zeros(8, 2, 2, kv_heads, 16, d, dtype=torch.int8 if int8 else dtype)
    rope = dict(position_ids=torch.arange(tokens), rope_cos=torch.zeros(64, d // 2, dtype=dtype),
                rope_sin=torch.zeros(64, d // 2, dtype=dtype)) if rotary else {}
    quant = dict(kv_cache_quant_algo="int8", kv_cache_scale=(0.1, 0.1)) if int8 else {}
    K["paged_attention"].paged_attention(
        q, k, v, pool, torch.zeros(2, 4, dtype=torch.int64), torch.tensor([3, 0]), torch.tensor([0, 1, 5]),
        layer_idx=1, num_heads=heads, num_kv_heads=kv_heads, head_size=d, scale=0.125, max_query_len=4, **rope,
        **quant, **options)


for dtype in (torch.float32, torch.bfloat16):
    attention(dtype, 9, 3, 64)  # SmolLM2-135M's heads
    attention(dtype, 14, 2, 64, block_n=128, num_splits=4, sinks=torch.zeros(14))  # split-K, gpt-oss's sinks
    attention(dtype, 4, 4, 128, rotary=False, softcap=30.0, window=8, block_n=32)  # Gemma 2's softcap and window
    attention(dtype, 8, 2, 8)  # stories260K's head size 8 (tiles padded to 16)
    x = torch.zeros(3, 576, dtype=dtype)
    K["rmsnorm"].add_rmsnorm(x, torch.zeros(576, dtype=dtype), 1e-5, residual=torch.zeros_like(x))
    K["swiglu"].swiglu(torch.zeros(3, 2 * 1536, dtype=dtype))
    K["weight_only_gemm"].weight_only_gemm(x, torch.zeros(1536, 288, dtype=torch.uint8), torch.zeros(1536, 18))
    # a mixture of experts (8 experts, 2 a token), then gpt-oss's biased experts and clamped SwiGLU
    moe = [torch.zeros(3, 576, dtype=dtype), torch.zeros(3, 8), torch.zeros(8, 512, 576, dtype=dtype),
           torch.zeros(8, 576, 256, dtype=dtype)]
    K["fused_moe"].fused_moe(*moe, 2, True)
    K["fused_moe"].fused_moe(*moe, 2, True, torch.zeros(8, 512, dtype=dtype), torch.zeros(8, 576, dtype=dtype),
                             1.702, 1.0, 7.0, block_n=128, block_k=64)
    K["int8_gemm"].int8_gemm(x, torch.tensor([0.02]), torch.zeros(1536, 576, dtype=torch.int8), torch.zeros(1536))
    # LFM2-1.2B's convolution: rows of 2048 over 2 slots of 8 x 2 x 64
    K["short_conv"].paged_short_conv(
        torch.zeros(5, 2048, dtype=dtype), torch.zeros(8, 6, 2, 8, 16, 64, dtype=dtype),
        torch.zeros(2, 4, dtype=torch.int64), torch.tensor([3, 0]), torch.tensor([0, 1, 5]), torch.zeros(2048, 3),
        layer_idx=2, max_query_len=4)
    # Qwen3.5-0.8B's gated DeltaNet (16 + 16 heads of 128; tiled as a GGUF's), Granite 4.0-H's Mamba2 (64 heads of 64,
    # state 128, one group)
    K["recurrent"].gated_delta(
        torch.zeros(5, 6144, dtype=dtype), torch.zeros(5, 2048, dtype=dtype), torch.zeros(5, 16, dtype=dtype),
        torch.zeros(5, 16, dtype=dtype), torch.zeros(16), torch.zeros(16), torch.zeros(128),
        torch.zeros(3, 18, 16, 128, 128), torch.tensor([0, 1]), torch.tensor([3, 0]), torch.tensor([0, 1, 5]),
        state_layer=2, epsilon=1e-6, tiled=True)
    K["recurrent"].mamba2_scan(
        torch.zeros(5, 4352, dtype=dtype), torch.zeros(5, 4096, dtype=dtype), torch.zeros(5, 64, dtype=dtype),
        torch.zeros(64), torch.zeros(64), torch.zeros(64), torch.zeros(4096), torch.zeros(3, 36, 64, 64, 128),
        torch.tensor([0, 1]), torch.tensor([3, 0]), torch.tensor([0, 1, 5]), state_layer=2, num_groups=1,
        epsilon=1e-5)
attention(torch.float16, 4, 2, 64, int8=True)
x = torch.zeros(3, 576, dtype=torch.bfloat16)
K["rmsnorm"].add_rmsnorm(x, torch.zeros(576, dtype=torch.bfloat16), 1e-5)
K["swiglu"].geglu(torch.zeros(3, 2 * 1536, dtype=torch.bfloat16))
K["weight_only_gemm"].weight_only_gemm(x, torch.zeros(1536, 576, dtype=torch.uint8), torch.zeros(1536, 1),
                                       torch.zeros(1536, 1))
K["weight_only_gemm"].weight_only_gemm(x, torch.zeros(1536, 576, dtype=torch.int8), torch.zeros(1536))
K["speculative_accept"].speculative_accept(
    torch.zeros(6, 49152, dtype=torch.bfloat16), torch.tensor([0, 3]), torch.zeros(2, 2, dtype=torch.int64),
    torch.tensor([2, 1]), torch.tensor([0.0, 0.8]), torch.zeros(2, 3))
print("compiled", len(compiled))
sys.exit(1 if failed else 0)
