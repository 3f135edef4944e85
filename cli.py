"""The `trtbuild` command line. Heavy modules (torch, onnx, onnxruntime) are imported inside each command."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from trtbuild import __version__

_existing = click.Path(exists=True, path_type=Path)
_out = click.Path(path_type=Path)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="trtbuild")
@click.option("-v", "--verbose", is_flag=True, help="Log what each step does.")
def main(verbose: bool) -> None:
    """Build LLM engines ahead of time and generate with them.

    \b
    Flow:  trtbuild convert  (HF folder or GGUF -> checkpoint)
           trtbuild build    (checkpoint -> engine directory)
           trtbuild run      (engine -> generated text)
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@main.command()
@click.option("--model", required=True, type=_existing, help="Hugging Face model folder or a .gguf file.")
@click.option("--output", required=True, type=_out, help="Checkpoint folder to create (must not exist or be empty).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Weight dtype of the checkpoint; auto keeps the model's.")
@click.option("--tp-size", type=click.IntRange(min=1), default=1, help="Tensor-parallel ranks.")
@click.option("--pp-size", type=click.IntRange(min=1), default=1, help="Pipeline-parallel ranks.")
def convert(model: Path, output: Path, dtype: str, tp_size: int, pp_size: int) -> None:
    """Convert a Llama / Qwen2 / Qwen3 / Mistral model into a trtbuild checkpoint."""
    from trtbuild.builder.convert.convert import convert as run_convert

    config = run_convert(model, output, dtype=dtype, tp_size=tp_size, pp_size=pp_size)
    click.echo(f"wrote {output}: {config.architecture}, {config.num_hidden_layers} layers, dtype {config.dtype}, "
               f"{config.mapping.world_size} rank(s)")


@main.command()
@click.option("--checkpoint", required=True, type=_existing, help="Folder written by `trtbuild convert`.")
@click.option("--output", required=True, type=_out, help="Engine directory to create.")
@click.option("--target", type=click.Choice(["cpu", "tensorrt"]), default="cpu", help="Where the engine runs.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=16, help="Sequences per engine step.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="Prompt + output tokens of one sequence [default: the model's context, at most 4096].")
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=2048, help="Tokens packed into one step.")
@click.option("--tokens-per-block", type=click.IntRange(min=1), default=16, help="Paged KV cache block size.")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes (for debugging).")
def build(checkpoint: Path, output: Path, target: str, max_batch_size: int, max_seq_len: int | None,
          max_num_tokens: int, tokens_per_block: int, no_fuse: bool) -> None:
    """Compile a checkpoint into an engine directory for one target."""
    from trtbuild.builder.build import build_engine

    build_engine(checkpoint, output, target=target, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                 max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block, fuse=not no_fuse)
    click.echo(f"wrote engine {output}")


@main.command()
@click.option("--engine", required=True, type=_existing, help="Engine directory written by `trtbuild build`.")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, help="Tokens to generate at most.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, help="0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, help="Keep the k most likely tokens (0: all).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, help="Nucleus mass.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
def run(engine: Path, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
        seed: int | None, threads: int | None) -> None:
    """Generate text from a prompt, streaming it to the terminal."""
    from trtbuild.errors import TrtbuildError
    from trtbuild.runtime.engine import CpuEngine
    from trtbuild.runtime.generate import GenerationRequest, Generator
    from trtbuild.runtime.sampling import SamplingParams
    from trtbuild.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, load_generation_eos

    cpu_engine = CpuEngine(engine, num_threads=threads)
    tokenizer = Tokenizer(engine)
    prompt_ids = tokenizer.encode(prompt)
    stop = tuple(cpu_engine.info.model.eos_token_ids) + load_generation_eos(engine)
    request = GenerationRequest(prompt_ids, max_tokens, SamplingParams(temperature, top_k, top_p, seed), stop)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    click.echo(prompt, nl=False)
    try:
        for event in Generator(cpu_engine).stream([request]):
            if event.token_id not in stop:
                click.echo(detok.add(event.token_id), nl=False)
            sys.stdout.flush()
    except ValueError as e:
        raise TrtbuildError(str(e)) from None
    click.echo()


if __name__ == "__main__":
    main()
