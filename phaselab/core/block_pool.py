"""Paged-KV block pool: block ids, reference counts, an LRU free queue and the prefix-cache map.

A block holds the K/V of `block_size` consecutive token positions of one sequence. Block ids are
plain ints `0 .. num_blocks - 1`; every id is usable (no null/pad block is reserved: the torch
runner pads block tables itself). The pool knows nothing about requests: the KV cache manager
keeps the per-request block tables and calls `allocate` / `touch` / `free` / `cache_block`.

Lifecycle of one block:

    in free queue, ref 0 ──allocate (from the head)──▶ owned, ref >= 1 ──cache_block──▶ owned + hashed
      ▲   (allocate evicts the hash of a cached                │                            │
      │    block it reuses: that is LRU eviction)              │ free: ref -> 0             │ free: ref -> 0
      │                                                        ▼                            ▼
      └──────────────────────────────────── free queue tail (keeps its contents and hash) ◀┘
                                                 │ touch (a prefix-cache hit): ref 0 -> 1, leaves the queue
                                                 ▼
                                           owned again, still hashed

Invariants (`check_invariants`): a block is in the free queue iff its ref count is 0; the queue
holds no duplicates; `cached_blocks[h] == b` iff `block_hash[b] == h`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

# Parent hash of a sequence's first block. A fixed int, not hash(None): before Python 3.12,
# hash(None) is derived from an address and differs between processes.
ROOT_PARENT_HASH = 0x5048_4153_454C_4142  # "PHASELAB"


class BlockHash(NamedTuple):
    """Identity of one full block of a token sequence, chained to the blocks before it.

    The prefix-cache map is keyed by the whole tuple, so a hit requires *exact* equality of this
    block's token ids and of the parent's 64-bit hash value. A false hit therefore needs two
    different prefixes whose chained hash values collide at a block boundary and are followed by
    an identical block: about 2**-61 per pair of prefixes for ordinary input. Python's tuple hash
    of ints is deterministic across processes (only str/bytes hashing is salted) but it is not
    cryptographic; a server exposed to adversarial prompts from several tenants should swap
    `hash_block_tokens` for a SHA-256 of the same ints (it is the only place that hashes).
    """

    value: int  # hash((parent, token_ids)); the next block's `parent`
    parent: int
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: int, token_ids: Sequence[int]) -> BlockHash:
    tokens = tuple(token_ids)
    return BlockHash(hash((parent, tokens)), parent, tokens)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 0 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt: list[int] = [0] * num_blocks
        # Free blocks in eviction order: allocate pops the head (least recently freed), free
        # appends to the tail. An OrderedDict so that `touch` removes from the middle in O(1).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockHash, int] = {}  # full, computed blocks by identity

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (including cached ones, which are evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    # -- allocate / free --------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks from the head of the free queue (ref 1 each), or None (and
        change nothing) if fewer are free. Reusing a cached block evicts its hash."""
        assert num_blocks >= 0
        if num_blocks > len(self.free_queue):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; a block reaching 0 joins the tail of the free
        queue with its contents and hash intact. Callers pass a request's blocks tail first, so
        the end of a sequence is evicted before its (more shareable) beginning."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"block {block_id} freed twice"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (prefix-cache hits); a free block leaves the queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    # -- prefix cache -----------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full block whose K/V are written. Returns False (and leaves the block
        unhashed) if another block already holds the same content: two requests admitted
        together computed the same prefix; the first one registered stays the cached copy."""
        assert self.ref_cnt[block_id] > 0 and self.block_hash[block_id] is None
        if block_hash in self.cached_blocks:
            return False
        self.cached_blocks[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.block_hash[block_id] = None


    # -- invariants -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        assert len(self.free_queue) == len(set(self.free_queue)), "duplicate in the free queue"
        for block_id in range(self.num_blocks):
            ref = self.ref_cnt[block_id]
            assert ref >= 0, f"block {block_id}: negative ref count {ref}"
            assert (ref == 0) == (block_id in self.free_queue), (
                f"block {block_id}: ref {ref} but {'in' if block_id in self.free_queue else 'not in'} the free queue"
            )
            block_hash = self.block_hash[block_id]
            if block_hash is not None:
                assert self.cached_blocks.get(block_hash) == block_id, f"block {block_id}: hash not in the map"
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hash[block_id] == block_hash, f"map entry for block {block_id} is stale"
