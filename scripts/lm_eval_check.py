"""lm-evaluation-harness against `trtbuild serve --http-port` and against Hugging Face, on one small task: every
loglikelihood its `local-completions` model reads from the server's echoed prompt logprobs must equal what its `hf`
model computes (not run in CI: lm-eval is not a dependency).

    pip install "lm-eval[api]"   # in a venv with --system-site-packages, beside trtbuild
    python scripts/lm_eval_check.py <HF model folder> [--remote-tokenizer] [--engine ENGINE] [--work DIR]

It writes a 24-question multiple-choice task (stories_mc: a TinyStories sentence and 4 continuations), builds an
engine from the folder unless one is given, serves it, runs both lm-eval models with --log_samples and prints the
largest difference of their loglikelihoods. lm-eval's API models add no BOS unless told (`add_bos_token=True`),
its hf model does for Llama tokenizers: the script gives both the same tokens. With --remote-tokenizer the API
model tokenizes through the server's /tokenize (`tokenizer_backend=remote`, which never adds BOS; the hf model is
then told `add_bos_token=False`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TASK = """task: stories_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""
NAMES = ["Lily", "Tom", "Sue", "Ben", "Max", "Amy", "Tim", "Mia"]


def write_task(folder: Path) -> None:
    rows = []
    for n in NAMES:
        rows += [{"context": f"Once upon a time, there was a little girl named {n}. She loved to play with her",
                  "choices": [" rock", " ball", " sky", " mom"], "label": 1},
                 {"context": f"{n} went to the park. {n} saw a big", "choices": [" car", " sky", " dog", " the"],
                  "label": 2},
                 {"context": f'{n} was very happy. {n} said, "Thank you,',
                  "choices": [" mom", " tree", " blue", " run"], "label": 0}]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "stories_mc.yaml").write_text(TASK.format(data=folder / "data.jsonl"))


def loglikelihoods(out: Path) -> list[float]:
    (samples,) = glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True)
    return [float(r[0]) for line in open(samples) for r in json.loads(line)["filtered_resps"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--engine", type=Path)
    p.add_argument("--work", type=Path)
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command")
    p.add_argument("--remote-tokenizer", action="store_true", help="tokenize through the server's /tokenize")
    a = p.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="lm-eval-check-"))
    work.mkdir(parents=True, exist_ok=True)
    write_task(work)
    engine = a.engine
    if engine is None:
        engine = work / "engine"
        subprocess.run([sys.executable, "-m", "trtbuild.cli", "convert", "--model", str(a.model), "--output",
                        str(work / "ckpt")], check=True)
        subprocess.run([sys.executable, "-m", "trtbuild.cli", "build", "--checkpoint", str(work / "ckpt"), "--output",
                        str(engine)], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "trtbuild.cli", "serve", "--engine", str(engine), "--port", "0",
                               "--http-port", str(port), "--served-model-name", "model"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    common = ["--include_path", str(work), "--tasks", "stories_mc", "--batch_size", "4", "--log_samples"]
    try:
        time.sleep(1)
        for _ in range(120):  # the server's /health answers once the engine is loaded
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        tokenizer = ("tokenizer_backend=remote" if a.remote_tokenizer
                     else f"tokenizer_backend=huggingface,tokenizer={a.model},add_bos_token=True")
        api = f"model=model,base_url=http://127.0.0.1:{port}/v1/completions,{tokenizer},tokenized_requests=True"
        subprocess.run([a.lm_eval, "--model", "local-completions", "--model_args", api, *common, "--output_path",
                        str(work / "trtbuild")], check=True, env=env)
    finally:
        server.terminate()
        server.wait(30)
    bos = ",add_bos_token=False" if a.remote_tokenizer else ""
    subprocess.run([a.lm_eval, "--model", "hf", "--model_args", f"pretrained={a.model},dtype=float32{bos}", "--device",
                    "cpu", *common, "--output_path", str(work / "hf")], check=True, env=env)
    ours, theirs = loglikelihoods(work / "trtbuild"), loglikelihoods(work / "hf")
    worst = max(abs(x - y) for x, y in zip(ours, theirs, strict=True))
    print(f"{len(ours)} loglikelihoods; largest |trtbuild - hf| = {worst:.2e} nats")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
