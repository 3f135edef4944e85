"""One 3/4/5/6/8-bit linear, trtbuild::BlockQuantMatMul (cpu_ops/block_matmul.cc) against ONNX Runtime's MatMulNBits
(accuracy level 4: int8 activations too) on the same random codes and scales, at several token counts; alternated
rounds, medians. The native op runs with float16 scales (as GGUF's Q4_0 / Q8_0 files give them) and float32 ones.
`--bits 3 / 5 / 6`: 4-bit codes within 4 of 8 (GGUF's Q3_K as converted) or 8-bit codes within 16 / 32 of 128 (Q5_0,
Q6_K), which MatMulNBits takes as they are and the native op narrowed to 3 / 5 / 6 bits (what an engine holds), its
further bits as byte-mask planes and packed as the base (`high_bits`: plugins/block_quant_matmul.py).

    python benchmarks/quant_linear.py [--k 896] [--n 4864] [--bits 4] [--block 32] [--tokens 1,4,16,64,256]
        [--threads 2] [--rounds 7] [--compare-library OLD.so]

Prints, per token count, microseconds per call of each kernel and the speed of the native op relative to
MatMulNBits (> 1: native faster), with 3/5/6 bits the packed layout's speed relative to the planes', with
`--compare-library` (a copy of an earlier build of the library) the current library's speed relative to that one's
on the same table, and, at one token, the rate the native op streams its weights at.
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
from trtbuild.plugins.block_quant_matmul import PackedTable, narrow, pack


def session(node: onnx.NodeProto, k: int, n: int, inits: list, threads: int,
            library: str | None = None) -> ort.InferenceSession:
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("trtbuild", 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    # NOTE: the kernels' sessions alternate in one process: a pool still spinning after its run would steal a core
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(library or str(cpu_ops.library_path()))
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


NARROWED = {3: (4, 4, 12), 5: (8, 112, 144), 6: (8, 96, 160)}  # bits: (MatMulNBits' bits, the codes' range)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=896)
    p.add_argument("--n", type=int, default=4864)
    p.add_argument("--bits", type=int, choices=(3, 4, 5, 6, 8), default=4)
    p.add_argument("--block", type=int, choices=(16, 32), default=32)
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compare-library", help="an earlier build of the library, run on the same table")
    args = p.parse_args()
    k, n, bits, block = args.k, args.n, args.bits, args.block
    rng = np.random.default_rng(0)
    stored, low, high = NARROWED.get(bits, (bits, 0, 1 << bits))  # the checkpoint's (MatMulNBits') codes
    codes = rng.integers(low, high, (n, k), dtype=np.uint8)
    nbits = ((codes[:, 0::2] | (codes[:, 1::2] << 4)) if stored == 4 else codes).reshape(n, k // block, -1)
    scales = (rng.random(n * k // block, dtype=np.float32) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    narrowed, packed_bits = narrow(codes, stored)  # 3/5/6-bit: the codes less 4, 112 or 96; else as they are
    assert packed_bits == bits
    current = str(cpu_ops.library_path())
    attrs = dict(K=k, N=n, block_size=block)

    def native(table: PackedTable, library: str = current) -> ort.InferenceSession:
        node = helper.make_node("BlockQuantMatMul", ["x", "B", "S"], ["y"], domain="trtbuild", bits=bits, **attrs,
                                **table.attributes())
        return session(node, k, n, [numpy_helper.from_array(table.codes, "B"),
                                    numpy_helper.from_array(table.scales, "S")], args.threads, library)

    planes = pack(narrowed, scales, bits)
    kernels = {"native fp16 scales": native(planes)}
    if bits in NARROWED:
        kernels["native packed high bits"] = native(pack(narrowed, scales, bits, high_bits="packed"))
    else:
        kernels["native fp32 scales"] = native(planes._replace(scales=planes.scales.astype(np.float32)))
    if args.compare_library:
        kernels["compared library"] = native(planes, args.compare_library)
    kernels["MatMulNBits"] = session(
        helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", accuracy_level=4,
                         bits=stored, **attrs), k, n,
        [numpy_helper.from_array(nbits, "B"), numpy_helper.from_array(scales, "S")], args.threads)
    print(f"K={k} N={n} {bits}-bit blocks of {block}, {args.threads} threads, {args.rounds} alternated rounds")
    for m, us, diff in timed_rounds(kernels, k, [int(t) for t in args.tokens.split(",")], args.rounds):
        line = "  ".join(f"{name} {t:8.0f} us" for name, t in us.items())
        ratios = [f"native/MatMulNBits {us['MatMulNBits'] / us['native fp16 scales']:.2f}x"]
        if "native packed high bits" in us:
            ratios.append(f"packed/planes {us['native fp16 scales'] / us['native packed high bits']:.2f}x")
        if "compared library" in us:
            ratios.append(f"current/compared library {us['compared library'] / us['native fp16 scales']:.2f}x")
        rate = (planes.codes.nbytes + planes.scales.nbytes) / us["native fp16 scales"] / 1e3
        stream = f", native streams {rate:.1f} GB/s" if m == 1 else ""
        print(f"M={m:4d}  {line}  {', '.join(ratios)} (max rel. diff {diff:.1e}){stream}", flush=True)


if __name__ == "__main__":
    main()
