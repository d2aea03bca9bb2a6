"""Per-request block tables on top of the BlockPool, with prefix-cache lookups."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvcache.block_pool import Block, BlockHash, BlockPool, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_blocks(window: int | None, block_size: int, num_tokens: int) -> int:
    """Blocks one layer holds for a sequence of `num_tokens` between steps: all of them for a global
    layer, at most those covering the window for a windowed one (the last `window` positions span
    at most cdiv(window - 1, block_size) + 1 blocks)."""
    full = cdiv(num_tokens, block_size)
    return full if window is None else min(full, cdiv(window - 1, block_size) + 1)


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes | None = None) -> list[BlockHash]:
    """The chained hashes of the blocks a prefix-cache lookup of this prompt checks (`find_prefix`):
    the router matches them against replicas' cache summaries. `salt`: see `KVCacheManager.find_prefix`."""
    return _chain([], token_ids, block_size, (len(token_ids) - 1) // block_size, salt)


def _chain(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_full_blocks: int,
           salt: bytes | None) -> list[BlockHash]:
    """`hashes` extended to the first `num_full_blocks` blocks of token_ids. NOTE: the salt is the root of
    the chain, so it keys every block after it; None gives the unsalted hashes."""
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[-1] if hashes else salt
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass(frozen=True)
class PrefixHit:
    """Cached full blocks at the start of a prompt, per KV group, and how many tokens they cover.
    A windowed group's entries before the window of the first token to compute are None."""

    blocks: tuple[tuple[Block | None, ...], ...]
    num_tokens: int


NO_HIT = PrefixHit((), 0)
NULL_BLOCK_ID = 0  # block-table entry of a block a windowed group has let go: never read (see block_table)


class KVCacheManager:
    """Block tables per request and KV group (kvcache/storage.py: one group per layer kind and
    `group_size` layers). A global group keeps every block; a windowed group returns a block to
    the pool (still cached, for a later prefix hit) once no token to compute can see it."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 group_windows: Sequence[int | None] = (None,)) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if not group_windows or any(w is not None and w <= 0 for w in group_windows):
            raise ValueError("need at least one KV group, and positive windows")
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[list[Block | None]]] = {}  # per request, per group
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks (of each group) already cached

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.group_windows)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def _hashes(self, request_id: str, token_ids: Sequence[int], num_full_blocks: int,
                salt: bytes | None = None) -> list[BlockHash]:
        return _chain(self.req_hashes.setdefault(request_id, []), token_ids, self.block_size, num_full_blocks, salt)

    def _first_visible(self, group: int, num_computed_tokens: int) -> int:
        """Index of the first block the next token to compute (at position num_computed_tokens)
        can see in `group`: 0 for a global group."""
        window = self.group_windows[group]
        return 0 if window is None else max(0, num_computed_tokens - window + 1) // self.block_size

    def find_prefix(self, request_id: str, token_ids: Sequence[int], salt: bytes | None = None) -> PrefixHit:
        """Longest run of cached full blocks at the start of token_ids that every group can use:
        a global group needs all of them, a windowed group the ones its window still sees.

        `salt` (a LoRA adapter's, None for the base model) roots the chain of hashes: prompts under
        different salts share no block. A request passes the same salt here and to cache_full_blocks.

        NOTE: at most len(token_ids) - 1 tokens may hit, so at least one token is computed
        and produces the logits for the next sample.
        """
        if not self.pool.enable_caching:
            return NO_HIT
        hashes = self._hashes(request_id, token_ids, (len(token_ids) - 1) // self.block_size, salt)
        get = self.pool.get_cached_block
        num = len(hashes)
        for g, window in enumerate(self.group_windows):  # global groups: the run from the start
            if window is None:
                num = next((i for i in range(num) if get(hashes[i], g) is None), num)
        while num > 0:  # windowed groups: the blocks of the window before the first token to compute
            if all(get(h, g) is not None for g, w in enumerate(self.group_windows) if w is not None
                   for h in hashes[self._first_visible(g, num * self.block_size):num]):
                break
            num -= 1
        blocks = tuple(tuple(get(h, g) if i >= self._first_visible(g, num * self.block_size) else None
                             for i, h in enumerate(hashes[:num])) for g in range(self.num_groups))
        return PrefixHit(blocks, num * self.block_size) if num else NO_HIT

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: PrefixHit = NO_HIT,
                       num_computed_tokens: int = 0) -> tuple[int, ...] | None:
        """Make room for `num_tokens` tokens of KV in total, the first `num_computed_tokens` of them
        computed already; returns the new block ids, or None.

        `prefix` (only for a request with no blocks yet) is taken by reference, not copied.
        """
        groups = self.req_blocks.setdefault(request_id, [[] for _ in self.group_windows])
        if prefix.blocks and any(groups):
            raise ValueError(f"request {request_id} already has blocks; a prefix applies only on admission")
        self._free_unseen(groups, max(num_computed_tokens, prefix.num_tokens))
        held = [len(prefix.blocks[g]) if prefix.blocks else len(blocks) for g, blocks in enumerate(groups)]
        num_new = [max(cdiv(num_tokens, self.block_size) - n, 0) for n in held]
        touched = [b for blocks in prefix.blocks for b in blocks if b is not None]
        # NOTE: touching a free cached block takes it out of the free queue, so it counts too.
        num_revived = sum(1 for b in touched if b.ref_cnt == 0)
        if sum(num_new) + num_revived > self.pool.num_free_blocks:
            if not any(groups):
                del self.req_blocks[request_id]
            return None
        self.pool.touch(touched)
        if prefix.blocks:
            for blocks, hit in zip(groups, prefix.blocks):
                blocks.extend(hit)
            self.num_cached_blocks[request_id] = prefix.num_tokens // self.block_size
        new = self.pool.allocate(sum(num_new)) or []
        start = 0
        for blocks, n in zip(groups, num_new):
            blocks.extend(new[start:start + n])
            start += n
        return tuple(b.block_id for b in new)

    def free_unseen(self, request_id: str, num_computed_tokens: int) -> None:
        """After a step: return the blocks the request's next token can no longer see (windowed groups)."""
        if request_id in self.req_blocks:
            self._free_unseen(self.req_blocks[request_id], num_computed_tokens)

    def _free_unseen(self, groups: list[list[Block | None]], num_computed_tokens: int) -> None:
        """Windowed groups: return the blocks no token from `num_computed_tokens` on can see."""
        for g, blocks in enumerate(groups):
            first = min(self._first_visible(g, num_computed_tokens), len(blocks))
            unseen = [b for b in blocks[:first] if b is not None]
            if unseen:
                # NOTE: a full, computed block keeps its hash in the free queue: a later prompt can still hit it
                self.pool.free(reversed(unseen))
                blocks[:first] = [None] * first

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                          salt: bytes | None = None) -> None:
        """Register the request's blocks that are full and computed, so later prompts can share them
        (`salt`: as find_prefix's)."""
        if not self.pool.enable_caching:
            return
        groups = self.req_blocks.get(request_id)
        if not groups:
            return
        num_full = min(num_computed_tokens // self.block_size, len(groups[0]))
        start = self.num_cached_blocks.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request_id, token_ids, num_full, salt)
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.cache_block(blocks[i], hashes[i], g)
        self.num_cached_blocks[request_id] = num_full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep the blocks holding the first `num_tokens` tokens; the rest go back to the pool
        (speculative decoding: KV written for drafts that verification rejected)."""
        groups = self.req_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not groups or len(groups[0]) <= keep:
            return
        # NOTE: only full, computed blocks are ever cached, and every one of those is kept: a dropped
        # block holds no hash, so the prefix cache never sees a rejected token
        if self.num_cached_blocks.get(request_id, 0) > keep:
            raise ValueError(f"request {request_id}: cannot trim below its cached blocks")
        for blocks in groups:
            self.pool.free(reversed([b for b in blocks[keep:] if b is not None]))
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        """Release a request's blocks (finish, abort or preemption); tail blocks are evicted first."""
        for blocks in self.req_blocks.pop(request_id, []):
            self.pool.free(reversed([b for b in blocks if b is not None]))
        self.req_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block ids in `group`, in token order.

        NOTE: a windowed group's let-go blocks read NULL_BLOCK_ID: the kernels start each sequence's
        keys at its window, so they never read an entry before it (the block may be another's now).
        """
        groups = self.req_blocks.get(request_id)
        return [NULL_BLOCK_ID if b is None else b.block_id for b in groups[group]] if groups else []

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.block_table(request_id, g)) for g in range(self.num_groups))

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (the only one without windows)."""
        return self.block_table(request_id, 0)

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks the request holds in every group."""
        return sum(b is not None for blocks in self.req_blocks.get(request_id, []) for b in blocks)
