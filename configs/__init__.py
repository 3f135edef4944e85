"""Frozen, typed configuration: one class per concept (model, mapping, quantization, build)."""

from trtbuild.configs.build_config import BuildConfig
from trtbuild.configs.model_config import Mapping, ModelConfig, QuantConfig

__all__ = ["BuildConfig", "Mapping", "ModelConfig", "QuantConfig"]
