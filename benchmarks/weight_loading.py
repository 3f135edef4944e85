"""How an engine's weights reach ONNX Runtime: time to create the session and memory after it, three ways, each in a
fresh process, alternated over rounds (medians):

  external-data   the engine as written: rank0.onnx + rank0.weights (ONNX external data, mapped by ONNX Runtime)
  initializers    the same graph, every external initializer handed over as an OrtValue over a numpy memmap of
                  rank0.weights (SessionOptions.add_external_initializers)
  no-prepack      external data with session.disable_prepacking: GEMMs read the mapped weights in place

    python benchmarks/weight_loading.py --engine /work/models/runs/engine-fp32 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODES = ("external-data", "initializers", "no-prepack")

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np, onnx, onnxruntime as ort
engine, mode = Path(sys.argv[1]), sys.argv[2]
options = ort.SessionOptions()
options.intra_op_num_threads = 2
options.log_severity_level = 3
start = time.perf_counter()
if mode == "no-prepack":
    options.add_session_config_entry("session.disable_prepacking", "1")
if mode == "initializers":
    model = onnx.load(str(engine / "rank0.onnx"), load_external_data=False)
    data = np.memmap(engine / "rank0.weights", dtype=np.uint8, mode="r")
    names, values = [], []
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        offset, length = int(info["offset"]), int(info["length"])
        array = data[offset:offset + length].view(dtype).reshape(tuple(t.dims))
        names.append(t.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
    options.add_external_initializers(names, values)
session = ort.InferenceSession(str(engine / "rank0.onnx"), options, providers=["CPUExecutionProvider"])
seconds = time.perf_counter() - start
status = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
          if l.startswith(("VmRSS", "RssAnon", "RssFile"))}
print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  **status}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.engine), mode], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{mode} failed:\n{out.stderr[-2000:]}")
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    weights = (args.engine / "rank0.weights").stat().st_size
    print(f"{args.engine}: rank0.weights {weights / 1e9:.2f} GB, {args.rounds} rounds, medians")
    print("| mode | session s | RSS after (anon + file) | peak RSS |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {mode} | {med['seconds']:.2f} | {med['VmRSS'] / 1e9:.2f} GB ({med['RssAnon'] / 1e9:.2f} + "
              f"{med['RssFile'] / 1e9:.2f}) | {med['peak_rss'] / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()
