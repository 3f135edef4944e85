"""ModelConfig's checks of its recurrent layers' fields (configs/model_config.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trtbuild.errors import CheckpointError

if TYPE_CHECKING:
    from trtbuild.configs.model_config import ModelConfig


def check_recurrent_fields(c: ModelConfig) -> None:
    """Refuse linear_attention or mamba layers without the sizes they need (or both kinds in one model), and
    mlp_free_layers that are not layer indices."""
    if not all(isinstance(i, int) and 0 <= i < c.num_hidden_layers for i in c.mlp_free_layers):
        raise CheckpointError(f"config.json: mlp_free_layers must list layer indices below num_hidden_layers "
                              f"({c.num_hidden_layers}), got {list(c.mlp_free_layers)}")
    linear = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
              c.linear_value_head_dim)
    if "linear_attention" in c.layer_types and not (
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in linear)
            and c.linear_num_value_heads % c.linear_num_key_heads == 0):
        raise CheckpointError(f"config.json: linear_attention layers need positive linear_num_key_heads, "
                              f"linear_num_value_heads (a multiple of the key heads), linear_key_head_dim and "
                              f"linear_value_head_dim; got {list(linear)}")
    mamba = (c.mamba_num_heads, c.mamba_head_dim, c.mamba_state_size, c.mamba_num_groups)
    if "mamba" in c.layer_types and not (
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in mamba)
            and c.mamba_num_heads % c.mamba_num_groups == 0 and "linear_attention" not in c.layer_types):
        raise CheckpointError(f"config.json: mamba layers need positive mamba_num_heads, mamba_head_dim, "
                              f"mamba_state_size and mamba_num_groups (dividing the heads), and no "
                              f"linear_attention layers beside them; got {list(mamba)}")
