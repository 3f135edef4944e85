"""`trtbuild eval` (bench/perplexity.py): sliding-window perplexity equals exp(mean NLL) from Hugging Face logits on
the same windows (stories260K, fp32, relative 1e-5), every token after the first is scored once, and a reference
engine gives its perplexity and the top-1 agreement."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import STORIES260K, require_shared_models
from quant_helpers import calibrate, quantize_checkpoint

from trtbuild.bench.perplexity import evaluate, sliding_windows
from trtbuild.builder.build import build_engine
from trtbuild.builder.convert.convert import convert
from trtbuild.cli import main
from trtbuild.runtime.tokenizer import Tokenizer

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
        "saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom to help her. Her "
        "mom said yes and they got the ball down together. Lily was very happy and said thank you. The sun was warm "
        "and the birds were singing. Lily and her mom played with the ball until it was time to go home for dinner.")


@pytest.mark.parametrize("n, length, stride", [(100, 32, 8), (100, 32, 32), (10, 64, 32), (2, 4, 1), (57, 16, 5)])
def test_windows_score_every_token_once(n, length, stride):
    windows = sliding_windows(n, length, stride)
    targets = [t for w in windows for t in range(w.first_target, w.end)]
    assert targets == list(range(1, n))
    for w in windows:
        assert 0 <= w.begin < w.first_target and w.end - 1 - w.begin <= length  # tokens fed
        assert w.num_targets <= stride and w.first_target - w.begin >= min(length + 1 - stride, w.first_target)


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """stories260K: HF model, fp32 engine, int8_sq engine (max_num_tokens 24: windows run as several chunks)."""
    require_shared_models()
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("eval")
    convert(STORIES260K, work / "ckpt")
    options = dict(max_seq_len=64, tokens_per_block=8, max_num_tokens=24, max_batch_size=2)
    engine = build_engine(work / "ckpt", work / "engine", **options)
    ids = Tokenizer(engine).encode(TEXT)
    amax = calibrate(STORIES260K, ids)
    quantized = build_engine(quantize_checkpoint(work / "ckpt", work / "q", "int8_sq", "int8", amax), work / "qe",
                             **options)
    kv_only = build_engine(quantize_checkpoint(work / "ckpt", work / "kv", None, "int8", amax), work / "kve",
                           **options)
    hf = AutoModelForCausalLM.from_pretrained(STORIES260K, dtype=torch.float32).eval()
    return hf, engine, quantized, ids, work, kv_only


def hf_perplexity(hf, ids: list[int], length: int, stride: int) -> float:
    """exp(mean NLL) from Hugging Face logits over the same windows, written independently of bench/perplexity.py."""
    nll = []
    first = 1
    while first < len(ids):
        end = min(first + stride, len(ids))
        begin = max(0, end - 1 - length)
        with torch.no_grad():
            logits = hf(torch.tensor([ids[begin : end - 1]])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(first, end):
            nll.append(-float(logp[t - 1 - begin, ids[t]]))
        first = end
    return math.exp(sum(nll) / len(nll))


@pytest.mark.parametrize("length, stride", [(48, 16), (32, 32), (64, 64)])
def test_perplexity_matches_hf(length, stride, stories):
    hf, engine, _, ids, _, _ = stories
    assert len(ids) > 64  # several windows
    result = evaluate(engine, ids, max_seq_len=length, stride=stride, num_threads=1)
    want = hf_perplexity(hf, ids, length, stride)
    assert result.num_tokens == len(ids) - 1
    assert abs(result.perplexity - want) / want <= 1e-5
    assert result.perplexity == pytest.approx(math.exp(result.nll))
    assert 1 < result.perplexity < 50  # a trained model on its own kind of text


def test_reference_engine_agreement(stories):
    _, engine, quantized, ids, _, _ = stories
    same = evaluate(engine, ids, max_seq_len=48, stride=16, reference_engine=engine, num_threads=1)
    assert same.argmax_agreement == 1.0 and same.reference_perplexity == pytest.approx(same.perplexity, rel=1e-12)
    q = evaluate(quantized, ids, max_seq_len=48, stride=16, reference_engine=engine, num_threads=1)
    assert q.reference_perplexity == pytest.approx(same.perplexity, rel=1e-12)
    assert q.perplexity != same.perplexity and abs(q.perplexity / same.perplexity - 1) < 0.2
    assert 0.7 <= q.argmax_agreement < 1.0


def test_token_ids_outside_the_vocabulary_are_refused_by_name(stories):
    _, engine, _, ids, _, _ = stories
    with pytest.raises(ValueError, match=r"token id 512 is outside the engine's vocabulary \(0 \.\. 511\)"):
        evaluate(engine, [*ids[:10], 512, *ids[10:]], max_seq_len=48, num_threads=1)


def test_perplexity_does_not_depend_on_chunking(stories):
    """Windows fed in chunks (later chunks read earlier ones from the pool) score as windows fed whole, also with an
    int8 KV cache: attention reads every K/V as the cache stores it, this step's own included."""
    _, engine, _, ids, _, kv_only = stories
    for e in (engine, kv_only):
        whole = evaluate(e, ids, max_seq_len=24, stride=12, num_threads=1)  # 24 = the engines' max_num_tokens
        for chunk_size in (1, 5):
            chunked = evaluate(e, ids, max_seq_len=24, stride=12, chunk_size=chunk_size, num_threads=1)
            assert chunked.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
    q = evaluate(kv_only, ids, max_seq_len=48, stride=16, reference_engine=engine, num_threads=1)
    assert q.perplexity != pytest.approx(q.reference_perplexity, rel=1e-5)  # the int8 cache is real
    assert abs(q.perplexity / q.reference_perplexity - 1) < 0.05 and q.argmax_agreement > 0.9


def test_eval_cli(stories):
    _, engine, quantized, _, work, _ = stories
    (work / "story.txt").write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(main, ["eval", "--engine", str(quantized), "--dataset", str(work / "story.txt"),
                                       "--max-seq-len", "48", "--stride", "16", "--reference-engine", str(engine)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("perplexity ") and "windows of 48 tokens, stride 16" in lines[0]
    assert lines[1].startswith("reference perplexity ") and "top-1 agreement" in lines[1]
    bad = CliRunner().invoke(main, ["eval", "--engine", str(engine), "--dataset", str(work / "story.txt"),
                                    "--max-seq-len", "65"])
    assert bad.exit_code != 0 and "exceeds the engine's build limit 64" in bad.stderr
    assert "Traceback" not in bad.output
    np.testing.assert_equal(bad.exception.__class__, SystemExit)
