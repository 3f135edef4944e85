"""One 4/8-bit linear, trtbuild::BlockQuantMatMul (cpu_ops/block_matmul.cc) against ONNX Runtime's MatMulNBits
(accuracy level 4: int8 activations too) on the same random codes and scales, at several token counts; alternated
rounds, medians. The native op runs with float16 scales (as GGUF's Q4_0 / Q8_0 files give them) and float32 ones.
`--bits 5`: 8-bit codes within 16 of 128 (GGUF's Q5_0 as converted), the native op over them narrowed to 5 bits
(what an engine holds) and packed as 8 bits, both with float16 scales.

    python benchmarks/quant_linear.py [--k 896] [--n 4864] [--bits 4] [--block 32] [--tokens 1,4,16,64,256]
        [--threads 2] [--rounds 7]

Prints, per token count, microseconds per call of each kernel and the speed of the native op relative to
MatMulNBits (> 1: native faster), and, at one token, the rate the native op streams its weights at.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from trtbuild import cpu_ops
from trtbuild.plugins.block_quant_matmul import narrow, pack


def session(node: onnx.NodeProto, k: int, n: int, inits: list, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("trtbuild", 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # NOTE: the kernels' sessions alternate in one process: a pool still spinning after its run would steal a core
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timed_rounds(kernels: dict[str, ort.InferenceSession], k: int, token_counts: list[int], rounds: int,
                 seed: int = 0) -> Iterator[tuple[int, dict[str, float], float]]:
    """Per token count: (M, median microseconds per call of each kernel, max difference from the last kernel's
    output relative to its largest value), rounds alternated (each round starts with the next kernel)."""
    rng = np.random.default_rng(seed)
    names = list(kernels)
    for m in token_counts:
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = [kernels[name].run(None, {"x": x})[0] for name in names]
        diff = max(float(np.abs(y - ys[-1]).max()) for y in ys) / float(np.abs(ys[-1]).max())
        reps = max(3, 200 // m)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start = time.perf_counter()
                for _ in range(reps):
                    kernels[name].run(None, {"x": x})
                times[name].append((time.perf_counter() - start) / reps * 1e6)
        yield m, {name: statistics.median(t) for name, t in times.items()}, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=896)
    p.add_argument("--n", type=int, default=4864)
    p.add_argument("--bits", type=int, choices=(4, 5, 8), default=4)
    p.add_argument("--block", type=int, choices=(16, 32), default=32)
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    k, n, bits, block = args.k, args.n, args.bits, args.block
    rng = np.random.default_rng(0)
    stored = 8 if bits == 5 else bits  # the checkpoint's (MatMulNBits') codes
    codes = rng.integers(112, 144, (n, k), dtype=np.uint8) if bits == 5 else \
        rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    nbits = ((codes[:, 0::2] | (codes[:, 1::2] << 4)) if bits == 4 else codes).reshape(n, k // block, -1)
    scales = (rng.random(n * k // block, dtype=np.float32) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    narrowed, packed_bits = narrow(codes, stored)  # 5-bit: the codes less 112; else as they are
    assert packed_bits == bits
    b, s16 = pack(narrowed, scales, bits)[:2]
    attrs = dict(K=k, N=n, block_size=block)

    def native(codes_b: np.ndarray, s: np.ndarray, packed: int) -> ort.InferenceSession:
        node = helper.make_node("BlockQuantMatMul", ["x", "B", "S"], ["y"], domain="trtbuild", bits=packed, **attrs)
        return session(node, k, n, [numpy_helper.from_array(codes_b, "B"), numpy_helper.from_array(s, "S")],
                       args.threads)

    second = {"native 8-bit packing": native(pack(codes, scales, 8).codes, s16, 8)} if bits == 5 else \
        {"native fp32 scales": native(b, s16.astype(np.float32), bits)}
    kernels = {
        "native fp16 scales": native(b, s16, bits),
        **second,
        "MatMulNBits": session(helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft",
                                                accuracy_level=4, bits=stored, **attrs), k, n,
                               [numpy_helper.from_array(nbits, "B"), numpy_helper.from_array(scales, "S")],
                               args.threads),
    }
    print(f"K={k} N={n} {bits}-bit blocks of {block}, {args.threads} threads, {args.rounds} alternated rounds")
    for m, us, diff in timed_rounds(kernels, k, [int(t) for t in args.tokens.split(",")], args.rounds):
        line = "  ".join(f"{name} {t:8.0f} us" for name, t in us.items())
        ratio = us["MatMulNBits"] / us["native fp16 scales"]
        rate = (b.nbytes + s16.nbytes) / us["native fp16 scales"] / 1e3
        stream = f", native streams {rate:.1f} GB/s" if m == 1 else ""
        print(f"M={m:4d}  {line}  native/MatMulNBits {ratio:.2f}x (max rel. diff {diff:.1e}){stream}",
              flush=True)


if __name__ == "__main__":
    main()
