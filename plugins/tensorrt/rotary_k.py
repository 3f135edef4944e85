"""TensorRT AOT plugin `trtbuild::RotaryK`: the new tokens' K rotated once (rotate-half RoPE) into k_new
[T, KVH, D], the PagedAttention contract's second output, which the rotary attention plugin then reads. Kernel:
gpu_kernels/paged_attention.py's `_rope_k_kernel`, one program per token. Written against TensorRT 10's
`tensorrt.plugin`; never run (no TensorRT here)."""

from __future__ import annotations

from typing import Any

from trtbuild.builder.tensorrt.plan import NAMESPACE, ROTARY_K_PLUGIN

NUM_WARPS = 1
IO_TYPES = "FP32, INT64, FP32, FP32, FP32"  # k, position_ids, rope_cos, rope_sin -> k_new
_registered: set[str] = set()


def register() -> None:
    """Register the plugin with TensorRT's plugin registry (idempotent)."""
    if ROTARY_K_PLUGIN in _registered:
        return
    import tensorrt.plugin as trtp

    from trtbuild.plugins.tensorrt.paged_attention import cuda_arch

    name = f"{NAMESPACE}::{ROTARY_K_PLUGIN}"
    Desc = trtp.TensorDesc  # noqa: N806 (a type, as the decorators read the annotations)

    @trtp.register(name)
    def _desc(k: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc, num_kv_heads: int,
              head_size: int) -> Desc:
        out = k.like()
        out.shape_expr = trtp.ShapeExprs.from_tuple((k.shape_expr[0], num_kv_heads, head_size))
        return out

    @trtp.autotune(name)
    def _tune(k: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc,
              outputs: tuple[Desc]) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(IO_TYPES, "LINEAR")]

    @trtp.aot_impl(name)
    def _aot(k: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc, num_kv_heads: int, head_size: int,
             outputs: tuple[Desc], tactic: int) -> tuple[str, Any, Any, Any]:
        from trtbuild.plugins.tensorrt import kernels

        compiled = kernels.compile_ptx(kernels.trt_rotary_k, kernels.rotary_k_signature(),
                                       kernels.rotary_k_constexprs(num_kv_heads, head_size), cuda_arch(), NUM_WARPS)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = k.shape_expr[0]
        launch.block_x = compiled.metadata.num_warps * 32
        launch.shared_mem = compiled.metadata.shared
        extra = trtp.SymIntExprs(1)
        extra[0] = trtp.SymInt32(k.shape_expr[0])
        return compiled.metadata.name, compiled.asm["ptx"], launch, extra

    _registered.add(ROTARY_K_PLUGIN)
