"""The `trtbuild` command line. Heavy modules (torch, onnx, onnxruntime) are imported inside each command."""

from __future__ import annotations

import itertools
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
    from trtbuild.runtime.engine_core import RuntimeConfig
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens)
        llm = LLM(engine, RuntimeConfig(num_threads=threads, max_batch_size=1))
        outputs = llm.stream([prompt], params)
        first = next(outputs)  # the request passed validation: echo the prompt, then stream
        click.echo(prompt, nl=False)
        for _, output in itertools.chain([first], outputs):
            click.echo(output.new_text, nl=False)
            sys.stdout.flush()
    except ValueError as e:
        raise TrtbuildError(str(e)) from None
    click.echo()


@main.command()
@click.option("--engine", required=True, type=_existing, help="Engine directory written by `trtbuild build`.")
@click.option("--host", default="127.0.0.1", help="Address to bind; loopback by default (0.0.0.0: all interfaces).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8001, help="0 picks a free port (printed).")
@click.option("--kv-cache-memory", type=click.FloatRange(min=0, min_open=True), default=None,
              help="KV cache budget: bytes (> 1) or a fraction of available memory (<= 1).")
@click.option("--kv-cache-blocks", type=click.IntRange(min=1), default=None,
              help="Exact number of KV blocks (overrides --kv-cache-memory).")
@click.option("--policy", type=click.Choice(["guaranteed_no_evict", "max_utilization"]), default="max_utilization",
              help="guaranteed_no_evict reserves a request's whole lifetime; max_utilization preempts when full.")
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of shared prompt prefixes.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None, help="[default: the engine's]")
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=None, help="[default: the engine's]")
@click.option("--max-prefill-chunk", type=click.IntRange(min=1), default=None,
              help="Prefill tokens of one request per step [default: the whole token budget].")
@click.option("--max-queue-size", type=click.IntRange(min=1), default=256,
              help="Unfinished requests held at most; more are refused with RESOURCE_EXHAUSTED.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
def serve(engine: Path, host: str, port: int, kv_cache_memory: float | None, kv_cache_blocks: int | None,
          policy: str, no_prefix_caching: bool, max_batch_size: int | None, max_num_tokens: int | None,
          max_prefill_chunk: int | None, max_queue_size: int, threads: int | None) -> None:
    """Serve an engine over gRPC (trtbuild.v1.Generation, health, reflection) until SIGTERM / Ctrl-C."""
    from trtbuild.errors import TrtbuildError
    from trtbuild.runtime.engine_core import RuntimeConfig
    from trtbuild.runtime.server import serve as run_server

    config = RuntimeConfig(kv_cache_memory=kv_cache_memory, kv_cache_blocks=kv_cache_blocks, policy=policy,
                           enable_prefix_caching=not no_prefix_caching, max_batch_size=max_batch_size,
                           max_num_tokens=max_num_tokens, max_prefill_chunk=max_prefill_chunk, num_threads=threads)
    try:
        run_server(engine, host=host, port=port, config=config, max_queue_size=max_queue_size)
    except ValueError as e:
        raise TrtbuildError(str(e)) from None


@main.command()
@click.option("--address", default="127.0.0.1:8001", help="host:port of `trtbuild serve`.")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, help="Tokens to generate at most.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, help="0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, help="Keep the k most likely tokens (0: all).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, help="Nucleus mass.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--no-stream", is_flag=True, help="Wait for the whole text instead of streaming it.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, help="Seconds for the call.")
def client(address: str, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
           seed: int | None, stop: tuple[str, ...], no_stream: bool, timeout: float) -> None:
    """Generate text with a running `trtbuild serve`, streaming it to the terminal."""
    import grpc

    from trtbuild.errors import TrtbuildError
    from trtbuild.runtime.client import GenerationClient

    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop=list(stop))
    try:
        with GenerationClient(address) as c:
            if no_stream:
                click.echo(prompt + c.generate(prompt, timeout=timeout, **sampling).text, nl=False)
            else:
                responses = c.generate_stream(prompt, timeout=timeout, **sampling)
                first = next(responses)  # the request passed validation: echo the prompt, then stream
                click.echo(prompt, nl=False)
                for r in itertools.chain([first], responses):
                    click.echo(r.text, nl=False)
                    sys.stdout.flush()
    except grpc.RpcError as e:
        raise TrtbuildError(f"{address}: {e.code().name}: {e.details()}") from None
    click.echo()


if __name__ == "__main__":
    main()
