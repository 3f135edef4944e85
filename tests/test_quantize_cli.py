"""`trtbuild quantize` on the command line: calibration files and corpus, clear errors, a --help that stays light."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from click.testing import CliRunner

from trtbuild.builder.convert.checkpoint import load_checkpoint
from trtbuild.cli import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, pattern: str) -> None:
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and pattern in errors[0], result.stderr


def test_cli_quantize_with_calibration_files(tiny, tmp_path):
    (tmp_path / "calib.jsonl").write_text("\n".join(json.dumps({"text": f"Sentence number {i} about cats."})
                                                   for i in range(50)))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("Once upon a time there was a cat. " * 40)
    for i, calib in enumerate([tmp_path / "calib.jsonl", tmp_path / "texts", tmp_path / "texts" / "a.txt"]):
        out = tmp_path / f"out{i}"
        result = invoke("quantize", "--model", tiny, "--output", out, "--qformat", "fp8", "--calib-dataset", calib,
                        "--calib-size", 4, "--calib-max-seq-len", 32)
        assert result.exit_code == 0, (result.output, result.exception)
        assert result.stdout.startswith(f"wrote {out}: fp8, per-linear input scales, KV cache float32, 14 linears "
                                        "quantized, 1 kept in float32, calibrated on 4 x 32 tokens")
        assert load_checkpoint(out)[0].quantization.quant_algo == "fp8"


def test_default_corpus_is_real_text_and_deterministic():
    from trtbuild.quantize.calib import default_corpus

    docs = default_corpus()
    text = "\n\n".join(docs)
    assert len(docs) > 500 and len(text) > 50_000 and text.count(" the ") > 2_000
    code = ("import hashlib; from trtbuild.quantize.calib import default_corpus; "
            "print(hashlib.sha256('\\n\\n'.join(default_corpus()).encode()).hexdigest())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == hashlib.sha256(text.encode()).hexdigest()  # same after torch/transformers/modelopt imports


def test_cli_errors(tiny, runs, tmp_path):
    q = ("quantize", "--model", tiny, "--calib-size", 2, "--calib-max-seq-len", 16)
    out = tmp_path / "out"
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int3"), "'int3' is not one of")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 64),
                      "--awq-block-size 64 does not divide the 96 input features of transformer.layers.0.mlp.proj; "
                      "use 32, or exclude those linears.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 48),
                      "must be a power of two")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 64, "--exclude",
                             "lm_head", "--exclude", "*.mlp.proj", "--tp-size", 2),
                      "--tp-size 2 splits the 64 input features of attention.dense into 32 per rank")
    (tmp_path / "empty.txt").write_text(" \n")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "empty.txt"),
                      "has no text")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "bad.jsonl"),
                      'line 1 has no string field "text"')
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--calib-dataset", tmp_path / "missing.txt"),
                      "does not exist")
    for alpha in ("1.5", "-0.1", "nan"):
        assert_user_error(invoke(*q, "--output", out, "--qformat", "int8_sq", "--smoothquant-alpha", alpha),
                          "must be in [0, 1]")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--smoothquant-alpha", 0.5),
                      "--smoothquant-alpha applies to the int8_sq format only, not fp8.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int4_awq", "--awq-block-size", 32,
                             "--per-token-activations"), "--per-token-activations applies to the int8_sq format only")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "int8_sq", "--per-token-activations", "--tp-size", 2),
                      "--per-token-activations needs one tensor-parallel rank, not 2")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--lm-head-qformat", "int8_wo", "--exclude",
                             "transformer.layers.0.*"),
                      "--lm-head-qformat int8_wo gives lm_head its own format, but the exclude patterns "
                      "(transformer.layers.0.*) leave lm_head to the fp8 format; exclude lm_head too.")
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--lm-head-qformat", "int4"),
                      "'int4' is not 'int8_wo'")
    assert not out.exists()  # a failed run leaves nothing behind
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    assert_user_error(invoke(*q, "--output", tmp_path / "full", "--qformat", "fp8"), "exists and is not empty")
    assert (tmp_path / "full" / "x").read_text() == "mine"
    assert_user_error(invoke(*q, "--output", out, "--qformat", "fp8", "--exclude", "*"), "matches every linear")
    _, quantized = runs("fp8", None)
    assert_user_error(invoke("quantize", "--model", quantized, "--output", out, "--qformat", "fp8"),
                      "is already quantized (fp8)")
    assert not out.exists()


def test_quantize_help_imports_nothing_heavy():
    code = ("import sys; from click.testing import CliRunner; from trtbuild.cli import main; "
            "r = CliRunner().invoke(main, ['quantize', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in ('torch', 'modelopt', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
