"""The `trtbuild` command line: fast start without heavy imports, the convert -> build -> run flow on stories260K,
and bad input answered by an `Error:` line and an exit code, never a traceback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from helpers import STORIES260K, require_shared_models

from trtbuild import __version__
from trtbuild.cli import main
from trtbuild.cli_errors import flag_of
from trtbuild.runtime.llm import LLM
from trtbuild.runtime.sampling import SamplingParams

HEAVY_MODULES = ("torch", "onnx", "onnxruntime", "transformers", "safetensors", "gguf", "tokenizers", "numpy",
                 "polygraphy", "fastapi", "uvicorn", "prometheus_client")
STORY = "Once upon a time, there was a little girl named Lily."
LONG_PROMPT = "Once upon a time there was a little dog who liked to run in the park with his best friend the cat."


def invoke(*args) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_ok(result: Result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)


def assert_user_error(result: Result, pattern: str) -> None:
    """Exit code != 0 from a click error (not a crash), an `Error:` line that matches, and no traceback."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"  # ClickException -> exit
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert re.search(pattern, errors[0]), errors[0]


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> dict[str, Path]:
    """stories260K converted and built through the CLI: checkpoint, engine, and a max_seq_len=16 engine."""
    require_shared_models()
    work = tmp_path_factory.mktemp("cli")
    paths = {"ckpt": work / "ckpt", "engine": work / "engine", "engine16": work / "engine16"}
    result = invoke("convert", "--model", STORIES260K, "--output", paths["ckpt"])
    assert_ok(result)
    assert f"wrote {paths['ckpt']}: LlamaForCausalLM, 5 layers, dtype float32, 1 rank(s)" in result.stdout
    for engine, max_seq_len in (("engine", 256), ("engine16", 16)):
        result = invoke("build", "--checkpoint", paths["ckpt"], "--output", paths[engine], "--max-seq-len", max_seq_len,
                        "--tokens-per-block", 8)
        assert_ok(result)
        assert f"wrote engine {paths[engine]}" in result.stdout
    return paths


# ---- start-up ---------------------------------------------------------------------------------------------------
def test_help_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "trtbuild convert" in proc.stdout and "build" in proc.stdout and "run" in proc.stdout


def test_cli_import_and_help_load_no_heavy_modules():
    """What keeps `--help` fast, checked without timing it: no command's help imports torch, onnx and the like."""
    code = (
        "import contextlib, io, json, sys\n"
        "import trtbuild.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for args in [['--help']] + [[c, '--help'] for c in trtbuild.cli.main.commands]:\n"
        "        trtbuild.cli.main(args, standalone_mode=False)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "click" in loaded and "trtbuild" in loaded
    assert loaded.isdisjoint(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))


def test_version_and_help_texts():
    result = invoke("--version")
    assert_ok(result)
    assert result.stdout.strip() == f"trtbuild, version {__version__}"
    for command, option in (("convert", "--tp-size"), ("build", "--max-seq-len"), ("run", "--top-p")):
        result = invoke(command, "--help")
        assert_ok(result)
        assert option in result.stdout


def test_config_errors_are_shown_as_the_flag_that_set_the_field():
    """Configs name fields; the CLI shows each as its flag, also where the flag's name differs from the field's."""
    assert flag_of(main.commands["build"], "max_seq_len") == "--max-seq-len"
    assert flag_of(main.commands["serve"], "num_threads") == "--threads"
    assert flag_of(main.commands["serve"], "enable_prefix_caching") == "--no-prefix-caching"
    assert flag_of(main.commands["run"], "min_tokens") == "min_tokens"  # no flag sets it: the field's own name


@pytest.mark.parametrize("command", ["serve", "triton-repo"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--max-queue-size", "0"], "--max-queue-size must be at least 1, got 0"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory must be positive"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
    (["--max-state-snapshots", "-1"], "--max-state-snapshots must be 0 or more, got -1"),
])
def test_serving_flags_are_checked_by_runtime_config(command, flags, message, tmp_path):
    """serve and triton-repo set the same RuntimeConfig fields; its checks come back as the flag that set them,
    before any engine is read."""
    result = invoke(command, "--engine", tmp_path, *(["--output", tmp_path / "repo"] if command == "triton-repo"
                                                       else []), *flags)
    assert_user_error(result, re.escape(message))


# ---- end to end -------------------------------------------------------------------------------------------------
def test_convert_build_run_stories260k_greedy(stories):
    result = invoke("run", "--engine", stories["engine"], "--prompt", "Once upon a time", "--max-tokens", 40)
    assert_ok(result)
    assert result.stdout.startswith(STORY), result.stdout
    assert result.stdout.endswith("\n")
    again = invoke("run", "--engine", stories["engine"], "--prompt", "Once upon a time", "--max-tokens", 40)
    assert again.stdout == result.stdout  # greedy is deterministic


def test_run_with_beam_search_prints_the_best_beam_then_the_others(stories):
    result = invoke("run", "--engine", stories["engine"], "--prompt", "Once upon a time", "--max-tokens", 12,
                    "--beam-width", 3)
    assert_ok(result)
    want = LLM(stories["engine"]).generate(["Once upon a time"], SamplingParams(max_tokens=12, beam_width=3))[0]
    assert result.stdout == "Once upon a time" + want.text + "\n"
    assert result.stderr.splitlines() == [f"beam {i} (score {b.score:.4f}): {b.text}"
                                          for i, b in enumerate(want.beams[1:], start=2)]
    refused = invoke("run", "--engine", stories["engine"], "--prompt", "x", "--beam-width", 2, "--temperature", 1)
    assert_user_error(refused, "--temperature cannot be set with beam_width 2")


def test_convert_options_reach_the_checkpoint(tmp_path):
    require_shared_models()
    result = invoke("convert", "--model", STORIES260K, "--output", tmp_path / "ckpt", "--dtype", "bfloat16",
                    "--tp-size", 2, "--pp-size", 2)
    assert_ok(result)
    assert "dtype bfloat16, 4 rank(s)" in result.stdout
    doc = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert (doc["dtype"], doc["mapping"]) == ("bfloat16", {"world_size": 4, "tp_size": 2, "pp_size": 2})
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == [f"rank{r}.safetensors"
                                                                                  for r in range(4)]
    result = invoke("build", "--checkpoint", tmp_path / "ckpt", "--output", tmp_path / "engine")
    assert_user_error(result, r"4 ranks \(tp=2, pp=2\).*no pipeline-parallel ranks.*--tp-size 1 --pp-size 1")
    assert not (tmp_path / "engine").exists()


def test_build_kv_pool_dtype_float16_reaches_the_engine_and_generates(stories, tmp_path):
    """`--kv-pool-dtype float16`: recorded in the engine's build_config, a float16 pool at run time, and the same
    greedy story as the float32 engine on stories260K."""
    assert_ok(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e16", "--max-seq-len", 256,
                     "--kv-pool-dtype", "float16"))
    doc = json.loads((tmp_path / "e16" / "config.json").read_text())
    assert doc["build_config"]["kv_pool_dtype"] == "float16"
    result = invoke("run", "--engine", tmp_path / "e16", "--prompt", "Once upon a time", "--max-tokens", 40)
    assert_ok(result)
    assert result.stdout.startswith(STORY), result.stdout
    assert_user_error(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e", "--kv-pool-dtype",
                             "bfloat16"), r"Invalid value for '--kv-pool-dtype'")


def test_build_draft_tokens_mode_reaches_the_engine_and_generates(stories, tmp_path):
    """`--speculative-decoding-mode draft-tokens`: the mode and the default max draft len in build_config, and with
    prompt lookup drafts verified in the engine the same greedy story."""
    assert_ok(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e", "--max-seq-len", 256,
                     "--speculative-decoding-mode", "draft-tokens"))
    build = json.loads((tmp_path / "e" / "config.json").read_text())["build_config"]
    assert (build["speculative_decoding_mode"], build["max_draft_len"]) == ("draft-tokens", 4)
    result = invoke("run", "--engine", tmp_path / "e", "--prompt", "Once upon a time", "--max-tokens", 40,
                    "--speculative-tokens", 3)
    assert_ok(result)
    assert result.stdout.startswith(STORY), result.stdout


# ---- bad input --------------------------------------------------------------------------------------------------
def test_convert_bad_input(tmp_path):
    require_shared_models()
    assert_user_error(invoke("convert", "--model", tmp_path / "nowhere", "--output", tmp_path / "out"),
                      r"Invalid value for '--model'.*does not exist")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert_user_error(invoke("convert", "--model", STORIES260K, "--output", taken), r"exists and is not empty")
    assert_user_error(invoke("convert", "--model", STORIES260K, "--output", "/proc/trtbuild-x"),
                      r"cannot create the output folder /proc/trtbuild-x \(.*\); choose a folder you can write to")
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "mine"
    assert_user_error(invoke("convert", "--model", STORIES260K, "--output", tmp_path / "out", "--tp-size", 3),
                      r"--tp-size 3 does not divide num_attention_heads=8")
    assert_user_error(invoke("convert", "--model", STORIES260K, "--output", tmp_path / "out", "--dtype", "int8"),
                      r"Invalid value for '--dtype'")
    for edit, pattern in (({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture 'GPT2LMHeadModel'"),
                          ({"hidden_size": None}, r"config\.json has an invalid value")):
        model = tmp_path / "model"
        shutil.rmtree(model, ignore_errors=True)
        shutil.copytree(STORIES260K, model, ignore=shutil.ignore_patterns("*.gguf"))
        hf = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**hf, **edit}))
        assert_user_error(invoke("convert", "--model", model, "--output", tmp_path / "out"), pattern)
    assert not (tmp_path / "out").exists()


def test_build_bad_input(stories, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_user_error(invoke("build", "--checkpoint", tmp_path / "empty", "--output", tmp_path / "e"),
                      r"config\.json not found: is this a checkpoint made by `trtbuild convert`")
    assert_user_error(invoke("build", "--checkpoint", STORIES260K, "--output", tmp_path / "e"),
                      r"unknown fields in checkpoint config\.json.*trtbuild convert")
    assert_user_error(invoke("build", "--checkpoint", stories["engine"], "--output", tmp_path / "e"),
                      r"unknown fields in checkpoint config\.json")
    assert_user_error(invoke("build", "--checkpoint", tmp_path / "nowhere", "--output", tmp_path / "e"),
                      r"Invalid value for '--checkpoint'.*does not exist")
    assert_user_error(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e", "--target",
                             "tensorrt"), r"--target tensorrt needs NVIDIA TensorRT's Python package.*pip install")
    assert_user_error(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e", "--max-seq-len",
                             4096), r"--max-seq-len 4096 exceeds the model's max_position_embeddings \(512\)")
    assert_user_error(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e", "--max-draft-len",
                             2), r"--max-draft-len must be at least 1 with speculative_decoding_mode draft-tokens and "
                                 r"0 without, got 2")
    assert not (tmp_path / "e").exists()


def test_run_bad_input(stories, tmp_path):
    (tmp_path / "empty").mkdir()
    engine = stories["engine"]
    assert_user_error(invoke("run", "--engine", tmp_path / "empty", "--prompt", "hi"),
                      r"is not an engine directory.*trtbuild build")
    assert_user_error(invoke("run", "--engine", stories["ckpt"], "--prompt", "hi"), r"trtbuild build")
    assert_user_error(invoke("run", "--engine", tmp_path / "nowhere", "--prompt", "hi"),
                      r"Invalid value for '--engine'.*does not exist")
    assert_user_error(invoke("run", "--engine", engine, "--prompt", "hi", "--top-p", 0),
                      r"Invalid value for '--top-p'")
    assert_user_error(invoke("run", "--engine", engine, "--prompt", "hi", "--max-tokens", 0),
                      r"Invalid value for '--max-tokens'")
    assert_user_error(invoke("run", "--engine", engine, "--prompt", "hi", "--temperature", -1),
                      r"Invalid value for '--temperature'")
    wrong_target = tmp_path / "wrong_target"
    shutil.copytree(engine, wrong_target)
    doc = json.loads((wrong_target / "config.json").read_text())
    doc["target"]["name"] = "tensorrt"
    (wrong_target / "config.json").write_text(json.dumps(doc))
    # the engine class follows config.json's target: a TensorRT engine needs TensorRT (or its GPU and version)
    assert_user_error(invoke("run", "--engine", wrong_target, "--prompt", "hi"),
                      r"TensorRT engine, and NVIDIA TensorRT's Python package is not installed here; `pip install "
                      r"tensorrt`|built for another GPU or TensorRT")


@pytest.mark.parametrize("max_tokens", [1, 40])
def test_run_prompt_beyond_max_seq_len(stories, max_tokens):
    result = invoke("run", "--engine", stories["engine16"], "--prompt", LONG_PROMPT, "--max-tokens", max_tokens)
    assert_user_error(result, r"prompt has \d+ tokens; the engine's max_seq_len is 16 \(prompt \+ output\)")
    assert result.stdout == ""  # nothing is printed before the error
    ok = invoke("run", "--engine", stories["engine16"], "--prompt", "Once upon a time", "--max-tokens", 8)
    assert_ok(ok)
    assert ok.stdout.startswith("Once upon a time, there was")


def test_bad_input_in_a_real_process_prints_no_traceback(stories, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "convert", "--model", STORIES260K, "--output",
                           stories["ckpt"]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: output folder") and "exists and is not empty" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "trtbuild.cli", "run", "--engine", stories["engine16"], "--prompt",
                           LONG_PROMPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("Error: prompt has ")


def test_a_full_disk_is_a_user_error_and_leaves_no_partial_output(stories, tmp_path, monkeypatch):
    import errno

    import trtbuild.builder.build as build_module

    def full(model, graph_path, weights_path):
        weights_path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(weights_path))

    monkeypatch.setattr(build_module, "save_engine_files", full)
    assert_user_error(invoke("build", "--checkpoint", stories["ckpt"], "--output", tmp_path / "e"),
                      r"the disk is full writing .*rank0\.weights \(No space left on device\)\. `convert`, "
                      r"`quantize` and `build` remove their partial output.*Free space")
    assert not (tmp_path / "e").exists()
