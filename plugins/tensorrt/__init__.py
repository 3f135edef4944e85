"""TensorRT Python plugins (`tensorrt.plugin`, AOT) for our ops, one file per plugin; their kernels are the Triton
kernels of gpu_kernels/ compiled to PTX when TensorRT builds the engine. `register_all()` needs tensorrt; importing this
package does not."""

from __future__ import annotations


def register_all() -> None:
    """Register every plugin with TensorRT (once per process): call before parsing the network and before
    deserializing an engine that uses them."""
    from trtbuild.plugins.tensorrt import paged_attention, rotary_k

    rotary_k.register()
    paged_attention.register()
