"""LFM2's short convolution block (builder/network.py): in_proj to B, C and x; B * x convolved over each channel's last
`conv_kernel` tokens by one trtbuild::PagedShortConv node, whose state is in the paged pool (plugins/short_conv.py);
C times that; out_proj. The node's rows for the pool join new_kv as the layer's cache layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trtbuild.builder.graph import GraphBuilder
from trtbuild.configs import ModelConfig
from trtbuild.plugins import short_conv as sc


class ConvWriter:
    """The convolution part of _NetworkWriter (which sets these attributes and defines `linear` and `row_linear`)."""

    c: ModelConfig
    g: GraphBuilder

    if TYPE_CHECKING:
        def linear(self, x: str, prefix: str, bias: bool = False, outputs: list[str] | None = None) -> str: ...

        def row_linear(self, x: str, prefix: str, bias: bool = False) -> str: ...

        def tensor(self, name: str) -> np.ndarray: ...

    def short_conv(self, h: str, layer: str, cache: list[str], slot: int) -> tuple[str, str]:
        """(the block's output, its new pool rows [entries * 2 * T, kv_heads, head_size]) for the normed input `h` of
        layer `layer` (`transformer.layers.{i}.`); `cache`: the pool, the layer's group's block table, past_lengths
        and query_start_loc inputs; `slot`: its first cache layer's slot in the group's blocks."""
        c, g, prefix = self.c, self.g, layer + "conv."
        hidden = c.hidden_size
        bcx = self.linear(h, prefix + "in_proj", bias=c.conv_bias)
        b, gate, x = g.op("Split", [bcx, g.const(np.array([hidden] * 3), "conv_split")], axis=-1, num_outputs=3,
                          name=prefix + "split")
        bx = g.op("Mul", [b, x], name=prefix + "bx")
        kernel = g.weight(prefix + "kernel.weight", self.tensor(prefix + "kernel.weight"))
        bias = [g.weight(prefix + "kernel.bias", self.tensor(prefix + "kernel.bias"))] if c.conv_bias else []
        conv, entries = g.op(sc.OP_TYPE, [bx, *cache, kernel, *bias], num_outputs=2, domain=sc.DOMAIN,
                             name=prefix + "paged", layer_idx=slot)
        y = g.op("Mul", [gate, conv], name=prefix + "gated")
        return self.row_linear(y, prefix + "out_proj", bias=c.conv_bias), self.pool_rows(entries, prefix)

    def pool_rows(self, entries: str, prefix: str) -> str:
        """A convolution's new entries (PagedShortConv's) as rows of new_kv [entries * 2 * T, kv_heads, head_size]."""
        c = self.c
        return self.g.op("Reshape", [entries, self.g.const(np.array([-1, c.num_key_value_heads, c.head_size]),
                                                           "entry_rows")], name=prefix + "new_rows")
