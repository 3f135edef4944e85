"""Offline, in-process generation over the same engine loop the server runs (EngineCore)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trtbuild.runtime.beam_search import Beam
from trtbuild.runtime.config import RuntimeConfig
from trtbuild.runtime.engine_core import EngineCore, RequestOutput
from trtbuild.runtime.logprobs import TokenLogprobs
from trtbuild.runtime.sampling import SamplingParams


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # SamplingParams.logprobs: one per output token
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs (None: not asked)
    beams: list[Beam] | None = None  # SamplingParams.beam_width > 1: every answer, best first (the first is this)


class LLM:
    def __init__(self, engine_dir: Path, config: RuntimeConfig | None = None) -> None:
        self.core = EngineCore(Path(engine_dir), config)

    def stream(self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams],
               lora: str | None | Sequence[str | None] = None, embed: bool = False
               ) -> Iterator[tuple[int, RequestOutput]]:
        """Run every prompt to completion, yielding (prompt index, output delta) as tokens are sampled. `lora`: the
        engine's LoRA adapter to run them under, or one per prompt (None: the base model).
        All requests are validated before any is queued (ValueError names the bad field)."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        for name, values in (("params", params_list), ("lora", loras)):
            if len(values) != len(prompts):
                raise ValueError(f"{name}: got {len(values)} for {len(prompts)} prompts")
        requests = [self.core.make_request(p, sp, lora=name, embed=embed)
                    for p, sp, name in zip(prompts, params_list, loras, strict=True)]
        index = {r.request_id: i for i, r in enumerate(requests)}
        for r in requests:
            self.core.add_request(r)
        try:
            while self.core.has_unfinished():
                for output in self.core.step():
                    yield index[output.request_id], output
        finally:  # a consumer that stops early must not leave requests holding KV blocks
            for r in requests:
                self.core.abort_request(r.request_id)

    def close(self) -> None:
        """Stop what the engine runs besides this process (a tensor-parallel engine's rank processes), now rather
        than when the LLM is collected."""
        self.core.close()

    def load_lora(self, name: str, path: str | Path) -> None:
        """Serve a LoRA adapter (a PEFT folder or llama.cpp's adapter .gguf) under `name`, in one of the engine's
        slots (`trtbuild build --max-loras`); LoraLoadError says why it cannot."""
        self.core.load_lora(self.core.lora.prepare(name, path))

    def unload_lora(self, name: str) -> None:
        self.core.unload_lora(name)

    def embed(self, prompts: Sequence[str | list[int]], lora: str | None | Sequence[str | None] = None
              ) -> list[np.ndarray]:
        """Each prompt's embedding [hidden_size], L2-normalized: its last token's final hidden state (an engine built
        with `--task embed`)."""
        out: list[np.ndarray] = [np.empty(0)] * len(prompts)
        for i, output in self.stream(prompts, SamplingParams(max_tokens=1), lora, embed=True):
            out[i] = output.embedding
        return out

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams],
                 lora: str | None | Sequence[str | None] = None) -> list[Completion]:
        done = [Completion([], "", "") for _ in prompts]
        for i, output in self.stream(prompts, params, lora):
            done[i].token_ids.extend(output.new_token_ids)
            done[i].text += output.new_text
            done[i].logprobs.extend(output.logprobs)
            if output.prompt_logprobs is not None:
                done[i].prompt_logprobs = output.prompt_logprobs
            if output.beams is not None:
                done[i].beams = output.beams
            if output.finished:
                done[i].finish_reason = output.finish_reason or ""
        return done
