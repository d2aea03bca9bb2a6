"""deploy/: serve.yaml builds our application; the KubeRay RayServices embed the same Serve config."""
from pathlib import Path

import pytest
import yaml

from server.serve_config import ServeConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def serve_yaml() -> dict:
    return yaml.safe_load((DEPLOY / "serve.yaml").read_text())


def test_serve_yaml_args_are_a_valid_serve_config():
    (app,) = serve_yaml()["applications"]
    assert app["import_path"] == "server.deployment:build_app"
    cfg = ServeConfig.from_args(app["args"])
    assert cfg.models == {"default": "default"} and cfg.max_ongoing_requests > 5
    assert cfg.enforce_eager is False and not cfg.engine_config("default").enforce_eager  # compiled step
    assert ServeConfig.from_args({**app["args"], "enforce_eager": True}).engine_config("default").enforce_eager
    limited = ServeConfig.from_args({**app["args"], "limits": {"max_n": 2, "max_tokens": 512}})
    assert (limited.limits.max_n, limited.limits.max_tokens, limited.limits.max_prompts) == (2, 512, 32)
    with pytest.raises(ValueError, match="API limits must be positive"):
        ServeConfig.from_args({"limits": {"max_n": 0}})


def test_rayservice_embeds_serve_yaml_application():
    svc = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert svc["kind"] == "RayService" and svc["apiVersion"] == "ray.io/v1"
    embedded = yaml.safe_load(svc["spec"]["serveConfigV2"])
    assert embedded["applications"] == serve_yaml()["applications"]
    cluster = svc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (workers,) = cluster["workerGroupSpecs"]
    res = workers["template"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["cpu"] and workers["maxReplicas"] > workers["minReplicas"]


def test_gpu_rayservice_differs_only_by_gpus_and_block_size():
    svc = yaml.safe_load((DEPLOY / "kuberay" / "rayservice-gpu.yaml").read_text())
    (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    (expected,) = serve_yaml()["applications"]
    assert app["args"].pop("num_gpus") == 1
    assert app["args"]["block_size"] == 256 and ServeConfig.from_args({**app["args"], "num_gpus": 1})
    with pytest.raises(ValueError, match="on CUDA block_size must be a multiple of 256"):
        ServeConfig.from_args({**app["args"], "num_gpus": 1, "block_size": 16})
    app["args"]["block_size"] = expected["args"]["block_size"]
    assert app == expected
    (workers,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert ServeConfig.from_args({**app["args"], "num_gpus": 1, "block_size": 256}).engine_config("default").device == "cuda"
