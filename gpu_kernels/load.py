"""Import the kernel modules for the GPU, or for Triton's interpreter (CPU tensors, no GPU).

NOTE: triton.jit picks interpreter or GPU compilation when it decorates, from TRITON_INTERPRET, so the variable is
set only while the kernel modules (and triton's own library, on its first import) are imported, as
tests/conftest.py does for the test session; a module decorated the other way is imported again.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from trtbuild.errors import TrtbuildError

KERNEL_MODULES = ("fused_moe", "int8_gemm", "paged_attention", "recurrent", "rmsnorm", "short_conv",
                  "speculative_accept", "swiglu", "weight_only_gemm")


def _interpreted(module: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(v, InterpretedFunction) for v in vars(module).values())


def patch_interpreter_for_numpy() -> None:
    """Triton 3.6's interpreter turns a runtime loop bound into an int with int(1-element array), which numpy >= 2.4
    refuses (triton-lang/triton#9171, fixed after 3.6 by squeezing). Applied once, in interpreter mode only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "trtbuild_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.trtbuild_patched = True
    interpreter._patch_lang_tensor = patched


def load_kernels(interpret: bool) -> dict[str, ModuleType]:
    """{name: module} of KERNEL_MODULES, decorated for the interpreter (`interpret`) or for the GPU."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if interpret:
            import triton.experimental.gluon  # noqa: F401  (the interpreter imports it at the first launch)

        if interpret and not isinstance(tl.standard.sigmoid, InterpretedFunction):
            raise TrtbuildError("triton was imported for the GPU before the CUDA engine could load it for its "
                               "interpreter (there is no GPU here); set TRITON_INTERPRET=1 before starting")
        mods = {}
        for name in KERNEL_MODULES:
            full = f"trtbuild.gpu_kernels.{name}"
            mod = sys.modules.get(full) or importlib.import_module(full)
            mods[name] = importlib.reload(mod) if _interpreted(mod) != interpret else mod
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    if interpret:
        patch_interpreter_for_numpy()
    return mods
