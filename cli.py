"""The `trtbuild` command line. Heavy modules (torch, onnx, onnxruntime) are imported inside each command."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import click

from trtbuild import __version__
from trtbuild.cli_chat import chat_messages, chat_template, echo_answer, harmony_answer
from trtbuild.cli_errors import TrtbuildCommandGroup
from trtbuild.cli_options import (
    existing,
    lora_adapter_options,
    out,
    read_text_file,
    sampling_options,
    speculative_config,
    speculative_options,
)
from trtbuild.cli_serving import COMMANDS
from trtbuild.configs.build_config import (
    ATTENTION_MODES,
    FLOAT_LINEARS_MODES,
    QUANT_LINEARS_MODES,
    SPECULATIVE_DECODING_MODES,
    TASKS,
)
from trtbuild.errors import TrtbuildError
from trtbuild.quantization import LM_HEAD_QUANT_ALGOS, QUANTIZE_FORMATS, KVCacheQuantAlgo, KVPoolDtype


@click.group(cls=TrtbuildCommandGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="trtbuild")
@click.option("-v", "--verbose", is_flag=True, help="Log what each step does.")
def main(verbose: bool) -> None:
    """Build LLM engines ahead of time and generate with them.

    \b
    Flow:  trtbuild convert  (HF folder or GGUF -> checkpoint)
           trtbuild quantize (-> calibrated FP8 / INT4-AWQ / INT8-SQ checkpoint)
           trtbuild build    (checkpoint -> engine directory)
           trtbuild verify   (engine vs. the unfused build of its checkpoint)
           trtbuild run      (engine -> generated text)
           trtbuild serve    (engine -> gRPC service; also triton-repo)
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")


@main.command()
@click.option("--model", required=True, type=existing, help="Hugging Face model folder or a .gguf file.")
@click.option("--output", required=True, type=out, help="Checkpoint folder to create (must not exist or be empty).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Weight dtype of the checkpoint; auto keeps the model's.")
@click.option("--tp-size", type=click.IntRange(min=1), default=1, help="Tensor-parallel ranks.")
@click.option("--pp-size", type=click.IntRange(min=1), default=1, help="Pipeline-parallel ranks.")
@click.option("--weight-only", type=click.Choice(["int8", "int4"]), default=None,
              help="Quantize the float linear weights (round to nearest, no calibration): int8 or int4 weights with "
                   "full-precision activations, as TensorRT-LLM's --use_weight_only.")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default=None,
              help="Input features per weight scale with --weight-only [default: per output channel for int8; for "
                   "int4 the largest of 128/64/32 that divides every linear].")
@click.option("--dequantize", is_flag=True,
              help="GGUF: store the file's quantized tensors as float instead of keeping their quantization.")
@click.option("--num-layers", type=int, help="Keep the first N layers, the final norm and head: a self-draft model.")
def convert(model: Path, output: Path, dtype: str, tp_size: int, pp_size: int, weight_only: str | None,
            group_size: str | None, dequantize: bool, num_layers: int | None) -> None:
    """Convert a Llama / Qwen2 / Qwen3 / Mistral / Phi-3 / SmolLM3 / Gemma / Granite model into a checkpoint."""
    from trtbuild.builder.convert.convert import WEIGHT_ONLY_BITS, WeightOnly
    from trtbuild.builder.convert.convert import convert as run_convert

    if group_size is not None and weight_only is None:
        raise click.UsageError("--group-size applies to --weight-only; add --weight-only int8 or int4.")
    wo = None if weight_only is None else WeightOnly(WEIGHT_ONLY_BITS[weight_only], group_size and int(group_size))
    config = run_convert(model, output, dtype=dtype, tp_size=tp_size, pp_size=pp_size, weight_only=wo,
                         dequantize=dequantize, num_layers=num_layers)
    q = config.quantization
    quant = "" if q.quant_algo is None else (
        f", {q.quant_algo} (group size {q.group_size or 'per channel or mixed'}, {len(q.exclude_modules)} linears "
        "left in float)")
    click.echo(f"wrote {output}: {config.architecture}, {config.num_hidden_layers} layers, dtype {config.dtype}, "
               f"{config.mapping.world_size} rank(s){quant}")


@main.command()
@click.option("--checkpoint", required=True, type=existing, help="Folder written by `trtbuild convert`.")
@click.option("--output", required=True, type=out, help="Engine directory to create.")
@click.option("--target", type=click.Choice(["cpu", "cuda", "tensorrt"]), default="cpu",
              help="Where the engine runs: cpu (ONNX Runtime), cuda (Triton and torch kernels), tensorrt.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True,
              help="Compute dtype of the cuda target (weights, activations, KV pool); cpu computes in float32.")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=16, help="Sequences per engine step.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="Prompt + output tokens of one sequence [default: the model's context, at most 4096].")
@click.option("--max-num-tokens", type=click.IntRange(min=1), default=2048, help="Tokens packed into one step.")
@click.option("--tokens-per-block", type=click.IntRange(min=1), default=16, help="Paged KV cache block size.")
@click.option("--no-fuse", is_flag=True, help="Skip the fusion passes (for debugging).")
@click.option("--int4-accuracy-level", type=click.Choice(["1", "4"]), default="4", show_default=True,
              help="int4 and int8 weight-only linears on CPU (MatMulNBits): 4 computes in int8 (faster), 1 in fp32 "
                   "(matches the format exactly).")
@click.option("--kv-pool-dtype", type=click.Choice([d.value for d in KVPoolDtype]), default=None,
              help="Paged KV pool of an unquantized KV cache: float16 halves its memory (compute stays float32) "
                   "[default: float16 for quantized or 16-bit weights where the native attention reads it, else "
                   "float32].")
@click.option("--attention", type=click.Choice(ATTENTION_MODES), default="auto", show_default=True,
              help="CPU target: native runs attention as one trtbuild::PagedAttention kernel per layer (trtbuild's "
                   "custom-op library, compiled on first use: needs g++); split / concat lower it to standard ONNX "
                   "ops; auto: the autotuner's choice, else native where the library builds.")
@click.option("--quant-linears", type=click.Choice(QUANT_LINEARS_MODES), default="auto", show_default=True,
              help="CPU target: native runs the 4/8-bit linears (blocks of 16 or 32) with trtbuild::BlockQuantMatMul "
                   "(llama.cpp's int8 dot products; needs AVX-512 VNNI and g++), ort with ONNX Runtime's "
                   "MatMulNBits; auto: the autotuner's choice, else native where it runs.")
@click.option("--float-linears", type=click.Choice(FLOAT_LINEARS_MODES), default="auto", show_default=True,
              help="CPU target: native runs unquantized linears with trtbuild::DenseMatMul on their weights in "
                   "float16 or bfloat16 where that is exact (half the bytes), else float32 (needs AVX-512 and g++); "
                   "ort with MatMul on float32 weights; auto: the autotuner's choice, else native where it runs.")
@click.option("--autotune", type=click.Choice(["off", "fast", "full"]), default="off", show_default=True,
              help="Time the attention, quantized-linear and thread-count tactics on this machine and keep the fastest "
                   "(fast: a single user's decode and prefill; full: also a full decode batch and a long context).")
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON file of earlier autotuning timings (created if missing): a rebuild skips what it measured.")
@click.option("--speculative-decoding-mode", type=click.Choice(SPECULATIVE_DECODING_MODES), default="none",
              show_default=True,
              help="draft-tokens: the engine verifies speculative drafts itself (greedy acceptance and rejection "
                   "sampling at a temperature) and returns accepted counts and next tokens instead of their logits.")
@click.option("--max-draft-len", type=click.IntRange(min=0), default=None,
              help="Drafts per sequence the engine verifies (draft-tokens mode) [default: 4 in that mode].")
@click.option("--lora", "lora_adapters", multiple=True, callback=lora_adapter_options, metavar="NAME=PATH",
              help="A LoRA adapter (a PEFT adapter folder, or llama.cpp's LoRA .gguf) built in beside the base "
                   "weights; a request runs under it by name (the OpenAI API's `model`, gRPC's `lora`, Triton's "
                   "`lora_name`, `trtbuild run|client --lora NAME`). Repeat for more adapters.")
@click.option("--max-loras", type=click.IntRange(min=0), default=0,
              help="Instead of --lora: slots for this many LoRA adapters that the running engine loads and unloads "
                   "(`trtbuild serve --lora-modules NAME=PATH`, POST /v1/load_lora_adapter), as vLLM's.")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=None,
              help="The highest adapter rank the slots take [default: 16 with --max-loras].")
@click.option("--task", type=click.Choice(TASKS), default="generate", show_default=True,
              help="embed: the engine returns each prompt's last hidden state, normalized (an embedding model's "
                   "last-token pooling; served at the OpenAI API's /v1/embeddings) instead of generating text.")
@click.option("--verify", "verify_after", is_flag=True,
              help="Then run the engine against an unfused build of the checkpoint with polygraphy and print each "
                   "output's error against its tolerance (as `trtbuild verify`); exit non-zero if one fails.")
def build(checkpoint: Path, output: Path, target: str, dtype: str, max_batch_size: int, max_seq_len: int | None,
          max_num_tokens: int, tokens_per_block: int, no_fuse: bool, int4_accuracy_level: str,
          kv_pool_dtype: str | None, attention: str, quant_linears: str, float_linears: str, autotune: str,
          timing_cache: Path | None, speculative_decoding_mode: str, max_draft_len: int | None,
          lora_adapters: tuple[tuple[str, str], ...], max_loras: int, max_lora_rank: int | None, task: str,
          verify_after: bool) -> None:
    """Compile a checkpoint into an engine directory for one target."""
    from trtbuild.builder.build import build_engine

    timer = None
    if autotune != "off" and target == "cpu":
        from trtbuild.bench.autotune import time_graph as timer
    build_engine(checkpoint, output, target=target, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                 max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block, fuse=not no_fuse,
                 int4_accuracy_level=int(int4_accuracy_level), kv_pool_dtype=kv_pool_dtype, attention=attention,
                 quant_linears=quant_linears, float_linears=float_linears, autotune=autotune, timer=timer,
                 timing_cache=timing_cache, speculative_decoding_mode=speculative_decoding_mode,
                 max_draft_len=max_draft_len if max_draft_len is not None else
                 (4 if speculative_decoding_mode == "draft-tokens" else 0), lora_adapters=lora_adapters,
                 max_loras=max_loras, max_lora_rank=(max_lora_rank or 16) if max_loras else (max_lora_rank or 0),
                 task=task)
    click.echo(f"wrote engine {output}")
    if autotune != "off" and target == "cpu":
        click.echo(_tactics_summary(output))
    if verify_after:
        _verify(output, checkpoint, None)


@main.command()
@click.option("--engine", required=True, type=existing, help="Engine directory written by `trtbuild build`.")
@click.option("--checkpoint", type=existing, default=None,
              help="The checkpoint folder the engine was built from (required): the unfused reference is built "
                   "from it, in a temporary directory.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
def verify(engine: Path, checkpoint: Path | None, threads: int | None) -> None:
    """Run an engine against the unfused build of its checkpoint (polygraphy) and print each output's max absolute
    and relative error against its tolerance; exit non-zero if one fails."""
    _verify(engine, checkpoint, threads)


def _tactics_summary(engine: Path) -> str:
    from trtbuild.builder.engine_dir import read_engine_config

    lines = []
    for family, t in read_engine_config(engine).tactics.items():
        if isinstance(t, dict) and "chosen" in t:
            timings = "; ".join(f"{name}: " + ", ".join(f"{c} {ms:.2f} ms" for c, ms in by_class.items())
                                for name, by_class in t["timings_ms"].items())
            lines.append(f"autotune {family}: {t['chosen']} ({t['source']}; {timings})")
    return "\n".join(lines)


def _verify(engine: Path, checkpoint: Path | None, threads: int | None) -> None:
    from trtbuild.bench.verify import verify_engine

    report = verify_engine(engine, checkpoint, num_threads=threads, echo=lambda m: click.echo(m, err=True))
    click.echo(report.table())
    report.check()


@main.command()
@click.option("--engine", required=True, type=existing, help="Engine directory written by `trtbuild build`.")
@click.option("--prompt", default=None, help="Text to continue.")
@click.option("--chat", default=None, help="A user message, answered through the model's chat template.")
@click.option("--system", default=None, help="System message before --chat.")
@sampling_options
@speculative_options
@click.option("--lora", default=None, metavar="NAME[=PATH]",
              help="Run under this LoRA adapter of the engine (built in with `trtbuild build --lora NAME=PATH`); "
                   "NAME=PATH loads the adapter at PATH into a slot first (an engine built with --max-loras).")
@click.option("--beam-width", type=click.IntRange(min=1), default=1, show_default=True,
              help="Beam search with this many beams: the best answer is printed, the others after it on stderr.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
def run(engine: Path, prompt: str | None, chat: str | None, system: str | None, max_tokens: int, temperature: float,
        top_k: int, top_p: float, seed: int | None, speculative_tokens: int, prompt_lookup_max: int,
        draft_engine: Path | None, lora: str | None, beam_width: int, threads: int | None) -> None:
    """Generate text from a prompt (or answer a --chat message), streaming it to the terminal."""
    from trtbuild.runtime.config import RuntimeConfig
    from trtbuild.runtime.llm import LLM
    from trtbuild.runtime.sampling import SamplingParams

    template = chat_template(engine, prompt, chat, system)
    harmony = harmony_answer(template)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens,
                            stop_token_ids=template.end_of_turn_token_ids if template else (),
                            skip_special_tokens=harmony is None, beam_width=beam_width)
    spec = speculative_config(speculative_tokens, prompt_lookup_max, draft_engine)
    llm = LLM(engine, RuntimeConfig(num_threads=threads, max_batch_size=beam_width, speculative=spec))
    if lora is not None and "=" in lora:
        lora, _, path = lora.partition("=")
        llm.load_lora(lora, path)
    if template is not None:
        if llm.core.tokenizer is None:
            raise TrtbuildError(f"{engine} has no tokenizer.json, which --chat needs; rebuild with tokenizer files.")
        request: str | list[int] = template.encode(llm.core.tokenizer, chat_messages(chat, system))
    else:
        request = prompt
    outputs = llm.stream([request], params, lora)
    first = next(outputs)  # the request passed validation: echo the prompt (not a chat's), then stream
    if template is None:
        click.echo(prompt, nl=False)
    for _, output in itertools.chain([first], outputs):
        echo_answer(output.new_text, harmony, final=output.finished)
    click.echo()
    for rank, beam in enumerate((output.beams or [])[1:], start=2):
        click.echo(f"beam {rank} (score {beam.score:.4f}): {beam.text}", err=True)


@main.command()
@click.option("--engine", type=existing, default=None, help="Engine directory: benchmark it in-process.")
@click.option("--address", default=None, help="host:port of a running `trtbuild serve` to benchmark instead.")
@click.option("--backend", type=click.Choice(["grpc", "openai"]), default="grpc", show_default=True,
              help="How --address is spoken to: grpc (`trtbuild serve`) or openai (`trtbuild serve --http-port`, "
                   "llama-server, vllm serve; streaming /v1/completions).")
@click.option("--api-key", envvar="TRTBUILD_API_KEY", default=None,
              help="The server's API key (bearer token), for either backend [env: TRTBUILD_API_KEY].")
@click.option("--dataset", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help='JSON lines {"prompt": "..." or "input_ids": [...], "output_tokens": N}.')
@click.option("--num-requests", type=click.IntRange(min=1), default=None,
              help="Synthetic requests (with --dataset: use the first N lines).")
@click.option("--input-len", type=click.IntRange(min=1), default=None, help="Synthetic prompt tokens (random ids).")
@click.option("--output-len", type=click.IntRange(min=1), default=None, help="Synthetic output tokens.")
@click.option("--seed", type=int, default=0, help="Seed of the synthetic prompts and the arrival times.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="Requests in flight at most.")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=float("inf"),
              help="Poisson arrivals, requests per second (inf: all at once).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              help="Seconds each request may take; slower ones are cancelled and counted as failed.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Engine (ONNX Runtime) and HF (torch) threads [default: all cores].")
@click.option("--compare-sequential", is_flag=True, help="Also run the requests one at a time; print the speedup.")
@click.option("--compare-engine", type=existing, default=None,
              help="Another engine of the same model (e.g. the fp32 build of a quantized one): run the same requests "
                   "on it; print the speedup, engine file and KV bytes-per-token ratios.")
@click.option("--compare-hf", type=existing, default=None,
              help="HF model folder or llama .gguf: also time transformers generate() on the same prompts batched.")
@click.option("--rounds", type=click.IntRange(min=1), default=1,
              help="Run the engine and its comparisons this many times, alternating; the speedups printed are the "
                   "medians of the rounds' ratios (steadier on a machine whose speed drifts).")
@speculative_options
@click.option("--kv-cache-blocks", type=click.IntRange(min=1), default=None,
              help="KV blocks of the in-process engines [default: the runtime's, as `trtbuild serve`].")
@click.option("--lora", default=None, metavar="NAME[=PATH]",
              help="Send every request under this LoRA adapter of the engine (its base model if unset); "
                   "--compare-engine runs under it too. NAME=PATH first loads the adapter into a slot of each "
                   "in-process engine (built with --max-loras).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bench(engine: Path | None, address: str | None, backend: str, api_key: str | None, dataset: Path | None,
          num_requests: int | None, input_len: int | None, output_len: int | None, seed: int,
          concurrency: int | None, request_rate: float,
          timeout: float, threads: int | None, compare_sequential: bool, compare_engine: Path | None,
          compare_hf: Path | None, rounds: int, speculative_tokens: int, prompt_lookup_max: int,
          draft_engine: Path | None, kv_cache_blocks: int | None, lora: str | None, as_json: bool) -> None:
    """Measure throughput and latency of an engine (in-process) or a server under load, with baselines as ratios."""
    from trtbuild.bench.report import format_report, to_json
    from trtbuild.bench.run import BenchOptions, run_bench

    lora_name, _, lora_path = (lora or "").partition("=")  # NAME, or NAME=PATH to load into a slot first
    options = BenchOptions(engine=engine, address=address, backend=backend, api_key=api_key, dataset=dataset,
                           num_requests=num_requests, input_len=input_len, output_len=output_len, seed=seed,
                           concurrency=concurrency, request_rate=request_rate, timeout=timeout, threads=threads,
                           compare_sequential=compare_sequential, compare_engine=compare_engine, compare_hf=compare_hf,
                           rounds=rounds, speculative=speculative_config(speculative_tokens, prompt_lookup_max,
                                                                         draft_engine),
                           kv_cache_blocks=kv_cache_blocks, lora=lora_name or None, lora_path=lora_path or None)
    report = run_bench(options, log=lambda message: click.echo(message, err=True))
    click.echo(to_json(report) if as_json else format_report(report))


@main.command("eval")
@click.option("--engine", required=True, type=existing, help="Engine directory written by `trtbuild build`.")
@click.option("--dataset", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="UTF-8 text file, tokenized whole by the engine's tokenizer.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="Tokens fed per sliding window [default: the engine's max_seq_len, at most 1024].")
@click.option("--stride", type=click.IntRange(min=1), default=None,
              help="Tokens scored per window (each token once) [default: half the window].")
@click.option("--reference-engine", type=existing, default=None,
              help="A second engine (e.g. unquantized): report its perplexity and the top-1 agreement.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
def eval_command(engine: Path, dataset: Path, max_seq_len: int | None, stride: int | None,
                 reference_engine: Path | None, threads: int | None) -> None:
    """Perplexity of an engine on a text (sliding windows), optionally against a reference engine."""
    from trtbuild.bench.perplexity import evaluate_text

    r = evaluate_text(engine, read_text_file(dataset), max_seq_len=max_seq_len, stride=stride,
                      reference_engine=reference_engine, num_threads=threads)
    click.echo(f"perplexity {r.perplexity:.4f} (mean NLL {r.nll:.4f} nats) over {r.num_tokens} tokens, "
               f"{r.num_windows} windows of {r.max_seq_len} tokens, stride {r.stride}")
    if r.reference_perplexity is not None:
        click.echo(f"reference perplexity {r.reference_perplexity:.4f}; top-1 agreement "
                   f"{100 * r.argmax_agreement:.2f}% of {r.num_tokens} positions")


@main.command()
@click.option("--model", required=True, type=existing,
              help="Hugging Face model folder, a .gguf file, or an unquantized trtbuild checkpoint folder.")
@click.option("--output", required=True, type=out, help="Checkpoint folder to create (must not exist or be empty).")
@click.option("--qformat", required=True,
              type=click.Choice(QUANTIZE_FORMATS),
              help="fp8: e4m3 weights and activations; int4_awq: 4-bit weights, AWQ; int8_sq: int8 SmoothQuant; "
                   "full_prec: the weights as they are (with --kv-cache-qformat: the KV cache only).")
@click.option("--kv-cache-qformat", type=click.Choice([a.value for a in KVCacheQuantAlgo]), default=None,
              help="Also quantize the KV cache (per-layer static scales).")
@click.option("--calib-dataset", type=existing, default=None,
              help='.txt file, .jsonl (field "text") or folder of .txt [default: Python standard-library docstrings].')
@click.option("--calib-size", type=click.IntRange(min=1), default=512, help="Calibration samples.")
@click.option("--calib-max-seq-len", type=click.IntRange(min=1), default=512, help="Tokens per calibration sample.")
@click.option("--awq-block-size", type=click.IntRange(min=1), default=None,
              help="int4_awq: input features per weight scale (a power of two that divides them) [default: the "
                   "largest of 128/64/32 that divides every quantized linear, printed].")
@click.option("--awq-grid", type=click.IntRange(min=2), default=None,
              help="int4_awq: AWQ scale exponents (alphas) tried per linear, evenly over [0, 1]; fewer is faster "
                   "and may pick a worse scale (docs/quantization.md, Calibration time) [default: 11, modelopt's "
                   "awq_lite grid].")
@click.option("--smoothquant-alpha", type=float, default=None,
              help="int8_sq: SmoothQuant migration strength in [0, 1] (1 moves all activation outliers into the "
                   "weights) [default: 0.7, or 0.5 with --per-token-activations].")
@click.option("--per-token-activations", is_flag=True, default=False,
              help="int8_sq: quantize activations per token with a dynamic scale (more accurate, slower) instead of "
                   "one static calibrated scale per linear.")
@click.option("--fuse-shared-scales", is_flag=True, default=False,
              help="Make q/k/v and gate/up of each layer share their input (and fp8 weight) scales, as TensorRT-LLM "
                   "needs to fuse them; less accurate. Default: every linear keeps its own scales.")
@click.option("--exclude", multiple=True, default=("lm_head",),
              help="Keep linears whose checkpoint name matches this fnmatch pattern unquantized (repeatable; "
                   "replaces the default), e.g. 'transformer.layers.0.*'.")
@click.option("--lm-head-qformat", type=click.Choice([a.value for a in LM_HEAD_QUANT_ALGOS]), default=None,
              help="Give lm_head (excluded from --qformat) its own format: int8_wo is int8 weights with a scale per "
                   "output channel and full-precision activations (W8A16). Default: lm_head stays in --dtype.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="Dtype of the unquantized tensors; auto keeps the model's.")
@click.option("--tp-size", type=click.IntRange(min=1), default=1, help="Tensor-parallel ranks.")
@click.option("--pp-size", type=click.IntRange(min=1), default=1, help="Pipeline-parallel ranks.")
def quantize(model: Path, output: Path, qformat: str, kv_cache_qformat: str | None, calib_dataset: Path | None,
             calib_size: int, calib_max_seq_len: int, awq_block_size: int | None, awq_grid: int | None,
             smoothquant_alpha: float | None, per_token_activations: bool, fuse_shared_scales: bool,
             exclude: tuple[str, ...], lm_head_qformat: str | None, dtype: str, tp_size: int, pp_size: int) -> None:
    """Calibrate a model with nvidia-modelopt and write a quantized checkpoint (docs/quantization.md)."""
    from trtbuild.quantize.options import QuantizeOptions
    from trtbuild.quantize.quantize import quantize as run_quantize

    options = QuantizeOptions(model, output, qformat, kv_cache_qformat=kv_cache_qformat, calib_dataset=calib_dataset,
                              calib_size=calib_size, calib_max_seq_len=calib_max_seq_len,
                              awq_block_size=awq_block_size, awq_grid=awq_grid, smoothquant_alpha=smoothquant_alpha,
                              per_token_activations=per_token_activations, shared_input_scales=fuse_shared_scales,
                              exclude=exclude, lm_head_qformat=lm_head_qformat, dtype=dtype, tp_size=tp_size,
                              pp_size=pp_size)
    click.echo(f"wrote {output}: {run_quantize(options).summary()}")

for command in COMMANDS:
    main.add_command(command)

if __name__ == "__main__":
    main()
