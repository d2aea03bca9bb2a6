"""Per-request block tables on top of the BlockPool, with prefix-cache lookups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvcache.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the blocks a prefix-cache lookup of this prompt checks (`find_prefix`):
    the router matches them against replicas' cache summaries."""
    hashes: list[BlockHash] = []
    for i in range((len(token_ids) - 1) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass(frozen=True)
class PrefixHit:
    """Cached full blocks at the start of a prompt, and how many tokens they cover."""

    blocks: tuple[Block, ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def _hashes(self, request_id: str, token_ids: Sequence[int], num_full_blocks: int) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_prefix(self, request_id: str, token_ids: Sequence[int]) -> PrefixHit:
        """Longest run of cached full blocks at the start of token_ids.

        NOTE: at most len(token_ids) - 1 tokens may hit, so at least one token is computed
        and produces the logits for the next sample.
        """
        if not self.pool.enable_caching:
            return NO_HIT
        num_full = (len(token_ids) - 1) // self.block_size
        blocks = []
        for h in self._hashes(request_id, token_ids, num_full):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: PrefixHit = NO_HIT) -> tuple[int, ...] | None:
        """Make room for `num_tokens` tokens of KV in total; returns the new block ids, or None.

        `prefix` (only for a request with no blocks yet) is taken by reference, not copied.
        """
        blocks = self.req_blocks.setdefault(request_id, [])
        if prefix.blocks and blocks:
            raise ValueError(f"request {request_id} already has blocks; a prefix applies only on admission")
        num_new = cdiv(num_tokens, self.block_size) - len(blocks) - len(prefix.blocks)
        # NOTE: touching a free cached block takes it out of the free queue, so it counts too.
        num_revived = sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        if max(num_new, 0) + num_revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request_id]
            return None
        self.pool.touch(prefix.blocks)
        blocks.extend(prefix.blocks)
        if prefix.blocks:
            self.num_cached_blocks[request_id] = len(prefix.blocks)
        new = self.pool.allocate(max(num_new, 0)) or []
        blocks.extend(new)
        return tuple(b.block_id for b in new)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed, so later prompts can share them."""
        if not self.pool.enable_caching:
            return
        blocks = self.req_blocks.get(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request_id] = num_full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep the blocks holding the first `num_tokens` tokens; the rest go back to the pool
        (speculative decoding: KV written for drafts that verification rejected)."""
        blocks = self.req_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        # NOTE: only full, computed blocks are ever cached, and every one of those is kept: a dropped
        # block holds no hash, so the prefix cache never sees a rejected token
        if self.num_cached_blocks.get(request_id, 0) > keep:
            raise ValueError(f"request {request_id}: cannot trim below its cached blocks")
        self.pool.free(reversed(blocks[keep:]))
        del blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finish, abort or preemption); tail blocks are evicted first."""
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.free(reversed(blocks))
        self.req_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def num_request_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, []))
