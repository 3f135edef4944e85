"""The blocks with a recurrent state per sequence (builder/network.py). Qwen3.5's linear attention (gated DeltaNet):
q, k and v projected together and convolved over each channel's last `conv_kernel` tokens by a
trtbuild::PagedShortConv node (its rows in the pool, as LFM2's), then one trtbuild::GatedDeltaNet node
(plugins/gated_delta.py) that runs the gated delta rule over the sequences' states and applies the gated RMSNorm;
out_proj. Granite 4.0-H's Mamba2: in_proj to z, x | B | C and dt, the same convolution of x | B | C, one
trtbuild::Mamba2Scan node (plugins/mamba2.py), out_proj. The convolutions' rows for the pool join new_kv."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trtbuild.builder.graph import GraphBuilder
from trtbuild.configs import ModelConfig
from trtbuild.plugins import gated_delta as gd
from trtbuild.plugins import mamba2
from trtbuild.plugins import short_conv as sc


class LinearAttentionWriter:
    """The linear attention part of _NetworkWriter (which sets these attributes and defines the methods below)."""

    c: ModelConfig
    g: GraphBuilder

    if TYPE_CHECKING:
        def linear(self, x: str, prefix: str, bias: bool = False, outputs: list[str] | None = None) -> str: ...

        def row_linear(self, x: str, prefix: str, bias: bool = False) -> str: ...

        def tensor(self, name: str) -> np.ndarray: ...

        def pool_rows(self, entries: str, prefix: str) -> str: ...  # ConvWriter's

    def linear_attention(self, h: str, layer: str, cache: list[str], slot: int, state: list[str],
                         state_layer: int) -> tuple[str, str]:
        """(the block's output, its convolution's new pool rows [entries * 2 * T, kv_heads, head_size]) for the
        normed input `h` of layer `layer` (`transformer.layers.{i}.`); `cache`: the pool, the layer's group's block
        table, past_lengths and query_start_loc; `slot`: its rows' first cache layer in the group's blocks; `state`:
        the recurrent_state, state_slots and state_checkpoints inputs; `state_layer`: the layer's index among the
        recurrent ones."""
        c, g, prefix = self.c, self.g, layer + "linear_attn."
        qkv = self.linear(h, prefix + "in_proj_qkv")
        kernel = g.weight(prefix + "conv.weight", self.tensor(prefix + "conv.weight"))
        mixed, entries = g.op(sc.OP_TYPE, [qkv, *cache, kernel], num_outputs=2, domain=sc.DOMAIN,
                              name=prefix + "conv", layer_idx=slot)
        z, b, a = (self.linear(h, prefix + name) for name in ("in_proj_z", "in_proj_b", "in_proj_a"))
        params = [g.weight(prefix + name, self.tensor(prefix + name)) for name in ("A", "dt_bias", "norm.weight")]
        recurrent, slots, checkpoints = state
        y = g.op(gd.OP_TYPE, [mixed, z, b, a, *params, recurrent, slots, *cache[2:], checkpoints], domain=gd.DOMAIN,
                 name=prefix + "delta", state_layer=state_layer, epsilon=float(c.norm_epsilon),
                 tiled=int(c.linear_value_heads_tiled))
        return self.row_linear(y, prefix + "out_proj"), self.pool_rows(entries, prefix)

    def mamba(self, h: str, layer: str, cache: list[str], slot: int, state: list[str], state_layer: int
              ) -> tuple[str, str]:
        """As linear_attention, for a Mamba2 layer."""
        c, g, prefix = self.c, self.g, layer + "mamba."
        inner, heads = c.mamba_inner_size, c.mamba_num_heads
        channels = inner + 2 * c.mamba_num_groups * c.mamba_state_size
        projected = self.linear(h, prefix + "in_proj", bias=c.mamba_proj_bias)
        z, xbc, dt = g.op("Split", [projected, g.const(np.array([inner, channels, heads]), prefix + "split_sizes")],
                          axis=-1, num_outputs=3, name=prefix + "split")
        taps = [g.weight(prefix + "conv.weight", self.tensor(prefix + "conv.weight"))]
        taps += [g.weight(prefix + "conv.bias", self.tensor(prefix + "conv.bias"))] if c.mamba_conv_bias else []
        mixed, entries = g.op(sc.OP_TYPE, [xbc, *cache, *taps], num_outputs=2, domain=sc.DOMAIN, name=prefix + "conv",
                              layer_idx=slot)
        params = [g.weight(prefix + name, self.tensor(prefix + name)) for name in ("A", "dt_bias", "D", "norm.weight")]
        recurrent, slots, checkpoints = state
        y = g.op(mamba2.OP_TYPE, [mixed, z, dt, *params, recurrent, slots, *cache[2:], checkpoints],
                 domain=mamba2.DOMAIN, name=prefix + "scan", state_layer=state_layer, num_groups=c.mamba_num_groups,
                 epsilon=float(c.norm_epsilon))
        return self.row_linear(y, prefix + "out_proj", bias=c.mamba_proj_bias), self.pool_rows(entries, prefix)
