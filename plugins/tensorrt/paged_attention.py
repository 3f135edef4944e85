"""TensorRT AOT plugins for the attention half of `trtbuild::PagedAttention` (builder/tensorrt/plan.py splits the
node): `trtbuild::PagedAttentionKernel` (rotary=0, 7 inputs) and `trtbuild::RotaryPagedAttentionKernel` (rotary=1,
10 inputs: q is rotated in the kernel, K arrives rotated from `trtbuild::RotaryK`). One output, attn_out [T, H*D].

The kernel is gpu_kernels/paged_attention.py's, compiled to PTX for this GPU per node and tactic (a tile size), launched
by TensorRT over (sequences, query tiles of the longest possible run, KV heads). Written against TensorRT 10's
`tensorrt.plugin`; never run (no TensorRT here)."""

from __future__ import annotations

from typing import Any

from trtbuild.builder.tensorrt.plan import ATTENTION_PLUGIN, NAMESPACE, ROTARY_ATTENTION_PLUGIN

# tactic id -> (block_m, block_n), the launcher's tile knobs; TensorRT times each and keeps the fastest
TACTICS: dict[int, tuple[int, int]] = {1: (16, 64), 2: (16, 32), 3: (32, 64), 4: (64, 64)}
NUM_WARPS = 4
_registered: set[str] = set()


def io_types(rotary: bool) -> str:
    """AutoTuneCombination's type string: q, k_new, v, kv_cache float32; metadata int64; [pos int64, cos, sin];
    then attn_out."""
    types = ["FP32"] * 4 + ["INT64"] * 3 + (["INT64", "FP32", "FP32"] if rotary else []) + ["FP32"]
    return ", ".join(types)


def cuda_arch() -> int:
    """The build GPU's compute capability as Triton names it (90 for sm_90): an engine is tied to it anyway."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def _constant(expr: Any, what: str) -> int:
    if not expr.is_constant:
        raise ValueError(f"{what} must be fixed in every optimization profile (builder/tensorrt/plan.py)")
    return int(expr.constant_value())


def _aot(q: Any, kv_cache: Any, block_tables: Any, attrs: dict[str, Any], rotary: bool, tactic: int) -> tuple:
    import tensorrt.plugin as trtp

    from trtbuild.plugins.tensorrt import kernels

    shape = kernels.AttentionShape(
        layer_idx=attrs["layer_idx"], num_heads=attrs["num_heads"], num_kv_heads=attrs["num_kv_heads"],
        head_size=attrs["head_size"], tokens_per_block=_constant(kv_cache.shape_expr[4], "kv_cache dim 4"),
        max_blocks_per_seq=_constant(block_tables.shape_expr[1], "block_tables dim 1"),
        num_layers=_constant(kv_cache.shape_expr[1], "kv_cache dim 1"), scale=attrs["scale"], rotary=rotary)
    block_m, block_n = TACTICS.get(tactic, TACTICS[1])
    constexprs = kernels.attention_constexprs(shape, block_m, block_n)
    fn = kernels.trt_paged_attention_rotary if rotary else kernels.trt_paged_attention
    compiled = kernels.compile_ptx(fn, kernels.attention_signature(shape), constexprs, cuda_arch(), NUM_WARPS)
    tokens = q.shape_expr[0]
    launch = trtp.KernelLaunchParams()
    launch.grid_x = block_tables.shape_expr[0]
    # NOTE: the longest new-token run is data, not a shape: T bounds it, and tiles past a sequence's run return
    launch.grid_y = trtp.cdiv(tokens, constexprs["BLOCK_Q"])
    launch.grid_z = shape.num_kv_heads
    launch.block_x = compiled.metadata.num_warps * 32
    launch.shared_mem = compiled.metadata.shared
    extra = trtp.SymIntExprs(1)
    extra[0] = trtp.SymInt32(tokens)
    return compiled.metadata.name, compiled.asm["ptx"], launch, extra


def register() -> None:
    """Register both attention plugins with TensorRT's plugin registry (idempotent)."""
    if ATTENTION_PLUGIN in _registered:
        return
    import tensorrt.plugin as trtp

    plain, rotary = f"{NAMESPACE}::{ATTENTION_PLUGIN}", f"{NAMESPACE}::{ROTARY_ATTENTION_PLUGIN}"
    Desc = trtp.TensorDesc  # noqa: N806 (a type, as the decorators read the annotations)

    @trtp.register(plain)
    def _plain_desc(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                    query_start_loc: Desc, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int,
                    tokens_per_block: int, scale: float) -> Desc:
        return q.like()

    @trtp.autotune(plain)
    def _plain_tune(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                    query_start_loc: Desc, outputs: tuple[Desc]) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(io_types(False), "LINEAR", list(TACTICS))]

    @trtp.aot_impl(plain)
    def _plain_aot(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                   query_start_loc: Desc, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int,
                   tokens_per_block: int, scale: float, outputs: tuple[Desc], tactic: int) -> tuple:
        attrs = {"layer_idx": layer_idx, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                 "head_size": head_size, "scale": scale}
        return _aot(q, kv_cache, block_tables, attrs, False, tactic)

    @trtp.register(rotary)
    def _rotary_desc(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                     query_start_loc: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc, layer_idx: int,
                     num_heads: int, num_kv_heads: int, head_size: int, tokens_per_block: int,
                     scale: float) -> Desc:
        return q.like()

    @trtp.autotune(rotary)
    def _rotary_tune(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                     query_start_loc: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc,
                     outputs: tuple[Desc]) -> list[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination(io_types(True), "LINEAR", list(TACTICS))]

    @trtp.aot_impl(rotary)
    def _rotary_aot(q: Desc, k_new: Desc, v: Desc, kv_cache: Desc, block_tables: Desc, past_lengths: Desc,
                    query_start_loc: Desc, position_ids: Desc, rope_cos: Desc, rope_sin: Desc, layer_idx: int,
                    num_heads: int, num_kv_heads: int, head_size: int, tokens_per_block: int, scale: float,
                    outputs: tuple[Desc], tactic: int) -> tuple:
        attrs = {"layer_idx": layer_idx, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                 "head_size": head_size, "scale": scale}
        return _aot(q, kv_cache, block_tables, attrs, True, tactic)

    _registered.add(ATTENTION_PLUGIN)
