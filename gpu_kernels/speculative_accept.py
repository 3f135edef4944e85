"""`trtbuild::SpeculativeAccept` (plugins/README.md) as one Triton program per verified sequence.

The program walks its rows in order and stops at the first rejection (a `while` loop: rows after it are never read).
Each row is read in vocabulary tiles: greedy is one pass (max, first index); sampling is a max pass, a float64
sum pass (full and with the draft left out), and for the final draw a prefix-sum pass. Probabilities are never
normalized: accept tests `u < e_d / S` and draws compare the running sum of `e = exp(x / T - max)` against
`u * total`, which differs from the reference's normalized float64 arithmetic only by rounding (~1e-16 relative),
so only a uniform within that distance of a boundary can pick another token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK: tl.constexpr):
    """First index of the row's maximum."""
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        idx = start + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        # a later tile wins only with a strictly larger value, so ties keep the first index
        take = m > best
        best_idx = tl.where(take, idx, best_idx)
        best = tl.where(take, m, best)
    return best_idx


@triton.jit
def _row_max(row_ptr, vocab, temperature, BLOCK: tl.constexpr):
    best = tl.full((), float("-inf"), tl.float64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float64) / temperature
        best = tl.maximum(best, tl.max(x, axis=0))
    return best


@triton.jit
def _row_sums(row_ptr, vocab, temperature, row_max, skip, BLOCK: tl.constexpr):
    """(sum of e over the row, the same sum without token `skip`) with e = exp(x / T - max), in float64."""
    total = tl.zeros((), tl.float64)
    rest = tl.zeros((), tl.float64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float64) / temperature
        e = tl.where(cols < vocab, tl.exp(x - row_max), 0.0)
        total += tl.sum(e, axis=0)
        rest += tl.sum(tl.where(cols == skip, 0.0, e), axis=0)
    return total, rest


@triton.jit
def _row_draw(row_ptr, vocab, temperature, row_max, skip, target, BLOCK: tl.constexpr):
    """The first token whose running sum of e (token `skip` left out) exceeds `target`; if rounding leaves none,
    the last token with e > 0 (never one of probability 0)."""
    running = tl.zeros((), tl.float64)
    found = tl.full((), -1, tl.int64)
    last_positive = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float64) / temperature
        e = tl.where((cols < vocab) & (cols != skip), tl.exp(x - row_max), 0.0)
        cum = running + tl.cumsum(e, axis=0)
        first = tl.min(tl.where(cum > target, cols, vocab), axis=0).to(tl.int64)
        found = tl.where((found < 0) & (first < vocab), first, found)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(e > 0, cols, 0), axis=0).to(tl.int64))
        running += tl.sum(e, axis=0)
    return tl.where(found < 0, last_positive, found)


@triton.jit
def _speculative_accept_kernel(logits_ptr, rows_ptr, drafts_ptr, lens_ptr, temps_ptr, uniforms_ptr,
                               num_accepted_ptr, next_tokens_ptr, vocab, stride_logits, stride_drafts,
                               stride_uniforms, BLOCK: tl.constexpr):
    a = tl.program_id(0)
    first_row = tl.load(rows_ptr + a).to(tl.int64)
    draft_len = tl.load(lens_ptr + a).to(tl.int64)
    temperature = tl.load(temps_ptr + a).to(tl.float64)
    u_ptr = uniforms_ptr + a * stride_uniforms
    i = tl.full((), 0, tl.int64)
    token = tl.full((), -1, tl.int64)
    while token < 0:
        row_ptr = logits_ptr + (first_row + i) * stride_logits
        has_draft = i < draft_len
        draft = tl.load(drafts_ptr + a * stride_drafts + i, mask=has_draft, other=-1).to(tl.int64)
        if temperature == 0:
            best = _row_argmax(row_ptr, vocab, BLOCK)
            if best != draft:  # draft is -1 on the bonus row
                token = best
        else:
            row_max = _row_max(row_ptr, vocab, temperature, BLOCK)
            total, rest = _row_sums(row_ptr, vocab, temperature, row_max, draft, BLOCK)
            if has_draft:
                x_draft = tl.load(row_ptr + draft).to(tl.float64) / temperature
                p_draft = tl.exp(x_draft - row_max) / total
                if tl.load(u_ptr + i) >= p_draft:  # rejected: draw from the row without the draft
                    target = tl.load(u_ptr + i + 1) * rest
                    token = _row_draw(row_ptr, vocab, temperature, row_max, draft, target, BLOCK)
            else:
                target = tl.load(u_ptr + i) * total
                token = _row_draw(row_ptr, vocab, temperature, row_max, -1, target, BLOCK)
        i += 1
    tl.store(num_accepted_ptr + a, i - 1)
    tl.store(next_tokens_ptr + a, token)


def speculative_accept(logits: torch.Tensor, accept_rows: torch.Tensor, draft_tokens: torch.Tensor,
                       draft_lens: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                       block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's inputs (plugins/README.md; logits float32/float16/bfloat16 [N, V]) -> (num_accepted [A] int64,
    next_tokens [A] int64). Draft lengths must lie in 0..K and each sequence's rows inside logits (not checked:
    reading them back would sync the device)."""
    if logits.ndim != 2 or draft_tokens.ndim != 2 or uniforms.ndim != 2:
        raise ValueError("speculative_accept takes logits [N, V], draft_tokens [A, K] and uniforms [A, K+1]")
    if uniforms.shape[1] != draft_tokens.shape[1] + 1:
        raise ValueError(f"uniforms need K + 1 = {draft_tokens.shape[1] + 1} columns, got {uniforms.shape[1]}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    draft_tokens, uniforms = draft_tokens.contiguous(), uniforms.to(torch.float64).contiguous()
    num = accept_rows.shape[0]
    num_accepted = torch.empty(num, dtype=torch.int64, device=logits.device)
    next_tokens = torch.empty(num, dtype=torch.int64, device=logits.device)
    if num:
        vocab = logits.shape[1]
        _speculative_accept_kernel[(num,)](
            logits, accept_rows.contiguous(), draft_tokens, draft_lens.contiguous(),
            temperatures.to(torch.float64).contiguous(), uniforms, num_accepted, next_tokens, vocab,
            logits.stride(0), draft_tokens.stride(0), uniforms.stride(0),
            BLOCK=min(block, triton.next_power_of_2(vocab)))
    return num_accepted, next_tokens
