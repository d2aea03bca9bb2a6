"""Autoscaling on engine signals: the policy's decisions, and 1 -> 2 -> 1 replicas under a real
locust load on real Serve."""
import json
import time

import pytest

from server.autoscaling import POLICY, autoscaling_config, desired_replicas

APP = "attnserve-autoscaled"


def test_waiting_requests_or_a_full_pool_add_a_replica():
    assert desired_replicas(1, 1, {"a": 2.0}, {"a": 0.5}, {"a": 0.3}) == 2
    assert desired_replicas(1, 1, {"a": 2.0}, {"a": 0.0}, {"a": 0.9}) == 2
    assert desired_replicas(1, 2, {"a": 2.0}, {"a": 1.0}, {"a": 0.5}) == 2  # already scaling: no second step


def test_idle_replicas_go_and_busy_ones_stay():
    assert desired_replicas(2, 2, {"a": 3.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {"a": 0.3, "b": 0.0}) == 1
    assert desired_replicas(2, 2, {"a": 0.0, "b": 0.0}, {}, {"a": 0.0, "b": 0.0}) == 1
    assert desired_replicas(2, 2, {"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}, {"a": 0.2, "b": 0.2}) == 2
    assert desired_replicas(1, 1, {}, {}, {}) == 1  # no figures yet: hold


def test_config_uses_the_engine_policy_unless_told_otherwise():
    cfg = autoscaling_config({"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 2})
    assert cfg["policy"] == {"policy_function": POLICY} and cfg["downscale_delay_s"] == 2
    from ray.serve.config import AutoscalingConfig

    parsed = AutoscalingConfig(**cfg)  # what Serve does with it
    assert parsed.policy.get_policy().__name__ == "engine_pressure_policy"


def num_running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["model-tiny"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_scales_up_under_locust_load_and_back_down(serve_url, tiny_variants, tmp_path):
    import ray
    from ray import serve

    from loadtests.run_loadtest import run_locust, summarize
    from loadtests.workload import LengthSpec, build
    from server.deployment import STATE_NAMESPACE, build_app, state_name
    from server.engine.config import EngineConfig
    from server.serve_config import ServeConfig

    cfg = ServeConfig(models={"tiny": str(tiny_variants["tiny-gqa"])}, num_cpus=0.25,
                      autoscaling={"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1,
                                   "downscale_delay_s": 4, "look_back_period_s": 2, "metrics_interval_s": 0.5},
                      engine=EngineConfig(dtype="float32", block_size=4, kv_cache_memory=None, num_blocks=64,
                                          max_model_len=512, max_num_seqs=1, num_threads=1, enforce_eager=True))
    serve.run(build_app(cfg), name=APP, route_prefix="/autoscaled")
    url = f"{serve_url}/autoscaled"
    try:
        assert num_running_replicas() == 1
        workload = tmp_path / "workload.jsonl"
        spec = LengthSpec(median=8, sigma=0.5, min_words=2, max_words=20, long_min=20, long_max=30,
                          shared_prefix_words=15)
        workload.write_text("\n".join(json.dumps(r) for r in build(200, 0, spec, max_tokens=(24, 32))))
        seen, scaled_at = [], []

        import threading

        def watch():
            while not done.is_set():
                seen.append(num_running_replicas())
                if seen[-1] == 2 and not scaled_at:
                    scaled_at.append(time.monotonic())
                time.sleep(0.5)
        done = threading.Event()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # one sequence per engine step (max_num_seqs=1) and 6 users: requests wait, so a replica is added.
        # NOTE: the load lasts until the added replica has run for 10 s, at most 150 s: it must finish
        # starting (a Ray worker, an engine process) on 2 cores that another test worker shares
        start = time.monotonic()
        code = run_locust(url, tmp_path / "run", 6, 6, "150s", ["ChatStreamUser"], ["tiny"], workload,
                          until=lambda: bool(scaled_at) and time.monotonic() > scaled_at[0] + 10)
        summary = summarize(tmp_path / "run", time.monotonic() - start)
        assert code == 0 and summary["failures"] == 0 and summary["requests"] > 10, (tmp_path / "run" / "locust.log").read_text()[-3000:]
        assert max(seen) == 2, seen  # scaled up under load
        deadline = time.monotonic() + 90
        while num_running_replicas() != 1 and time.monotonic() < deadline:
            time.sleep(1)
        done.set()
        assert num_running_replicas() == 1  # and back down once idle
        time.sleep(2)
        hub = ray.get_actor(state_name(APP), namespace=STATE_NAMESPACE)
        snaps = ray.get(hub.collect.remote())
        assert len(snaps) == 2  # both replicas served and reported
        assert all(s.gauges.kv_blocks_used == 0 for s in snaps)  # no block held anywhere
    finally:
        serve.delete(APP)
