"""The serving commands of `trtbuild` (registered on the group in cli.py): serve, triton-repo, triton-serve."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trtbuild.cli_options import existing, out, runtime_config, serving_options


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
@serving_options
def serve(engine: Path, host: str, port: int, http_port: int | None, api_key: str | None,
          served_model_name: str | None, **serving) -> None:
    """Serve an engine over gRPC (trtbuild.v1.Generation, health, reflection), and the OpenAI API with --http-port,
    until SIGTERM / Ctrl-C."""
    from trtbuild.serving.grpc.server import serve as run_server

    run_server(engine, host=host, port=port, config=runtime_config(**serving), http_port=http_port, api_key=api_key,
               model_name=served_model_name)


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


COMMANDS = (serve, triton_repo, triton_serve)
