"""The systems `trtbuild bench` measures: the engine in-process (EngineCore behind an AsyncEngine), a running
`trtbuild serve`, and the Hugging Face transformers `generate()` baseline (torch / transformers imported only for it).
"""

from __future__ import annotations

import gc
import queue
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from trtbuild.bench.workload import BenchRequest, KVSampler, RequestResult
from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.configs.build_config import NO_LORA_ADAPTERS, lora_index
from trtbuild.errors import TrtbuildError

if TYPE_CHECKING:
    from trtbuild.runtime.speculative import SpeculativeConfig

SAMPLE_S = 0.02  # how often a server's KV usage is sampled during a run


class _Step(NamedTuple):
    tokens: int  # computed this step
    sampled: int  # requests that got tokens
    seconds: float
    kv_usage: float
    drafts: int  # speculative drafts among the tokens
    accepted: int
    engine_seconds: float  # of `seconds`, in the engine call


def check_adapter(name: str | None, adapters: Sequence[str], where: str, none: str = NO_LORA_ADAPTERS) -> None:
    """`--lora NAME` names one of the target's adapters, or the benchmark stops before it starts."""
    try:
        lora_index(tuple(adapters), name, f"--lora {name}", where, none)
    except ValueError as e:
        raise TrtbuildError(str(e)) from None


class EngineTarget:
    """EngineCore behind an AsyncEngine (its own loop thread), as `trtbuild serve` runs it, without gRPC.
    Every request runs under LoRA adapter `lora` (None: the base model)."""

    def __init__(self, engine_dir: Path, threads: int | None, speculative: SpeculativeConfig | None = None,
                 kv_cache_blocks: int | None = None, lora: str | None = None, lora_path: str | None = None) -> None:
        """`lora_path`: load the adapter there as `lora` into a slot of the engine first (built with --max-loras)."""
        from trtbuild.runtime.async_engine import AsyncEngine
        from trtbuild.runtime.config import RuntimeConfig
        from trtbuild.runtime.engine_core import EngineCore

        info = read_engine_config(Path(engine_dir))  # the adapter is checked before the engine loads
        if lora_path is None:
            check_adapter(lora, info.build.lora_names, f"engine {engine_dir}")
        self.lora = lora
        self.name = f"engine {engine_dir}" + (f" ({speculative.method} drafts {speculative.num_speculative_tokens})"
                                              if speculative else "")
        self.core = core = EngineCore(Path(engine_dir), RuntimeConfig(num_threads=threads, speculative=speculative,
                                                                      kv_cache_blocks=kv_cache_blocks))
        if lora_path is not None:
            core.load_lora(core.lora.prepare(lora, lora_path))
        self.vocab_size = core.vocab_size
        # what the engine runs with: each rank's threads, over all of a tensor-parallel engine's ranks
        ranks = info.model.mapping.tp_size
        self.threads = core.engine.session.get_session_options().intra_op_num_threads * ranks
        self.special_ids = frozenset(core.eos_token_ids) | (core.tokenizer.special_ids if core.tokenizer else set())
        kv = core.engine.kv  # NOTE: a tensor-parallel engine's: every rank's pool
        self.sizes = {"engine_file_bytes": info.engine_bytes, "kv_bytes_per_token": kv.bytes_per_token,
                      "kv_pool_bytes": kv.num_blocks * kv.bytes_per_block, "load_s": core.start_seconds["session"],
                      "warm_up_s": core.start_seconds["warm_up"]}
        self.steps: list[_Step] = []
        step = core.step

        def recorded_step() -> list:  # measurement hook: keep every step's stats (the core keeps only the last)
            before = core.last_stats
            outputs = step()
            if (stats := core.last_stats) is not before and stats is not None:
                self.steps.append(_Step(stats.num_scheduled_tokens, len(outputs), stats.seconds, stats.kv_cache_usage,
                                        stats.num_draft_tokens, stats.num_accepted_draft_tokens, stats.engine_seconds))
            return outputs

        core.step = recorded_step  # type: ignore[method-assign]
        self.engine = AsyncEngine(core, max_queue_size=1 << 20)

    def prepare(self, requests: list[BenchRequest]) -> list[BenchRequest]:
        from trtbuild.runtime.sampling import SamplingParams

        prepared = []
        for r in requests:
            try:
                ids = self.core.make_request(r.prompt, SamplingParams(max_tokens=r.output_tokens),
                                             lora=self.lora).prompt_ids
            except ValueError as e:
                raise TrtbuildError(f"{r.where}: {e}") from None
            _check_length(r, len(ids), self.core.scheduler.config.max_seq_len)
            prepared.append(BenchRequest(ids, r.output_tokens, r.where))
        return prepared

    def send(self, request: BenchRequest, timeout: float) -> RequestResult:
        from trtbuild.runtime.sampling import SamplingParams

        start = time.perf_counter()
        try:
            stream = self.engine.submit(request.prompt, SamplingParams(max_tokens=request.output_tokens,
                                                                       ignore_eos=True), lora=self.lora)
        except (ValueError, RuntimeError) as e:
            return RequestResult(False, error=str(e))
        result = RequestResult(True, prompt_tokens=stream.num_prompt_tokens)
        try:
            while not stream.finished:
                out = stream.get(timeout=max(0.0, start + timeout - time.perf_counter()))
                _add_tokens(result, len(out.new_token_ids), start)
                if out.finished and out.metrics is not None:
                    result.preemptions, result.cached_tokens = (out.metrics.num_preemptions,
                                                                out.metrics.num_prefix_cached_tokens)
                if out.finished and out.finish_reason == "abort":
                    return RequestResult(False, error="aborted by the engine")
        except queue.Empty:
            stream.cancel()
            return RequestResult(False, error=f"timed out after {timeout:g} s")
        except (ValueError, RuntimeError) as e:  # refused by the engine loop, or the loop died
            return RequestResult(False, error=str(e))
        return result

    def begin(self) -> None:  # between runs the loop is idle: drop cached prefixes so runs do not help each other
        self.core.kv.reset_prefix_cache()
        self.steps = []

    def end(self) -> tuple[list[float], dict[str, Any] | None]:
        # A decode-only step computes one token (plus drafts) per sequence and samples from each; a prefill more.
        prefill = [s for s in self.steps if s.tokens - s.drafts > s.sampled]
        decode = [s for s in self.steps if s.tokens - s.drafts <= s.sampled]
        breakdown = {"steps": len(self.steps), "prefill_steps": len(prefill), "decode_steps": len(decode),
                     "prefill_step_s": sum(s.seconds for s in prefill),
                     "decode_step_s": sum(s.seconds for s in decode),
                     "decode_engine_s": sum(s.engine_seconds for s in decode),
                     "mean_decode_batch": sum(s.tokens - s.drafts for s in decode) / max(1, len(decode)),
                     "draft_tokens": sum(s.drafts for s in self.steps),
                     "accepted_draft_tokens": sum(s.accepted for s in self.steps)}
        return [s.kv_usage for s in self.steps], breakdown

    def close(self) -> None:
        self.engine.shutdown()
        del self.engine, self.core  # the ORT session's threads must be gone before a baseline runs
        gc.collect()  # core.step refers back to core


class ServerTarget:
    """A running `trtbuild serve`, through serving/grpc/client.py streaming calls; KV usage is sampled with GetStats.
    Every request runs under LoRA adapter `lora` (GenerateRequest.lora; None: the base model)."""

    def __init__(self, address: str, ready_timeout: float = 30.0, api_key: str | None = None,
                 lora: str | None = None) -> None:
        import grpc

        from trtbuild.serving.grpc.client import FINISH_REASONS, GenerationClient

        self.name, self._grpc_error, self._reasons = f"server {address}", grpc.RpcError, FINISH_REASONS
        self.client = GenerationClient(address, timeout=ready_timeout, api_key=api_key)
        try:
            self.client.wait_ready(ready_timeout)
            self.info = self.client.model_info()
        except (TimeoutError, grpc.RpcError) as e:
            self.client.close()
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            raise TrtbuildError(f"cannot reach a trtbuild server at {address} ({detail}); start `trtbuild serve`"
                                ) from None
        try:
            check_adapter(lora, list(self.info.lora_names), f"the engine of the server at {address}")
        except TrtbuildError:
            self.client.close()
            raise
        self.lora = lora
        self.vocab_size = self.info.vocab_size
        self.special_ids = frozenset(self.info.eos_token_ids)  # the server does not list other special tokens
        self.sizes: dict[str, float | None] = dict.fromkeys(  # not told
            ("engine_file_bytes", "kv_bytes_per_token", "kv_pool_bytes", "load_s", "warm_up_s"))
        self._sampler: KVSampler | None = None

    def prepare(self, requests: list[BenchRequest]) -> list[BenchRequest]:
        for r in requests:
            if isinstance(r.prompt, str) and not self.info.has_tokenizer:
                raise TrtbuildError(f"{r.where}: the server's engine has no tokenizer; give input_ids")
            if isinstance(r.prompt, list):
                _check_length(r, len(r.prompt), self.info.max_seq_len)
        return requests

    def send(self, request: BenchRequest, timeout: float) -> RequestResult:
        start = time.perf_counter()
        result = RequestResult(True)
        try:
            for r in self.client.generate_stream(request.prompt, timeout=timeout, lora=self.lora,
                                                 max_tokens=request.output_tokens, ignore_eos=True):
                _add_tokens(result, len(r.token_ids), start)
                if r.finished and self._reasons.get(r.finish_reason) == "abort":
                    return RequestResult(False, error="aborted by the server")
                if r.finished:
                    u = r.usage
                    result.prompt_tokens, result.preemptions, result.cached_tokens = (
                        u.prompt_tokens, u.num_preemptions, u.cached_prefix_tokens)
        except self._grpc_error as e:
            return RequestResult(False, error=f"{e.code().name}: {e.details()}")  # type: ignore[attr-defined]
        return result

    def begin(self) -> None:
        def read() -> float:
            stats = self.client.stats()
            busy = stats.last_step.kv_cache_usage if stats.num_unfinished else 0.0  # step of this run
            return max(stats.kv_cache_usage, busy)

        self._sampler = KVSampler(read, SAMPLE_S, (self._grpc_error,))

    def end(self) -> tuple[list[float], dict[str, Any] | None]:
        return self._sampler.stop() if self._sampler is not None else [], None

    def close(self) -> None:
        self.client.close()


def _check_length(r: BenchRequest, prompt_tokens: int, max_seq_len: int) -> None:
    if prompt_tokens + r.output_tokens > max_seq_len:
        raise TrtbuildError(f"{r.where}: {prompt_tokens} prompt + {r.output_tokens} output tokens exceed the "
                            f"engine's max_seq_len {max_seq_len}; shorten the request or rebuild with --max-seq-len")


def _add_tokens(result: RequestResult, n: int, start: float) -> None:
    now = time.perf_counter() - start
    if n and result.output_tokens == 0:
        result.ttft = now
    result.output_tokens += n
    result.latency = now


# ---- HF transformers generate() -------------------------------------------------------------------------------------
def load_hf_model(path: Path) -> Any:
    """A float32 transformers causal LM from an HF folder, or from a llama GGUF via trtbuild's GGUF reader
    (transformers' own GGUF loading needs `accelerate`)."""
    import torch
    import transformers

    path = Path(path)
    if path.is_dir():
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise TrtbuildError(f"--compare-hf {path}: transformers cannot load it ({e})") from None
        return model.eval()
    from trtbuild.builder.convert.gguf_reader import read_gguf

    hf_config, state = read_gguf(path)
    kwargs = {k: v for k, v in hf_config.items() if k not in ("model_type", "torch_dtype")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise TrtbuildError(f"--compare-hf {path}: tensors do not match {hf_config['architectures'][0]} (missing "
                            f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.tie_weights()
    return model.eval()


def _tokenizer(path: Path) -> Any:
    from trtbuild.runtime.tokenizer import Tokenizer

    if path.is_dir():
        return Tokenizer(path)
    from trtbuild.builder.convert.gguf_tokenizer import export_gguf_tokenizer

    out = Path(tempfile.mkdtemp(prefix="trtbuild-bench-tok-"))
    export_gguf_tokenizer(path, out)
    return Tokenizer(out)


def hf_generate(path: Path, prompts: list[str | list[int]], output_len: int, threads: int) -> dict[str, Any]:
    """All prompts as one left-padded batch, greedy, exactly `output_len` new tokens each (min = max new tokens),
    on `threads` torch threads. Times the generate() call only (after a short warm-up), not the model load."""
    import torch
    import transformers

    path = Path(path)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        model = load_hf_model(path)
        tok = _tokenizer(path) if any(isinstance(p, str) for p in prompts) else None
        ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        cfg = model.config
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        pad = next(t for t in (cfg.pad_token_id, eos, 0) if t is not None)
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        common = dict(do_sample=False, pad_token_id=pad)
        with torch.inference_mode():
            model.generate(input_ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, min_new_tokens=2,
                           **common)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, **common)
            duration = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    new = out[:, width:]
    if new.shape[1] != output_len:
        raise TrtbuildError(f"HF generate() made {new.shape[1]} tokens per prompt instead of {output_len}")
    n = len(ids) * output_len
    return {"model": str(path), "threads": threads, "batch_size": len(ids), "output_tokens": n,
            "duration_s": duration, "output_throughput": n / duration, "token_ids": new.tolist()}
