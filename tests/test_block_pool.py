"""Block pool and KV-cache manager: exact block ids, prefix hits, eviction order, invariants."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.block_pool import Block, BlockPool, FreeBlockQueue, hash_block_tokens
from kvcache.manager import KVCacheManager, prompt_block_hashes


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert all(pool.blocks[i].ref_cnt == 0 for i in free_ids)
    refs = {}
    for groups in kv.req_blocks.values():
        for b in (b for blocks in groups for b in blocks if b is not None):
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_cnt == refs.get(b.block_id, 0)
    for h, b in pool.cached.items():
        assert b.block_hash == h


def test_free_queue_is_o1_linked_list():
    blocks = [Block(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 2] and q.num_free_blocks == 3
    with pytest.raises(ValueError):
        q.remove(blocks[0])


def test_allocate_and_free_exact_ids():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    b = pool.allocate(3)
    assert [x.block_id for x in b] == [2, 3, 4]
    assert pool.allocate(2) is None  # only block 5 is free: None, never a sentinel
    pool.free(reversed(b))
    assert pool.free_queue.block_ids() == [5, 4, 3, 2]
    assert [x.block_id for x in pool.allocate(2)] == [5, 4]
    with pytest.raises(ValueError, match="double free"):
        pool.free([pool.blocks[5], pool.blocks[5]])


def test_manager_prefix_hit_and_lru_eviction_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert kv.find_prefix("a", prompt).num_tokens == 0
    assert kv.allocate_slots("a", 10) == (0, 1, 2)
    kv.cache_full_blocks("a", prompt, 10)
    assert len(kv.pool.cached) == 2
    hit = kv.find_prefix("b", prompt + [99])
    assert [b.block_id for b in hit.blocks[0]] == [0, 1] and hit.num_tokens == 8
    assert kv.allocate_slots("b", 11, hit) == (3,)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2
    check_invariants(kv)
    kv.free("a")
    kv.free("b")
    # each request frees in reverse: a releases 2 (1 and 0 are still b's), then b releases 3, 1, 0
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.num_free_blocks == 8
    # 7 blocks: the uncached 4..7, 2, 3 first, then the least recently freed cached block, 1
    assert kv.allocate_slots("c", 4 * 7) == (4, 5, 6, 7, 2, 3, 1)
    assert kv.pool.num_evictions == 1 and list(kv.pool.cached.values())[0].block_id == 0
    check_invariants(kv)


def test_whole_prompt_hit_still_computes_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(8))
    kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", prompt, 8)
    hit = kv.find_prefix("b", prompt)
    assert hit.num_tokens == 4  # not 8: one token must run to produce logits


def test_allocation_counts_revived_cached_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate_slots("a", 4)
    kv.cache_full_blocks("a", [1, 2, 3, 4], 4)
    kv.free("a")
    hit = kv.find_prefix("b", [1, 2, 3, 4, 5])
    assert hit.num_tokens == 4
    assert kv.allocate_slots("b", 9, hit) is None  # needs 2 revived + 3 new > 3 free
    assert kv.num_request_blocks("b") == 0 and kv.num_free_blocks == 3
    assert kv.allocate_slots("b", 5, hit) == (2,)
    check_invariants(kv)


def test_chained_hash_depends_on_prefix():
    a = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(a, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])


def test_salted_hashes_root_the_chain():
    """A LoRA adapter's salt keys every block of a prompt; None is exactly the unsalted chain."""
    prompt = list(range(13))  # 3 full blocks of 4 a lookup checks
    plain = prompt_block_hashes(prompt, 4)
    assert prompt_block_hashes(prompt, 4, salt=None) == plain
    assert plain[0] == hash_block_tokens(None, prompt[:4]) and plain[1] == hash_block_tokens(plain[0], prompt[4:8])
    one, two = prompt_block_hashes(prompt, 4, salt=b"a" * 16), prompt_block_hashes(prompt, 4, salt=b"b" * 16)
    assert len(one) == len(two) == 3
    assert not set(one) & set(plain) and not set(one) & set(two)  # every block differs, not only the first
    assert one == prompt_block_hashes(prompt, 4, salt=b"a" * 16)


def test_same_prompt_under_two_salts_shares_no_block():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    for rid, salt in (("base", None), ("a", b"a" * 16), ("b", b"b" * 16)):
        assert kv.find_prefix(rid, prompt, salt).num_tokens == 0  # nobody's blocks serve another salt
        kv.allocate_slots(rid, len(prompt))
        kv.cache_full_blocks(rid, prompt, len(prompt), salt)
    assert len(kv.pool.cached) == 6  # each salt's 2 full blocks
    for salt, owner in ((None, "base"), (b"a" * 16, "a"), (b"b" * 16, "b")):
        hit = kv.find_prefix(f"again-{owner}", prompt, salt)
        assert hit.num_tokens == 8 and [b.block_id for b in hit.blocks[0]] == kv.block_ids(owner)[:2]
    assert kv._hashes("base", prompt, 2) == prompt_block_hashes(prompt, 4)  # the router's view of base traffic
    check_invariants(kv)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free", "cache"]), st.integers(0, 5), st.integers(1, 40)),
               max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_allocate_free_abort_keeps_invariants(sequence):
    kv = KVCacheManager(num_blocks=12, block_size=4)
    tokens: dict[str, list[int]] = {}
    for op, rid_n, n in sequence:
        rid = f"r{rid_n}"
        if op == "alloc" and rid not in kv.req_blocks:
            toks = [rid_n % 2] * n  # two families of prompts share prefixes
            hit = kv.find_prefix(rid, toks)
            if kv.allocate_slots(rid, len(toks), hit) is not None:
                tokens[rid] = toks
            else:
                assert rid not in kv.req_blocks
        elif op == "grow" and rid in tokens:
            tokens[rid] = tokens[rid] + [7] * (n % 5)
            if kv.allocate_slots(rid, len(tokens[rid])) is None:
                tokens[rid] = tokens[rid][: len(tokens[rid]) - n % 5]
        elif op == "cache" and rid in tokens:
            kv.cache_full_blocks(rid, tokens[rid], len(tokens[rid]))
        elif op == "free":
            kv.free(rid)  # finish, abort and preemption all free the same way; unknown ids are a no-op
            tokens.pop(rid, None)
        check_invariants(kv)
    for rid in list(tokens):
        kv.free(rid)
    assert kv.num_free_blocks == kv.num_blocks
    check_invariants(kv)
