"""Per-request block tables on top of the block pool, with prefix caching.

A running request's table covers exactly its computed tokens (plus the chunk scheduled this
iteration): `len(req_to_blocks[id]) == ceil(num_computed_tokens / block_size)`. Block i of a
request holds positions `i * block_size .. (i + 1) * block_size - 1`.

Prefix caching, region by region, for one request:

    all_token_ids: | hit blocks (touched, shared) | computed, own blocks | chunk | not yet computed |
                   0                              ^ num_cached_tokens                                ^ num_tokens
    registered:    | already in the map           | full blocks registered after update() ... |

- A block is registered in the hash map only once the executor has written its K/V (the
  scheduler calls `cache_blocks` from update()), so a hit never reads K/V that a step in flight
  is still writing, and a running step never writes into a registered block. The price: two
  requests admitted in the same iteration each compute a prefix they share (vLLM registers at
  allocation instead, which relies on the runner writing every sequence's K/V of a layer before
  any attention of that layer reads it).
- Lookups (`get_computed_blocks`) use only full blocks and stop at the first miss (the chain
  makes a later hit meaningless without its parent). A hit is capped at num_tokens - 1 tokens:
  the last token must still be computed, because its logits are what the next token is sampled
  from.
- Generated tokens are cached too: a preempted request that resumes, or a multi-turn follow-up,
  hits the blocks it wrote itself.

Repeats are counted whether caching is on or off (`count_repeats`, once per request at its first
admission): the leading full blocks of its prompt that began an earlier request as well (its prompt
at admission, or its whole sequence when it finished), remembered by hash for the last SEEN_CAP
blocks. With caching off they are what a prefix cache would have skipped; with it on, repeats
beyond the hits were evicted, or computed twice by requests admitted together.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from phaselab.core.block_pool import ROOT_PARENT_HASH, BlockHash, BlockPool, hash_block_tokens
from phaselab.core.request import Request


SEEN_CAP = 1 << 16  # block hashes remembered for count_repeats (1M tokens at 16 per block)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted once per admission (first admission and every resume after a preemption)."""

    num_queries: int = 0  # admissions looked up
    num_query_tokens: int = 0  # request.num_tokens at each admission
    num_hit_tokens: int = 0  # tokens skipped thanks to the cache
    num_query_blocks: int = 0  # full blocks eligible for a hit: (num_tokens - 1) // block_size
    num_hit_blocks: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, block_size)
        self.req_to_blocks: dict[str, list[int]] = {}
        # Chained hashes of a request's full blocks, extended lazily as tokens arrive. Tokens
        # are only ever appended, so a computed hash never changes; kept across preemption.
        self._req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the table are registered (or were hits) already.
        self._num_registered_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # full blocks earlier requests began with, by hash (LRU, SEEN_CAP): count_repeats
        self._seen: OrderedDict[BlockHash, None] = OrderedDict()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    # -- lookup -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks that start this request's tokens, and how many tokens they hold.
        Pure lookup: nothing is touched until `allocate_slots` admits the request."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size  # keep the last token
        block_ids: list[int] = []
        for block_hash in self._block_hashes(request, max_hit_blocks)[:max_hit_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's block hashes, computed up to at least `num_blocks` full blocks."""
        hashes = self._req_to_block_hashes.setdefault(request.request_id, [])
        assert num_blocks <= request.num_tokens // self.block_size, "only full blocks have a hash"
        tokens, size = request.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1].value if hashes else ROOT_PARENT_HASH
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes

    def count_repeats(self, request: Request) -> int:
        """Tokens of the request's leading full blocks (a hit's span: the last token excluded) that
        an earlier request began with, and remember its own; call once, at its first admission."""
        n = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, n)[:n]
        k = 0
        while k < n and hashes[k] in self._seen:
            k += 1
        self._remember(hashes)
        return k * self.block_size

    def _remember(self, hashes: list[BlockHash]) -> None:
        seen = self._seen
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > SEEN_CAP:
            seen.popitem(last=False)

    # -- allocate / cache / free ------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None,
        record_query: bool = True,
    ) -> list[int] | None:
        """Grow the request's table to hold `num_new_tokens` more tokens after its computed ones.

        On admission (no table yet) `new_computed_blocks` are the prefix hits from
        `get_computed_blocks`; they go first in the table and count as computed (the scheduler
        then sets request.num_computed_tokens to their token count). Returns the blocks appended
        to the table (hits, then fresh ones), or None, changing nothing, if the pool cannot
        provide them. Cached free blocks count as free: allocation evicts them LRU first.
        `record_query=False` keeps an admission that did not look the cache up (a request whose
        K/V arrive from a prefill worker) out of the prefix-cache statistics.
        """
        hits = new_computed_blocks or []
        table = self.req_to_blocks.get(request.request_id)
        is_admission = table is None
        assert is_admission or not hits, "prefix hits only on admission"
        num_held = 0 if table is None else len(table)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_new_blocks = cdiv(num_computed + num_new_tokens, self.block_size) - num_held - len(hits)
        assert num_new_tokens >= 1 and num_new_blocks >= 0
        # Touching a hit that sits in the free queue takes it out of the allocatable set.
        num_hits_free = sum(1 for b in hits if self.block_pool.ref_cnt[b] == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_hits_free:
            return None
        self.block_pool.touch(hits)
        fresh = self.block_pool.allocate(num_new_blocks)
        assert fresh is not None
        new_block_ids = hits + fresh
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_block_ids)
        if is_admission:
            self._num_registered_blocks[request.request_id] = len(hits)
            if self.enable_prefix_caching and record_query:
                self._record_query(request, len(hits))
        return new_block_ids

    def _record_query(self, request: Request, num_hit_blocks: int) -> None:
        self.stats.num_queries += 1
        self.stats.num_query_tokens += request.num_tokens
        self.stats.num_hit_tokens += num_hit_blocks * self.block_size
        self.stats.num_query_blocks += (request.num_tokens - 1) // self.block_size
        self.stats.num_hit_blocks += num_hit_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks among its first `num_computed_tokens` tokens,
        whose K/V the executor has written (called from update(), after the step)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self._num_registered_blocks[rid]
        if num_full <= start:
            return
        table = self.req_to_blocks[rid]
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            if self.block_pool.block_hash[table[i]] is None:
                self.block_pool.cache_block(table[i], hashes[i])  # False: a duplicate; stays unhashed
        self._num_registered_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so the end of a sequence is evicted before
        its shareable beginning). Registered blocks keep their hashes in the free queue. A
        finished request also forgets its hashes; a preempted one keeps them for its resume."""
        rid = request.request_id
        table = self.req_to_blocks.pop(rid, None)
        if table:
            self.block_pool.free(reversed(table))
        self._num_registered_blocks.pop(rid, None)
        if request.is_finished:
            if rid in self._req_to_block_hashes:  # admitted: its whole sequence begins later ones too
                self._remember(self._block_hashes(request, request.num_tokens // self.block_size))
            self._req_to_block_hashes.pop(rid, None)

    # -- invariants -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pool invariants, plus: every block's ref count equals the number of tables holding
        it (no leak, no double ownership, nothing freed twice), and no table repeats a block."""
        self.block_pool.check_invariants()
        owners = [0] * self.block_pool.num_blocks
        for rid, table in self.req_to_blocks.items():
            assert len(set(table)) == len(table), f"request {rid} holds a block twice: {table}"
            for block_id in table:
                owners[block_id] += 1
        for block_id, num_owners in enumerate(owners):
            assert self.block_pool.ref_cnt[block_id] == num_owners, (
                f"block {block_id}: ref count {self.block_pool.ref_cnt[block_id]} but {num_owners} owner(s)"
            )
