"""Autoscaling on what the engines know (Serve's custom policy API).

Replicas report their engine's waiting and running requests and KV usage
(`record_autoscaling_stats`); Serve averages them over `look_back_period_s`. The policy adds a
replica while requests wait or the KV pools run nearly full, and lets idle replicas go. Serve
applies min/max and the up/down delays around it.
"""
from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

POLICY = "server.autoscaling:engine_pressure_policy"
KV_HIGH = 0.8  # mean KV usage above this: more replicas, before preemption sets in
DEFAULTS = {"upscale_delay_s": 5.0, "downscale_delay_s": 30.0, "look_back_period_s": 5.0, "metrics_interval_s": 1.0}


def autoscaling_stats(num_running: int, num_waiting: int, kv_usage: float) -> dict[str, float]:
    """What a replica's `record_autoscaling_stats` returns."""
    return {"num_running": float(num_running), "num_waiting": float(num_waiting), "kv_usage": float(kv_usage)}


def desired_replicas(current: int, target: int, running: dict[Any, float], waiting: dict[Any, float],
                     kv_usage: dict[Any, float]) -> int:
    """Replicas wanted, from per-replica averages; `target` is what Serve already aims for."""
    if current == 0 or not running:
        return target  # no figures yet: hold
    mean_kv = sum(kv_usage.values()) / len(kv_usage) if kv_usage else 0.0
    if sum(waiting.values()) > 0 or mean_kv > KV_HIGH:
        return max(target, current + 1)
    busy = sum(1 for r in running if running[r] + waiting.get(r, 0.0) > 0)
    return max(1, min(current, busy))


def engine_pressure_policy(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    m = ctx.aggregated_metrics or {}
    return desired_replicas(ctx.current_num_replicas, ctx.target_num_replicas, m.get("num_running", {}),
                            m.get("num_waiting", {}), m.get("kv_usage", {})), {}


def autoscaling_config(options: dict[str, Any]) -> dict[str, Any]:
    """Serve's autoscaling_config for attnserve's options: our policy and delays unless given."""
    return {**DEFAULTS, "policy": {"policy_function": POLICY}, **options}
