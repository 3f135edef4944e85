"""One unquantized linear, trtbuild::DenseMatMul (cpu_ops/dense_matmul.cc) with float16, bfloat16 and float32
weights against ONNX Runtime's MatMul (MLAS SGEMM) on the same weights upcast to float32, at several token counts;
alternated rounds, medians.

    python benchmarks/dense_linear.py [--k 896] [--n 4864] [--tokens 1,4,16,64,256,1024] [--threads 2] [--rounds 7]

Prints, per token count, microseconds per call of each kernel and each native one's speed relative to MatMul
(> 1: native faster), and, at one token, the rate the float16 kernel streams its weights at.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from onnx import helper, numpy_helper
from quant_linear import session, timed_rounds

from trtbuild.plugins.dense_matmul import pack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=896)
    p.add_argument("--n", type=int, default=4864)
    p.add_argument("--tokens", default="1,4,16,64,256,1024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    k, n = args.k, args.n
    # NOTE: bfloat16 values of float16's range: exact in all three weight types, so every kernel has the same product
    w = (np.random.default_rng(0).standard_normal((n, k)) * 0.05).astype(ml_dtypes.bfloat16).astype(np.float32)
    native = helper.make_node("DenseMatMul", ["x", "B"], ["y"], domain="trtbuild", K=k, N=n)
    kernels = {f"native {t}": session(native, k, n, [numpy_helper.from_array(pack(w, t), "B")], args.threads)
               for t in ("float16", "bfloat16", "float32")}
    kernels["MatMul"] = session(helper.make_node("MatMul", ["x", "W"], ["y"]), k, n,
                                [numpy_helper.from_array(np.ascontiguousarray(w.T), "W")], args.threads)
    print(f"K={k} N={n} (weights exact in 16 bits), {args.threads} threads, {args.rounds} alternated rounds")
    for m, us, diff in timed_rounds(kernels, k, [int(t) for t in args.tokens.split(",")], args.rounds):
        line = "  ".join(f"{name} {t:7.0f} us" for name, t in us.items())
        ratios = " ".join(f"{us['MatMul'] / us[name]:.2f}x" for name in kernels if name != "MatMul")
        stream = f", fp16 streams {n * k * 2 / us['native float16'] / 1e3:.1f} GB/s" if m == 1 else ""
        print(f"M={m:4d}  {line}  native vs MatMul {ratios} (max rel. diff {diff:.1e}){stream}", flush=True)


if __name__ == "__main__":
    main()
