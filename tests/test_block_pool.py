"""BlockPool and KVCacheManager: allocation, ref counts, LRU eviction, prefix hits and counters."""

from __future__ import annotations

import pytest

from phaselab.core.block_pool import ROOT_PARENT_HASH, BlockPool, hash_block_tokens
from phaselab.core.kv_cache_manager import KVCacheManager
from phaselab.core.request import Request, RequestStatus
from phaselab.core.sampling_params import SamplingParams


def _hash(tokens: list[int]):
    return hash_block_tokens(ROOT_PARENT_HASH, tokens)


# -- BlockPool ------------------------------------------------------------------------------
def test_allocate_and_free_counts():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0 and pool.usage == 0.0
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3]
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 4
    assert pool.usage == pytest.approx(4 / 6)
    assert all(pool.ref_cnt[b] == 1 for b in a)
    assert pool.allocate(3) is None  # not enough: nothing changes
    assert pool.num_free_blocks == 2
    pool.check_invariants()
    pool.free(a)
    assert pool.num_free_blocks == 6
    pool.check_invariants()


def test_allocate_zero_and_empty_pool():
    assert BlockPool(0, 4).allocate(1) is None
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    assert BlockPool(0, 4).usage == 0.0


def test_free_queue_is_lru():
    pool = BlockPool(num_blocks=6, block_size=4)
    pool.allocate(4)  # free queue: [4, 5]
    pool.free([2])  # [4, 5, 2]
    pool.free([0])  # [4, 5, 2, 0]
    assert list(pool.free_queue) == [4, 5, 2, 0]
    assert pool.allocate(3) == [4, 5, 2]
    pool.check_invariants()


def test_ref_counts_touch_and_double_free():
    pool = BlockPool(num_blocks=3, block_size=2)
    (b,) = pool.allocate(1)  # type: ignore[misc]
    pool.touch([b])
    assert pool.ref_cnt[b] == 2
    pool.free([b])
    assert pool.ref_cnt[b] == 1 and b not in pool.free_queue
    pool.free([b])
    assert pool.ref_cnt[b] == 0 and b in pool.free_queue
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([b])


def test_touch_takes_a_free_block_out_of_the_queue():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.allocate(3)
    pool.free([1])
    assert pool.num_free_blocks == 1
    pool.touch([1])
    assert pool.num_free_blocks == 0 and pool.ref_cnt[1] == 1
    pool.check_invariants()


def test_cached_block_keeps_hash_while_free_and_is_evicted_on_reuse():
    pool = BlockPool(num_blocks=3, block_size=2)
    a = pool.allocate(3)
    assert a is not None
    h = _hash([7, 8])
    assert pool.cache_block(a[0], h)
    pool.free([a[0]])
    # freed: still findable (contents kept until the block is reused)
    assert pool.get_cached_block(h) == a[0] and pool.num_cached_blocks == 1
    pool.check_invariants()
    assert pool.allocate(1) == [a[0]]  # the only free block: reused, hash evicted
    assert pool.get_cached_block(h) is None and pool.block_hash[a[0]] is None
    pool.check_invariants()


def test_eviction_takes_least_recently_freed_first():
    pool = BlockPool(num_blocks=4, block_size=1)
    blocks = pool.allocate(4)
    assert blocks is not None
    hashes = [_hash([i]) for i in range(4)]
    for b, h in zip(blocks, hashes):
        pool.cache_block(b, h)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    assert pool.allocate(1) == [blocks[2]]
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) == blocks[0]  # not evicted yet
    assert pool.get_cached_block(hashes[3]) == blocks[3]


def test_duplicate_content_is_not_registered_twice():
    pool = BlockPool(num_blocks=2, block_size=2)
    a, b = pool.allocate(2)  # type: ignore[misc]
    h = _hash([1, 2])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert pool.block_hash[b] is None and pool.get_cached_block(h) == a
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.allocate(1)
    pool.ref_cnt[0] = 0  # owned-by-nobody block outside the free queue: a leak
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_chained_hash_depends_on_parent_and_exact_tokens():
    h1 = _hash([1, 2])
    assert hash_block_tokens(h1.value, [3, 4]) == hash_block_tokens(h1.value, [3, 4])
    assert hash_block_tokens(h1.value, [3, 4]) != hash_block_tokens(_hash([1, 5]).value, [3, 4])
    assert hash_block_tokens(h1.value, [3, 4]) != hash_block_tokens(h1.value, [4, 3])
    # deterministic across processes: a fixed value, not an address-derived hash(None)
    assert isinstance(ROOT_PARENT_HASH, int)


# -- KVCacheManager -------------------------------------------------------------------------
def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """Admission as the scheduler does it: look up, allocate, mark hits computed."""
    hits, num_hit = kv.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(req, n, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + n
    return new


def _finish(kv: KVCacheManager, req: Request) -> None:
    req.status = RequestStatus.FINISHED_ABORTED
    kv.free(req)


def test_prefix_hit_requires_full_blocks_and_exact_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))  # blocks [0..3] [4..7] and a partial one
    assert _admit(kv, a) is not None
    kv.cache_blocks(a, a.num_computed_tokens)
    assert kv.block_pool.num_cached_blocks == 2  # only full blocks
    table_a = kv.req_to_blocks["a"]

    b = _req("b", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert hits == table_a[:2] and n == 8

    c = _req("c", [0, 1, 2, 3, 4, 5, 6, 99])  # second block differs in one token
    hits, n = kv.get_computed_blocks(c)
    assert hits == table_a[:1] and n == 4

    d = _req("d", [1, 0, 2, 3, 4, 5, 6, 7, 8])  # first block differs: nothing after it counts
    assert kv.get_computed_blocks(d) == ([], 0)


def test_hit_is_capped_at_num_tokens_minus_one():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(8)))
    _admit(kv, a)
    kv.cache_blocks(a, 8)
    assert kv.block_pool.num_cached_blocks == 2
    same = _req("same", list(range(8)))  # identical: the last token must still be computed
    hits, n = kv.get_computed_blocks(same)
    assert n == 4 and len(hits) == 1
    longer = _req("longer", list(range(9)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_hits_are_shared_by_reference_and_counted():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(12)))
    _admit(kv, a)
    kv.cache_blocks(a, 12)
    b = _req("b", list(range(10)))
    new = _admit(kv, b)
    assert new is not None
    assert kv.req_to_blocks["b"][:2] == kv.req_to_blocks["a"][:2]
    assert new[:2] == kv.req_to_blocks["a"][:2]  # new_block_ids = hits, then fresh ones
    assert [kv.block_pool.ref_cnt[x] for x in kv.req_to_blocks["a"]] == [2, 2, 1]
    s = kv.stats
    assert (s.num_queries, s.num_query_tokens, s.num_hit_tokens) == (2, 22, 8)
    assert (s.num_query_blocks, s.num_hit_blocks) == ((12 - 1) // 4 + (10 - 1) // 4, 2)
    kv.check_invariants()
    _finish(kv, a)
    _finish(kv, b)
    kv.check_invariants()
    assert kv.block_pool.num_used_blocks == 0
    assert kv.block_pool.num_cached_blocks == 3  # the blocks keep their hashes while free


def test_free_request_blocks_are_hits_until_evicted():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(kv, a)
    kv.cache_blocks(a, 5)
    _finish(kv, a)
    # tail first into the free queue: the partial block, then [3, 4], then [1, 2]
    b = _req("b", [1, 2, 3, 4, 9])
    assert kv.get_computed_blocks(b)[1] == 4
    c = _req("c", [7])
    _admit(kv, c)  # takes the LRU head: a's unhashed partial block
    assert kv.get_computed_blocks(b)[1] == 4
    d = _req("d", [8])
    _admit(kv, d)  # next: a's last full block [3, 4] is evicted
    assert kv.get_computed_blocks(b)[1] == 2
    kv.check_invariants()


def test_allocate_counts_free_hits_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _req("a", [1, 2, 3, 4])
    _admit(kv, a)
    kv.cache_blocks(a, 4)
    _finish(kv, a)  # 3 free blocks, 2 of them cached
    b = _req("b", [1, 2, 3, 4, 5, 6, 7])  # hits 2 blocks, needs 2 more: 4 > 3
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 3, hits) is None
    kv.check_invariants()
    assert all(kv.block_pool.ref_cnt[x] == 0 for x in hits)  # nothing touched on failure
    c = _req("c", [1, 2, 3, 4, 5])  # hits 2 blocks, needs 1 more: fits
    assert _admit(kv, c) is not None
    assert kv.block_pool.num_free_blocks == 0
    kv.check_invariants()


def test_generated_tokens_are_cached_too():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = _req("a", [1, 2, 3])
    _admit(kv, a)
    a.append_output_token(4)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    kv.cache_blocks(a, a.num_computed_tokens)
    assert kv.block_pool.num_cached_blocks == 2  # [1, 2] and [3, 4]
    b = _req("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b)[1] == 4


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = _req("a", [1, 2, 3, 4, 5])
    _admit(kv, a)
    kv.cache_blocks(a, 5)
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.stats.num_queries == 0


def test_manager_invariants_catch_double_ownership():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3])
    _admit(kv, a)
    kv.req_to_blocks["x"] = [kv.req_to_blocks["a"][0]]  # a block held by two tables, ref 1
    with pytest.raises(AssertionError, match="owner"):
        kv.check_invariants()
