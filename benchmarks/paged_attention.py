"""trtbuild::PagedAttention (cpu_ops/paged_attention.cc) in the Qwen2.5-0.5B shape (14 query heads, 2 KV heads, head
size 64, 16-token blocks), one node per layer of a 24-layer pool as in the engine: decode steps of B sequences with
a past of P tokens each, and one prefill; alternated rounds, medians of microseconds per node (a run of all 24
nodes, divided by 24, so that session.run's own overhead hardly counts).

    python benchmarks/paged_attention.py [--batches 1,4,16] [--past 128] [--prefill 128] [--threads 2] [--rounds 7]
        [--compare-library OLD.so] [--float16-pool] [--sinks] [--softcap 50]

Prints microseconds per node of the current library on a float32 pool; with `--compare-library` (a copy of an
earlier build of the library) it runs the same calls through that library too, and with `--float16-pool` through
the current library on the same pool held in float16, and with `--sinks` through the current library with
attention sinks (gpt-oss's input 10), and prints the speed-ups (of the current library over the compared one; of the
float16 pool, or the sinks, over the plain float32 run; with both `--compare-library` and `--float16-pool`, of the
current library over the compared one on the float16 pool too) and the largest output differences.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from trtbuild import cpu_ops
from trtbuild.plugins import paged_attention as pa

HEADS, KV_HEADS, HEAD, BLOCK, LAYERS, MAX_POS = 14, 2, 64, 16, 24, 4096


def session(library: str, threads: int, pool_type: int, sinks: bool = False,
            softcap: float = 0.0) -> ort.InferenceSession:
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in (
        ("q", f32, ["T", HEADS * HEAD]), ("k", f32, ["T", KV_HEADS * HEAD]), ("v", f32, ["T", KV_HEADS * HEAD]),
        ("kv_cache", pool_type, ["NB", LAYERS, 2, KV_HEADS, BLOCK, HEAD]), ("block_tables", i64, ["B", "W"]),
        ("past_lengths", i64, ["B"]), ("query_start_loc", i64, ["B1"]), ("position_ids", i64, ["T"]),
        ("rope_cos", f32, [MAX_POS, HEAD // 2]), ("rope_sin", f32, [MAX_POS, HEAD // 2]))
        + ((("sinks", f32, [HEADS]),) if sinks else ())]
    nodes = [helper.make_node(pa.OP_TYPE, [i.name for i in inputs], [f"{o}{layer}" for o in pa.OUTPUTS],
                              domain=pa.DOMAIN, layer_idx=layer, num_heads=HEADS, num_kv_heads=KV_HEADS,
                              head_size=HEAD, tokens_per_block=BLOCK, scale=HEAD**-0.5, rotary=1,
                              **({"softcap": softcap} if softcap else {}))
             for layer in range(LAYERS)]
    outputs = [helper.make_tensor_value_info(o, f32, None) for n in nodes for o in n.output]
    model = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(pa.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds(seqs: list[tuple[int, int]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A packed step of (past, new tokens) per sequence, blocks shuffled over a pool just large enough."""
    width = max(-(-(p + n) // BLOCK) for p, n in seqs)
    blocks = rng.permutation(len(seqs) * width)
    tokens = sum(n for _, n in seqs)
    angles = np.arange(MAX_POS)[:, None] * 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)[None, :]
    return {"q": rng.standard_normal((tokens, HEADS * HEAD), dtype=np.float32),
            "k": rng.standard_normal((tokens, KV_HEADS * HEAD), dtype=np.float32),
            "v": rng.standard_normal((tokens, KV_HEADS * HEAD), dtype=np.float32),
            "kv_cache": rng.standard_normal((len(blocks), LAYERS, 2, KV_HEADS, BLOCK, HEAD), dtype=np.float32),
            "block_tables": blocks.reshape(len(seqs), width).astype(np.int64),
            "past_lengths": np.array([p for p, _ in seqs], dtype=np.int64),
            "query_start_loc": np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int64),
            "position_ids": np.concatenate([np.arange(p, p + n) for p, n in seqs]).astype(np.int64),
            "rope_cos": np.cos(angles).astype(np.float32), "rope_sin": np.sin(angles).astype(np.float32)}


def us_per_node(sess: ort.InferenceSession, feed: dict[str, np.ndarray], min_seconds: float = 0.3) -> float:
    sess.run(None, feed)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        sess.run(None, feed)
        calls += 1
    return elapsed / calls / LAYERS * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compare-library", help="an earlier build of the library, run on the same calls")
    p.add_argument("--float16-pool", action="store_true", help="also run the current library on a float16 pool")
    p.add_argument("--sinks", action="store_true", help="also run the current library with attention sinks")
    p.add_argument("--softcap", type=float, default=0.0, help="every run with this soft-cap of the scores (Gemma 2)")
    args = p.parse_args()
    current = str(cpu_ops.library_path())
    variants = {"current": (current, TensorProto.FLOAT)}
    if args.compare_library:
        variants["compared"] = (args.compare_library, TensorProto.FLOAT)
    if args.float16_pool:
        variants["float16 pool"] = (current, TensorProto.FLOAT16)
        if args.compare_library:
            variants["compared float16 pool"] = (args.compare_library, TensorProto.FLOAT16)
    if args.sinks:
        variants["sinks"] = (current, TensorProto.FLOAT)
    sessions = {name: session(lib, args.threads, pool, name == "sinks", args.softcap)
                for name, (lib, pool) in variants.items()}
    pool_dtype = {name: helper.tensor_dtype_to_np_dtype(pool) for name, (_, pool) in variants.items()}
    rng = np.random.default_rng(0)
    cases = {f"decode B={b} past={args.past}": [(args.past, 1)] * b for b in map(int, args.batches.split(","))}
    cases[f"prefill {args.prefill}"] = [(0, args.prefill)]
    print(f"{HEADS} heads, {KV_HEADS} KV heads, head size {HEAD}, {args.threads} threads, {args.rounds} rounds")
    for label, seqs in cases.items():
        feed = feeds(seqs, rng)
        fed = {name: {**feed, "kv_cache": feed["kv_cache"].astype(pool_dtype[name])} for name in sessions}
        if "sinks" in fed:  # NOTE: far below every score, so that the outputs stay comparable with the others
            fed["sinks"]["sinks"] = np.full(HEADS, -100.0, np.float32)
        outs = {name: s.run(None, fed[name])[0] for name, s in sessions.items()}
        times: dict[str, list[float]] = {name: [] for name in sessions}
        order = list(sessions)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                time.sleep(0.2)  # NOTE: as in the engine the pools spin; the other session's must be idle by now
                times[name].append(us_per_node(sessions[name], fed[name]))
        med = {name: statistics.median(t) for name, t in times.items()}
        line = f"{label:24s} current {med['current']:8.1f} us"
        for name in list(sessions)[1:]:
            # speed-up of the current library over the compared one (on the same pool), and of the float16 pool
            # (sinks) over plain
            base = "float16 pool" if name == "compared float16 pool" else "current"
            diff = np.abs(outs[base] - outs[name]).max()
            speedup = med[name] / med[base] if name.startswith("compared") else med["current"] / med[name]
            line += f"  {name} {med[name]:8.1f} us, speed-up {speedup:.2f}x (max diff {diff:.1e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
