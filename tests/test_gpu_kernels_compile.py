"""The CUDA target's Triton kernels compile for a real GPU (sm_90), checked without one (issue 17)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import trtbuild.gpu_kernels as gpu_kernels


def test_every_kernel_compiles_for_sm90_as_the_plan_launches_it():
    """tests/gpu_kernel_compile_check.py: each launcher's kernels, in the specializations engines use (float32 and
    bfloat16, GQA, split-K with sinks, softcap with a window, head size 8, an int8 pool, 4/8-bit and int8 weights,
    int8 x int8, experts with and without biases, LFM2's convolution, the gated DeltaNet and Mamba2 scans),
    through triton.compile to cubin."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[dev])")
    script = Path(__file__).with_name("gpu_kernel_compile_check.py")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    compiled = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok ")}
    # every launched kernel (a @triton.jit function named *_kernel) of every module
    kernels = set(re.findall(r"@triton\.jit\ndef (\w+_kernel)\(", "".join(
        f.read_text() for f in Path(gpu_kernels.__file__).parent.glob("*.py"))))
    assert len(kernels) == 12 and compiled == kernels, (compiled, kernels)
