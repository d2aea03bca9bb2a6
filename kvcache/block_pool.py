"""Fixed-size KV blocks: reference counts, an LRU free queue and a prefix-cache map.

A block whose ref count drops to 0 goes to the tail of the free queue but keeps its hash,
so a later request with the same prefix can take it back ("touch"). Allocation pops the
head of the queue, i.e. evicts the least recently freed cached block first.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

BlockHash = bytes
SUMMARY_KEY_BYTES = 8  # a cache summary lists hash prefixes: enough to tell prefixes apart when routing


def summary_key(block_hash: BlockHash) -> bytes:
    return block_hash[:SUMMARY_KEY_BYTES]


HASH_BYTES = 16


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash: equal hashes mean equal whole prefixes, not just equal blocks. A prompt's first
    block chains from its salt (a LoRA adapter's: kvcache/manager.py), or from nothing."""
    h = hashlib.blake2b(parent or b"", digest_size=HASH_BYTES)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The cache key of a prefix's block in KV group `group` (kvcache/storage.py): each group
    holds its own copy of a prefix. Group 0's key is the prefix hash itself, which routing reads."""
    return block_hash if group == 0 else block_hash + bytes((group % 256, group // 256))


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # its cache key (group_key), while cached
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) popleft, append and removal from the middle."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        last = self.tail.prev
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.num_free_blocks += 1

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def popleft(self) -> Block:
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        block = self.head.next
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, b = [], self.head.next
        while b is not self.tail:
            ids.append(b.block_id)
            b = b.next
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def cache_summary(self, limit: int) -> frozenset[bytes]:
        """Summary keys of the newest `limit` cached prefixes (the map keeps insertion order)."""
        keys = [h for h in self.cached if len(h) == HASH_BYTES]  # group 0's: one per prefix
        return frozenset(summary_key(h) for h in keys[-limit:])

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        return self.cached.get(group_key(block_hash, group)) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[Block] | None:
        """Fresh blocks with ref_cnt 1, evicting cached ones as needed; None if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict its prefix
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order.

        NOTE: callers pass a request's blocks in reverse so its tail blocks are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: Block, block_hash: BlockHash, group: int = 0) -> None:
        """Register a full, computed block of KV group `group` under its prefix hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        key = group_key(block_hash, group)
        if key in self.cached:  # same prefix computed twice concurrently: keep the first
            return
        block.block_hash = key
        self.cached[key] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
