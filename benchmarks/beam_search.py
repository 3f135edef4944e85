"""Beam search in trtbuild against Hugging Face transformers' generate(num_beams=k), on the same weights, in one run.

    python benchmarks/beam_search.py --hf DIR [--beams 4] [--batch 1,4] [--prompt 64] [--gen 64] [--threads 2]
        [--rounds 3] [--work DIR] [--json out.json]

DIR is a Hugging Face model folder; trtbuild converts it (float32, as HF runs it on a CPU) and builds an engine.
Each round times, for every batch size B: B prompts of `--prompt` random token ids, each searched with `--beams`
beams for exactly `--gen` tokens (EOS ignored: HF `min_new_tokens`), in trtbuild (`LLM.generate`, beam_width) and in
HF (one generate() call over the batch), plus trtbuild greedy on the same prompts (what the beams cost). Rounds
alternate the configurations; the table gives medians of answer tokens per second (B x gen / seconds) and the
ratios. Before timing, it counts the prompts whose best beam is the same in both (float32 rounding may swap
two near-tied beams).

The peer is HF because it defines the search trtbuild reproduces; llama.cpp's server has no beam search.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--batch", default="1,4", help="comma-separated numbers of prompts searched at once")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trtbuild.builder.build import build_engine
    from trtbuild.builder.convert.convert import convert
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batch.split(",")]
    work = a.work or Path(tempfile.mkdtemp(prefix="beam-bench-"))
    engine = work / "engine"
    if not (engine / "config.json").is_file():
        convert(a.hf, work / "ckpt", dtype="float32")
        build_engine(work / "ckpt", engine, max_seq_len=a.prompt + a.gen + 8, max_batch_size=max(batches) * a.beams,
                     max_num_tokens=max(512, max(batches) * a.prompt))
    llm = LLM(engine, RuntimeConfig(num_threads=a.threads))
    hf = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # every beam runs `--gen` tokens, as ignore_eos in trtbuild
    rng = np.random.default_rng(0)
    vocab = min(llm.core.vocab_size, hf.config.vocab_size)
    prompts = {b: rng.integers(100, vocab, size=(b, a.prompt)).tolist() for b in batches}
    beams = SamplingParams(beam_width=a.beams, max_tokens=a.gen, ignore_eos=True)
    greedy = SamplingParams(max_tokens=a.gen, ignore_eos=True)

    def trtbuild_beams(b: int) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(prompts[b], beams)]

    def hf_beams(b: int) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts[b]), num_beams=a.beams, do_sample=False, max_new_tokens=a.gen,
                              min_new_tokens=a.gen, attention_mask=torch.ones(b, a.prompt, dtype=torch.long))
        return [row[a.prompt:] for row in out.tolist()]

    def trtbuild_greedy(b: int) -> list[list[int]]:
        return [c.token_ids for c in llm.generate(prompts[b], greedy)]

    agree = {b: sum(x == y for x, y in zip(trtbuild_beams(b), hf_beams(b), strict=True)) for b in batches}
    configs = {"trtbuild beams": trtbuild_beams, "hf beams": hf_beams, "trtbuild greedy": trtbuild_greedy}
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for b in batches:
            for name, run in (configs.items() if r % 2 == 0 else reversed(configs.items())):
                start = time.perf_counter()
                run(b)
                rates.setdefault((name, b), []).append(b * a.gen / (time.perf_counter() - start))
    rows = []
    for b in batches:
        med = {name: statistics.median(rates[(name, b)]) for name in configs}
        rows.append({"batch": b, "beams": a.beams, "best beam = hf's": f"{agree[b]}/{b}",
                     **{f"{n} tok/s": round(v, 2) for n, v in med.items()},
                     "trtbuild / hf": round(med["trtbuild beams"] / med["hf beams"], 2),
                     "beams / greedy (trtbuild)": round(med["trtbuild beams"] / med["trtbuild greedy"], 2)})
    print(f"model {a.hf}, {a.beams} beams, prompt {a.prompt}, gen {a.gen}, threads {a.threads}, "
          f"medians of {a.rounds} rounds")
    for row in rows:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
