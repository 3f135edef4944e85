"""Frozen, typed configuration: one class per concept (model, mapping, quantization, build)."""

from trtbuild.configs.build_config import LORA_IDS_INPUT, BuildConfig, lora_index
from trtbuild.configs.kv_groups import (
    KVCacheGroup,
    batch_blocks_needed,
    cache_layers,
    group_input,
    kv_cache_groups,
    layer_slot,
    max_blocks_held,
    num_cache_layers,
    slots_per_block,
)
from trtbuild.configs.model_config import Mapping, ModelConfig
from trtbuild.configs.quant_config import QuantConfig

__all__ = ["LORA_IDS_INPUT", "BuildConfig", "KVCacheGroup", "Mapping", "ModelConfig", "QuantConfig",
           "batch_blocks_needed", "cache_layers", "group_input", "kv_cache_groups", "layer_slot", "lora_index",
           "max_blocks_held", "num_cache_layers", "slots_per_block"]
