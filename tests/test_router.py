"""Cache-aware routing: the choice from given replica stats, and the hashes it matches on."""
from kvcache.block_pool import BlockPool, summary_key
from kvcache.manager import KVCacheManager, prompt_block_hashes
from server.router import ROUTED_TTL_S, ReplicaLoad, num_cached_blocks, pick_replica, with_routed
from server.serve_config import ServeConfig

PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks of 16 are looked up (the last token never hits)
HASHES = prompt_block_hashes(PROMPT, 16)


def keys(n: int) -> frozenset[bytes]:
    """A summary holding the prompt's first n blocks."""
    return frozenset(summary_key(h) for h in HASHES[:n])


def test_prompt_hashes_are_what_the_prefix_cache_looks_up():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    hit = kv.find_prefix("a", PROMPT)
    assert hit.num_tokens == 0 and len(HASHES) == 4 == (len(PROMPT) - 1) // 16
    assert kv._hashes("a", PROMPT, 4) == HASHES
    assert prompt_block_hashes(PROMPT[:16], 16) == [] and prompt_block_hashes(PROMPT[:17], 16) == HASHES[:1]


def test_pool_summary_keeps_the_newest_prefixes():
    pool = BlockPool(8)
    blocks = pool.allocate(4)
    for b, h in zip(blocks, HASHES):
        pool.cache_block(b, h)
    assert pool.cache_summary(10) == keys(4)
    assert pool.cache_summary(2) == frozenset(summary_key(h) for h in HASHES[2:])
    pool.free(blocks)
    assert pool.cache_summary(10) == keys(4)  # freed blocks still hold their prefixes
    pool.allocate(8)  # evicts them all
    assert pool.cache_summary(10) == frozenset()


def test_longest_cached_run_wins():
    loads = [ReplicaLoad("a", 3, cached=keys(1)), ReplicaLoad("b", 5, cached=keys(3)), ReplicaLoad("c", 0)]
    assert [num_cached_blocks(HASHES, r.cached) for r in loads] == [1, 3, 0]
    assert pick_replica(loads, HASHES) == "b"


def test_a_run_counts_from_the_first_block():
    later_only = frozenset(summary_key(h) for h in HASHES[1:])  # block 0 evicted: nothing is reusable
    loads = [ReplicaLoad("a", 0, cached=later_only), ReplicaLoad("b", 0, cached=keys(1))]
    assert num_cached_blocks(HASHES, later_only) == 0
    assert pick_replica(loads, HASHES) == "b"


def test_ties_go_to_the_less_loaded():
    loads = [ReplicaLoad("a", 4, cached=keys(2)), ReplicaLoad("b", 1, cached=keys(2))]
    assert pick_replica(loads, HASHES) == "b"


def test_a_new_prefix_goes_where_the_fewest_blocks_are_cached():
    other = frozenset(summary_key(h) for h in prompt_block_hashes(list(range(300, 370)), 16))
    loads = [ReplicaLoad("a", 0, cached=other), ReplicaLoad("b", 1, cached=other | keys(0)), ReplicaLoad("c", 2)]
    assert pick_replica(loads, HASHES) == "c"
    busy = [ReplicaLoad("a", 0, cached=other), ReplicaLoad("c", 20)]
    assert pick_replica(busy, HASHES) == "a"  # not onto a replica far busier than the rest
    assert pick_replica([ReplicaLoad("a", 0, cached=keys(4))], []) is None  # nothing to match on: pow2


def test_imbalance_falls_back():
    loads = [ReplicaLoad("a", 20, cached=keys(4)), ReplicaLoad("b", 2)]
    assert pick_replica(loads, HASHES, imbalance=8) is None
    assert pick_replica(loads, HASHES, imbalance=18) == "a"


def test_full_kv_pool_with_waiters_falls_back():
    full = ReplicaLoad("a", 2, num_waiting=1, kv_usage=0.97, cached=keys(4))
    assert pick_replica([full, ReplicaLoad("b", 2)], HASHES) is None
    no_waiters = ReplicaLoad("a", 2, num_waiting=0, kv_usage=0.97, cached=keys(4))
    assert pick_replica([no_waiters, ReplicaLoad("b", 2)], HASHES) == "a"


def test_cache_routing_applies_with_several_replicas():
    assert not ServeConfig().routes_by_cache("default")
    assert ServeConfig(num_replicas=2).routes_by_cache("default")
    assert not ServeConfig(num_replicas=2, router="pow2").routes_by_cache("default")
    assert ServeConfig(autoscaling={"min_replicas": 1, "max_replicas": 3}).routes_by_cache("default")


def test_autoscaled_replicas_share_cpus_as_if_all_ran():
    assert ServeConfig(autoscaling={"min_replicas": 1, "max_replicas": 2}).replica_cpus(2.0) == 1.0
    assert ServeConfig(num_replicas=1).replica_cpus(2.0) == 2.0


def test_blocks_just_routed_count_until_summaries_catch_up():
    routed = {summary_key(HASHES[0]): 100.0, summary_key(HASHES[1]): 100.0}
    assert with_routed(frozenset(), routed, now=101.0) == keys(2)
    assert with_routed(keys(1), routed, now=100.0 + ROUTED_TTL_S) == keys(1)  # expired: the summary alone
    loads = [ReplicaLoad("a", 1, cached=with_routed(frozenset(), routed, 101.0)), ReplicaLoad("b", 0)]
    assert pick_replica(loads, HASHES) == "a"  # a second request of a new prefix follows the first


def test_an_adapter_goes_where_it_is_held_then_where_fewest_are():
    a = ReplicaLoad("a", 3, adapters=frozenset({"x"}))
    b = ReplicaLoad("b", 0, adapters=frozenset({"y", "z"}))
    c = ReplicaLoad("c", 1, adapters=frozenset({"y"}))
    assert pick_replica([a, b, c], (), adapter="x") == "a"  # held: no block hashes needed
    assert pick_replica([a, b, c], (), adapter="w") == "c"  # held nowhere: c and a hold fewest, c is calmer
    assert pick_replica([a, b, c], ()) is None  # neither hashes nor adapter: pow2


def test_adapter_affinity_comes_before_the_cache_and_yields_to_load():
    cached_elsewhere = ReplicaLoad("a", 0, cached=keys(4), adapters=frozenset({"y"}))
    holder = ReplicaLoad("b", 0, cached=keys(1), adapters=frozenset({"x"}))
    other_holder = ReplicaLoad("c", 0, adapters=frozenset({"x"}))
    assert pick_replica([cached_elsewhere, holder, other_holder], HASHES, adapter="x") == "b"  # cache among holders
    busy_holder = ReplicaLoad("b", 20, adapters=frozenset({"x"}))
    assert pick_replica([cached_elsewhere, busy_holder], HASHES, imbalance=8, adapter="x") == "a"
