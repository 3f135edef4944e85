"""`trtbuild eval`: perplexity of an engine on a text, and top-1 agreement with a reference engine.

Sliding windows score every token after the first exactly once. With window length L (tokens fed per window) and
stride S (targets per window), window k scores targets [a_k, a_k + S) and feeds the L tokens before its last
target, so every target sees at least L + 1 - S tokens of context; the engine returns all the window's needed
logits in one pass (SequenceChunk.num_logits), split into chunks of at most max_num_tokens (or `chunk_size`).
Later chunks read earlier ones from the KV pool; since attention reads every K/V as the pool stores it (quantized
or not), the scores do not depend on the chunking.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trtbuild.builder.engine_dir import read_engine_config
from trtbuild.errors import ConfigError
from trtbuild.runtime.engine import CpuEngine, SequenceChunk, in_every_group
from trtbuild.runtime.tensor_parallel import TensorParallelEngine, make_cpu_engine

AnyCpuEngine = CpuEngine | TensorParallelEngine  # one rank or several


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed
    first_target: int  # targets are tokens first_target .. end - 1
    end: int

    @property
    def num_targets(self) -> int:
        return self.end - self.first_target


@dataclass(frozen=True)
class EvalResult:
    num_tokens: int  # tokens scored
    nll: float  # mean negative log-likelihood, nats per token
    perplexity: float
    num_windows: int
    max_seq_len: int
    stride: int
    reference_perplexity: float | None = None
    argmax_agreement: float | None = None  # fraction of scored positions where both engines' top-1 token agrees


def sliding_windows(num_tokens: int, max_seq_len: int, stride: int) -> list[Window]:
    """Windows whose targets partition tokens 1 .. num_tokens - 1; each feeds at most max_seq_len tokens."""
    if not 1 <= stride <= max_seq_len:
        raise ValueError(f"stride must be in 1..max_seq_len ({max_seq_len}), got {stride}")
    windows, first = [], 1
    while first < num_tokens:
        end = min(first + stride, num_tokens)
        windows.append(Window(max(0, end - 1 - max_seq_len), first, end))
        first = end
    return windows


def window_logits(engine: AnyCpuEngine, token_ids: Sequence[int], window: Window, chunk_size: int | None = None
                  ) -> np.ndarray:
    """Logits [num_targets, vocab] predicting tokens first_target .. end - 1 from the window's context."""
    b = engine.info.build
    step = min(chunk_size or b.max_num_tokens, b.max_num_tokens)
    feed = list(token_ids[window.begin : window.end - 1])  # the logit at position p predicts token p + 1
    first_logit = window.first_target - 1 - window.begin
    blocks = list(range(-(-len(feed) // b.tokens_per_block)))
    groups = len(engine.kv.groups)  # _open gave each KV cache group an equal share of the pool
    out = []
    for start in range(0, len(feed), step):
        stop = min(start + step, len(feed))
        wanted = max(0, stop - max(start, first_logit))
        logits = engine.step(in_every_group([SequenceChunk("eval", feed[start:stop], start, wanted, blocks)],
                                            groups, engine.kv.num_blocks // groups))
        if wanted:
            out.append(logits)
    return np.concatenate(out)


def _scores(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position negative log-likelihood of the targets (float64) and top-1 token."""
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x - peak).sum(axis=-1)) + peak[:, 0]
    return log_z - x[np.arange(len(targets)), targets], logits.argmax(axis=-1)


def _score_engine(engine: AnyCpuEngine, token_ids: Sequence[int], windows: list[Window], chunk_size: int | None
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    ids = np.asarray(token_ids, dtype=np.int64)
    for w in windows:
        yield _scores(window_logits(engine, token_ids, w, chunk_size), ids[w.first_target : w.end])


def _open(engine_dir: Path, max_seq_len: int, num_threads: int | None) -> AnyCpuEngine:
    info = read_engine_config(Path(engine_dir), expect_target="cpu")
    b = info.build
    if max_seq_len > b.max_seq_len:
        raise ConfigError("max_seq_len", f"{max_seq_len} exceeds the engine's build limit {b.max_seq_len} "
                                         f"({engine_dir}); ask for {b.max_seq_len} or less")
    return make_cpu_engine(info, num_threads=num_threads,
                           num_blocks=len(info.kv_cache_groups) * -(-max_seq_len // b.tokens_per_block))


def evaluate(engine_dir: Path, token_ids: Sequence[int], max_seq_len: int | None = None, stride: int | None = None,
             reference_engine: Path | None = None, num_threads: int | None = None, chunk_size: int | None = None
             ) -> EvalResult:
    """Perplexity of `engine_dir` on token_ids; with `reference_engine`, that engine's perplexity and the
    per-position top-1 agreement of the two on the same windows."""
    if len(token_ids) < 2:
        raise ValueError("the text has fewer than 2 tokens; nothing to score")
    length = max_seq_len or min(read_engine_config(Path(engine_dir)).build.max_seq_len, 1024)
    stride = stride or max(1, length // 2)
    windows = sliding_windows(len(token_ids), length, stride)
    engine = _open(engine_dir, length, num_threads)
    vocab = engine.info.model.vocab_size
    if bad := [t for t in token_ids if not 0 <= t < vocab]:
        raise ValueError(f"token id {bad[0]} is outside the engine's vocabulary (0 .. {vocab - 1}); its tokenizer "
                         "does not belong to this model, or the ids were made for another one")
    scored = list(_score_engine(engine, token_ids, windows, chunk_size))
    nll = float(np.concatenate([s[0] for s in scored]).mean())
    result = dict(num_tokens=len(token_ids) - 1, nll=nll, perplexity=math.exp(nll), num_windows=len(windows),
                  max_seq_len=length, stride=stride)
    if reference_engine is not None:
        ref = _open(reference_engine, length, num_threads)
        if ref.info.model.vocab_size != engine.info.model.vocab_size:
            raise ValueError(f"the reference engine's vocabulary ({ref.info.model.vocab_size}) differs from the "
                             f"engine's ({engine.info.model.vocab_size}); compare engines of the same model")
        ref_scored = list(_score_engine(ref, token_ids, windows, chunk_size))
        ref_nll = float(np.concatenate([s[0] for s in ref_scored]).mean())
        agree = np.concatenate([a[1] == b[1] for a, b in zip(scored, ref_scored, strict=True)])
        result.update(reference_perplexity=math.exp(ref_nll), argmax_agreement=float(agree.mean()))
    return EvalResult(**result)


def evaluate_text(engine_dir: Path, text: str, **options) -> EvalResult:
    """`evaluate` on text tokenized by the engine's tokenizer (with its special tokens, e.g. BOS)."""
    from trtbuild.runtime.tokenizer import Tokenizer

    return evaluate(engine_dir, Tokenizer(Path(engine_dir)).encode(text), **options)
