"""Block pool, prefix reuse and scheduler: exact block ids, eviction order, chunked prefill, policies, preemption."""

from __future__ import annotations

import pytest

from trtbuild.runtime.block_pool import BlockPool
from trtbuild.runtime.kv_cache_manager import KVCacheManager
from trtbuild.runtime.request import FinishReason, Request, RequestStatus
from trtbuild.runtime.sampling import SamplingParams
from trtbuild.runtime.scheduler import Scheduler, SchedulerConfig

BS = 4  # tokens per block


def req(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,))


def test_block_pool_allocates_in_order_and_frees_to_the_back():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.cache(1, 111)
    pool.free([1, 0])  # 1 is cached: back of the queue; 0 uncached: front (reused first)
    assert list(pool.free_queue) == [0, 3, 1]
    assert pool.allocate(2) == [0, 3]
    assert pool.lookup(111) == 1
    assert pool.allocate(1) == [1]  # evicts the cached block
    assert pool.lookup(111) is None
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_prefix_reuse_shares_full_blocks_and_lru_eviction():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(10, 20)))  # 10 tokens: 2 full blocks + 2 tokens
    assert not kv.computed_prefix(a)
    assert kv.allocate(a, 10)
    assert kv.block_table(a) == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    b = req("b", list(range(10, 18)) + [99, 98, 97])  # shares a's first two blocks
    assert kv.computed_prefix(b).tables == ((0, 1),)
    assert kv.allocate(b, 11, kv.computed_prefix(b))
    assert kv.block_table(b) == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    # free queue: uncached 3 and 2 go to the front; cached blocks follow in eviction order (tails first)
    assert list(kv.pool.free_queue) == [3, 2, 4, 5, 1, 0]
    c = req("c", list(range(10, 14)) + [7, 7, 7, 7, 7])  # matches block 0 only
    assert kv.computed_prefix(c).tables == ((0,),)
    d = req("d", [5] * 23)  # needs all 6 blocks: evicts cached ones LRU-first
    assert kv.allocate(d, 23)
    assert kv.block_table(d) == [3, 2, 4, 5, 1, 0]
    assert not kv.computed_prefix(c)


def test_whole_prompt_cached_still_computes_the_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(8)))
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = req("b", list(range(8)))
    assert kv.computed_prefix(b).tables == ((0,),)  # block 1 holds the last token, which must be recomputed


def make_scheduler(num_blocks=16, policy="max_utilization", max_num_tokens=16, max_batch_size=4, chunk=None,
                   caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_tokens=max_num_tokens, max_batch_size=max_batch_size, max_seq_len=64,
                             policy=policy, max_prefill_chunk=chunk)
    return Scheduler(config, kv)


def run_step(s: Scheduler, token: int = 5):
    out = s.schedule()
    s.update(out, [[token] for c in out.chunks if c.num_logits])
    return out


def test_stop_string_truncation_goes_through_the_scheduler():
    """A stop string found in the text of a step's tokens: finish_requests keeps the output up to it, frees the
    blocks, and reports stop even when update() had already ended the request by length on the same step."""
    s = make_scheduler()
    a = req("a", [1] * 6, max_tokens=3)
    s.add_request(a)
    run_step(s, token=5)  # prefill: output [5]
    assert s.kv.block_table(a) == [0, 1]
    run_step(s, token=6)
    out = s.schedule()
    s.update(out, [[7]])  # third output token: length
    assert a.finish_reason == FinishReason.LENGTH and a.token_ids == [1] * 6 + [5, 6, 7]
    s.finish_requests([a], FinishReason.STOP, truncate_to=2)  # the stop string ended inside token 6
    assert a.token_ids == [1] * 6 + [5, 6] and a.finish_reason == FinishReason.STOP
    assert a.num_computed_tokens <= len(a.token_ids) and s.kv.pool.num_free == 16 and not s.has_unfinished()

    b = req("b", [1] * 6)
    s.add_request(b)
    run_step(s, token=5)
    run_step(s, token=6)  # still running: truncation finishes it and returns its blocks
    s.finish_requests([b], FinishReason.STOP, truncate_to=1)
    assert b.token_ids == [1] * 6 + [5] and b.finished and s.kv.pool.num_free == 16


def test_chunked_prefill_mixes_with_decode_within_the_token_budget():
    s = make_scheduler(max_num_tokens=8)
    a, b = req("a", [1] * 3), req("b", [3] * 13)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [(c.request.request_id, c.start, c.num_tokens, c.num_logits) for c in out.chunks] == [
        ("a", 0, 3, 1), ("b", 0, 5, 0)]
    out = run_step(s)  # a decodes 1 token, b continues its prefill with the remaining budget
    assert [(c.request.request_id, c.start, c.num_tokens, c.num_logits) for c in out.chunks] == [
        ("a", 3, 1, 1), ("b", 5, 7, 0)]
    out = run_step(s)
    assert [(c.request.request_id, c.start, c.num_tokens, c.num_logits) for c in out.chunks] == [
        ("a", 4, 1, 1), ("b", 12, 1, 1)]
    assert b.output_ids == [5]


def test_max_prefill_chunk_caps_one_request():
    s = make_scheduler(max_num_tokens=16, chunk=4)
    s.add_request(req("a", [1] * 10))
    assert [c.num_tokens for c in run_step(s).chunks] == [4]


def test_guaranteed_no_evict_reserves_the_whole_lifetime():
    s = make_scheduler(num_blocks=6, policy="guaranteed_no_evict")
    a, b = req("a", [1] * 4, max_tokens=12), req("b", [3] * 4, max_tokens=12)  # 16 tokens = 4 blocks each
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert s.kv.block_table(a) == [0, 1, 2, 3]
    assert b.status == RequestStatus.WAITING
    while not a.finished:
        run_step(s)
    assert a.finish_reason == FinishReason.LENGTH and a.num_output_tokens == 12
    run_step(s)
    assert b.status == RequestStatus.RUNNING


def test_max_utilization_preempts_the_latest_and_recomputes_it():
    s = make_scheduler(num_blocks=5, policy="max_utilization")
    a, b = req("a", [1] * 4, max_tokens=12), req("b", [3] * 4, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both admitted, one block each for their 4 prompt tokens
    assert s.kv.block_table(a) == [0] and s.kv.block_table(b) == [1]
    preempted = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        out = run_step(s)
        preempted += out.preempted
    assert preempted and preempted[0] == "b"
    assert a.finished and b.finished
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert b.metrics.num_preemptions >= 1
    assert s.kv.pool.num_free == 5


def test_prefix_cached_tokens_are_not_recomputed():
    s = make_scheduler()
    a = req("a", list(range(10, 19)), max_tokens=1)
    s.add_request(a)
    run_step(s)
    assert a.finished
    b = req("b", list(range(10, 19)) + [50], max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 2)
    assert b.metrics.num_prefix_cached_tokens == 8
    assert out.chunks[0].block_ids[:2] == (0, 1)  # a's full blocks, shared


def test_requests_that_can_never_fit_are_rejected_at_submission():
    s = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("a", [1] * 4, max_tokens=20))
    with pytest.raises(ValueError, match="max_seq_len"):
        s.add_request(req("b", [1] * 64))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("c", []))


def test_stop_token_and_abort_free_blocks():
    s = make_scheduler()
    a = req("a", [1] * 5)
    s.add_request(a)
    run_step(s, token=2)  # eos
    assert a.finish_reason == FinishReason.STOP and s.kv.pool.num_free == 16
    b = req("b", [1] * 5)
    s.add_request(b)
    run_step(s)
    s.finish_requests([b], FinishReason.ABORT)
    s.finish_requests([b], FinishReason.ABORT)  # idempotent
    assert s.kv.pool.num_free == 16 and not s.has_unfinished()
