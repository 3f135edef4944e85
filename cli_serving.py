"""The serving commands of `trtbuild` (registered on the group in cli.py): serve, client, triton-repo,
triton-serve."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import click

from trtbuild.cli_chat import chat_messages, chat_template
from trtbuild.cli_options import (
    existing,
    lora_adapter_options,
    out,
    runtime_config,
    sampling_options,
    serving_options,
)
from trtbuild.errors import TrtbuildError
from trtbuild.serving.openai.harmony import NAME as HARMONY
from trtbuild.serving.openai.tool_calls import FORMATS as TOOL_CALL_FORMATS


@click.command()
@click.option("--engine", required=True, type=existing, help="Engine directory written by `trtbuild build`.")
@click.option("--host", default="127.0.0.1", help="Address to bind; loopback by default (0.0.0.0: all interfaces).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8001, help="0 picks a free port (printed).")
@click.option("--http-port", type=click.IntRange(min=0, max=65535), default=None,
              help="Also serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) "
                   "on this port, over the same engine (0 picks a free port, printed).")
@click.option("--api-key", envvar="TRTBUILD_API_KEY", default=None,
              help="Require `authorization: Bearer <key>` on every gRPC call but health checks and on the OpenAI API "
                   "[env: TRTBUILD_API_KEY].")
@click.option("--served-model-name", default=None, help="The model name of the OpenAI API [default: the engine's "
                                                        "folder name].")
@click.option("--tool-call-parser", type=click.Choice(["auto", *TOOL_CALL_FORMATS, HARMONY]), default="auto",
              show_default=True, help="How the OpenAI API finds tool calls in answers to tool_choice \"auto\" "
                                      "requests: auto (the format the chat template's markers name; harmony for "
                                      "gpt-oss's, whose every answer is split by its channels) or a format.")
@click.option("--reasoning-parser", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: a model whose chat template knows <think> / </think> (or harmony's analysis channel) "
                   "answers its thinking as reasoning_content, apart from the content; none: the thinking stays in "
                   "the content.")
@click.option("--lora-modules", multiple=True, callback=lora_adapter_options, metavar="NAME=PATH",
              help="Load this LoRA adapter (a PEFT folder or llama.cpp's LoRA .gguf) into a slot of the engine "
                   "(built with --max-loras) before serving; requests name it as the model. Repeatable.")
@serving_options
def serve(engine: Path, host: str, port: int, http_port: int | None, api_key: str | None,
          served_model_name: str | None, tool_call_parser: str, reasoning_parser: str,
          lora_modules: tuple[tuple[str, str], ...], **serving) -> None:
    """Serve an engine over gRPC (trtbuild.v1.Generation, health, reflection), and the OpenAI API with --http-port,
    until SIGTERM / Ctrl-C."""
    from trtbuild.serving.grpc.server import serve as run_server

    run_server(engine, host=host, port=port, config=runtime_config(**serving), http_port=http_port, api_key=api_key,
               model_name=served_model_name, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
               lora_modules=lora_modules)


@click.command()
@click.option("--address", default="127.0.0.1:8001", help="host:port of `trtbuild serve`.")
@click.option("--prompt", default=None, help="Text to continue.")
@click.option("--chat", default=None,
              help="A user message, answered through the model's chat template (needs --engine-dir).")
@click.option("--system", default=None, help="System message before --chat.")
@click.option("--engine-dir", type=existing, default=None,
              help="The served engine's directory (or its model's), for --chat: its chat template and tokenizer.")
@sampling_options
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--no-stream", is_flag=True, help="Wait for the whole text instead of streaming it.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, help="Seconds for the call.")
@click.option("--api-key", envvar="TRTBUILD_API_KEY", default=None,
              help="The server's --api-key, if it has one [env: TRTBUILD_API_KEY].")
@click.option("--lora", default=None, metavar="NAME", help="Run under this LoRA adapter of the served engine.")
def client(address: str, prompt: str | None, chat: str | None, system: str | None, engine_dir: Path | None,
           max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None, stop: tuple[str, ...],
           no_stream: bool, timeout: float, api_key: str | None, lora: str | None) -> None:
    """Generate text with a running `trtbuild serve`, streaming it to the terminal."""
    import grpc

    from trtbuild.serving.grpc.client import GenerationClient

    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop=list(stop))
    if chat is not None and engine_dir is None:
        raise click.UsageError("--chat needs --engine-dir (the served engine's directory, for its chat template)")
    template = chat_template(engine_dir or Path(), prompt, chat, system)
    request: str | list[int] = prompt or ""
    echo = prompt or ""  # a chat's rendered prompt is not echoed
    if template is not None:  # rendered and tokenized here (the server would add BOS again to text), sent as ids
        from trtbuild.runtime.tokenizer import Tokenizer

        request = template.encode(Tokenizer(engine_dir), chat_messages(chat, system))
        sampling["stop_token_ids"] = list(template.end_of_turn_token_ids)
    try:
        with GenerationClient(address, api_key=api_key) as c:
            if no_stream:
                click.echo(echo + c.generate(request, timeout=timeout, lora=lora, **sampling).text, nl=False)
            else:
                responses = c.generate_stream(request, timeout=timeout, lora=lora, **sampling)
                first = next(responses)  # the request passed validation: echo the prompt, then stream
                click.echo(echo, nl=False)
                for r in itertools.chain([first], responses):
                    click.echo(r.text, nl=False)
                    sys.stdout.flush()
    except grpc.RpcError as e:
        raise TrtbuildError(f"{address}: {e.code().name}: {e.details()}") from None
    click.echo()


@click.command("triton-repo")
@click.option("--engine", required=True, type=existing, help="Engine directory written by `trtbuild build`.")
@click.option("--output", required=True, type=out, help="Model repository folder (created; may hold other models).")
@click.option("--model-name", default="trtbuild", help="Name of the model in the repository (and in client calls).")
@click.option("--decoupled/--no-decoupled", default=True,
              help="Decoupled: token streaming (gRPC stream, HTTP generate_stream); else one response per request.")
@serving_options
def triton_repo(engine: Path, output: Path, model_name: str, decoupled: bool, **serving) -> None:
    """Write a Triton model repository whose Python-backend model hosts the trtbuild runtime."""
    from trtbuild.serving.triton_backend.repository import write_model_repository

    model = write_model_repository(engine, output, model_name, decoupled, runtime_config(**serving))
    click.echo(f"wrote Triton model {model} ({'decoupled' if decoupled else 'not decoupled'}); serve it with "
               f"`trtbuild triton-serve --repo {output}`")


@click.command("triton-serve", context_settings={"ignore_unknown_options": True})
@click.option("--repo", required=True, type=existing, help="Model repository written by `trtbuild triton-repo`.")
@click.option("--host", default="127.0.0.1", help="Address of all endpoints; loopback by default (0.0.0.0: all).")
@click.option("--grpc-port", type=click.IntRange(min=1, max=65535), default=8001, help="KServe v2 gRPC port.")
@click.option("--http-port", type=click.IntRange(min=1, max=65535), default=8000, help="KServe v2 HTTP port.")
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535), default=8002, help="Prometheus /metrics.")
@click.option("--exit-timeout", type=click.IntRange(min=0), default=30,
              help="Seconds in-flight requests get at shutdown (tritonserver's --exit-timeout-secs).")
@click.argument("tritonserver_args", nargs=-1, type=click.UNPROCESSED)
def triton_serve(repo: Path, host: str, grpc_port: int, http_port: int, metrics_port: int, exit_timeout: int,
                 tritonserver_args: tuple[str, ...]) -> None:
    """Run the tritonserver bundled with nvidia-pytriton over a model repository until SIGTERM / Ctrl-C.

    Arguments after `--` go to tritonserver as they are (e.g. -- --log-verbose=1).
    """
    from trtbuild.serving.triton_backend.launcher import serve

    sys.exit(serve(repo, host, grpc_port, http_port, metrics_port, tuple(tritonserver_args), exit_timeout=exit_timeout))


COMMANDS = (serve, client, triton_repo, triton_serve)
