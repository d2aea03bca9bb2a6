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
    assert cfg.engine.enforce_eager is False and not cfg.engine_config("default").enforce_eager  # compiled step
    eager = {**app["args"], "engine": {**app["args"]["engine"], "enforce_eager": True}}
    assert ServeConfig.from_args(eager).engine_config("default").enforce_eager
    one = cfg.engine_config("m", cpus=2.0)  # the replica's engine: the shared settings, its model and threads
    assert (one.model, one.num_threads, one.dtype, one.block_size) == ("m", 2, "auto", 16)
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        ServeConfig.from_args({**app["args"], "engine": {"block_size": 3}})
    with pytest.raises(TypeError):  # engine fields are not ServeConfig fields
        ServeConfig.from_args({**app["args"], "engine": {"replicas": 3}})
    limited = ServeConfig.from_args({**app["args"], "limits": {"max_n": 2, "max_tokens": 512}})
    assert (limited.limits.max_n, limited.limits.max_tokens, limited.limits.max_prompts) == (2, 512, 32)
    with pytest.raises(ValueError, match="API limits must be positive"):
        ServeConfig.from_args({"limits": {"max_n": 0}})
    assert cfg.router == "cache" and not cfg.routes_by_cache("default")  # one replica: nothing to route
    with pytest.raises(ValueError, match="router must be one of cache, pow2"):
        ServeConfig.from_args({**app["args"], "router": "random"})


def test_serve_yaml_engine_takes_quantization_and_memory_budget():
    (app,) = serve_yaml()["applications"]
    engine = app["args"]["engine"]
    assert (engine["quantization"], engine["kv_cache_memory"]) == ("auto", "auto")
    cfg = ServeConfig.from_args(app["args"]).engine_config("default")
    assert (cfg.quantization, cfg.kv_cache_memory, cfg.memory_budget) == ("auto", "auto", int(1.5 * 2**30))
    for q in ("none", "int8", "int4", "int4_g128"):
        one = ServeConfig.from_args({**app["args"], "engine": {**engine, "quantization": q}}).engine_config("m")
        assert one.quantization == q
    big = ServeConfig.from_args({**app["args"], "engine": {**engine, "memory_budget": "4GiB"}})
    assert big.engine_config("m").memory_budget == 4 * 2**30
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4, int4_g128"):
        ServeConfig.from_args({**app["args"], "engine": {**engine, "quantization": "int2"}})
    with pytest.raises(ValueError, match="memory_budget: cannot parse size"):
        ServeConfig.from_args({**app["args"], "engine": {**engine, "memory_budget": "plenty"}})


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
    engine = app["args"]["engine"]
    assert engine["block_size"] == 256 and ServeConfig.from_args({**app["args"], "num_gpus": 1})
    with pytest.raises(ValueError, match="on CUDA block_size must be a multiple of 256"):
        ServeConfig.from_args({**app["args"], "num_gpus": 1, "engine": {**engine, "block_size": 16}})
    assert ServeConfig.from_args({**app["args"], "num_gpus": 1}).engine_config("default").device == "cuda"
    engine["block_size"] = expected["args"]["engine"]["block_size"]
    assert app == expected
    (workers,) = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_serve_yaml_documents_the_lora_keys():
    """The commented LoRA keys of serve.yaml, uncommented, are a valid config: adapters and their slots."""
    (app,) = serve_yaml()["applications"]
    documented = {}
    for line in (DEPLOY / "serve.yaml").read_text().splitlines():
        key = line.strip().removeprefix("# ").split(":")[0]
        if key in ("max_loras", "max_lora_rank", "lora_modules", "allow_runtime_lora"):
            documented.update(yaml.safe_load(line.strip().removeprefix("# ")))
    engine = {k: documented.pop(k) for k in ("max_loras", "max_lora_rank")}
    cfg = ServeConfig.from_args({**app["args"], **documented, "engine": {**app["args"]["engine"], **engine}})
    assert cfg.lora_modules == {"support-bot": "/adapters/support-bot", "sql-writer": "/adapters/sql-writer"}
    assert (cfg.engine.max_loras, cfg.engine.max_lora_rank, cfg.allow_runtime_lora) == (4, 16, False)
    implied = ServeConfig.from_args({**app["args"], "lora_modules": cfg.lora_modules})
    assert implied.engine.max_loras == 4 and implied.serves_lora  # adapters without max_loras: 4 slots
    assert not ServeConfig.from_args(app["args"]).serves_lora
    with pytest.raises(ValueError, match="not a served model's name"):
        ServeConfig.from_args({**app["args"], "lora_modules": {"default": "/a"}})
    with pytest.raises(ValueError, match="invalid LoRA adapter name"):
        ServeConfig.from_args({**app["args"], "lora_modules": {"no spaces": "/a"}})
    with pytest.raises(ValueError, match="adapt the one served model"):
        ServeConfig.from_args({"models": {"a": "x", "b": "y"}, "lora_modules": {"l": "/a"}})
