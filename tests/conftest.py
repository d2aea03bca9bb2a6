import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# NOTE: before torch loads OpenMP, and inherited by every process a test starts (Ray, replicas, engine
# processes, `attnserve serve`): `make test` keeps both cores busy with two workers, and OpenMP's
# default of spinning at each barrier then waits on a sibling thread that has no core. On this
# 2-core machine with two busy loops beside it, 3 x 64 tokens of the default model on 2 threads
# took 4.8 s spinning, 1.6 s passive (1 thread: 2.9 s); alone, 1.0-1.2 s either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from models.native.cpu_features import apply_isa_cap  # noqa: E402

apply_isa_cap()  # NOTE: before torch: a run under ATTNSERVE_CPU_ISA=avx2 is a run on an AVX2 CPU

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from loadtests.servers import free_port  # noqa: E402
from tests import budget, scheduling  # noqa: E402
from tests.budget import (  # noqa: E402,F401  (the time guards and reports)
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from tests.tiny import ARCHS, VARIANT_ARCHS, make_checkpoint  # noqa: E402

# a Ray cluster or a listening server: `make test-fast` leaves out every test that uses one (the files
# that start their own, test_cli_serve and test_two_nodes, carry the mark themselves)
E2E_FIXTURES = frozenset({"ray_session", "uvicorn_url", "page_url", "gemma2_server"})
# a system package (tests/system_tools.py), installed by `make system-deps`: marked `system`, which
# `make test-fast` leaves out (it runs on a fresh machine without root)
SYSTEM_FIXTURES = frozenset({"promtool", "prometheus", "chromium"})
# the embedded 135M model (seconds per test where the tiny ones take milliseconds): `make test-fast`
# leaves these out too; tests that load it without the fixture carry the mark themselves
DEFAULT_MODEL_FIXTURES = frozenset({"default_model_dir"})


@pytest.hookimpl(tryfirst=True)  # NOTE: before -m deselects by marks, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if E2E_FIXTURES & fixtures:
            item.add_marker(pytest.mark.e2e)
        if DEFAULT_MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.default_model)
        if SYSTEM_FIXTURES & fixtures:
            item.add_marker(pytest.mark.system)
        if "compiled" in item.nodeid:  # NOTE: by name: each file, test or case of the compiled step says so
            item.add_marker(pytest.mark.compiled)
    path = lambda item: item.nodeid.split("::")[0]  # noqa: E731
    ray_files = {path(i) for i in items if "ray_session" in getattr(i, "fixturenames", ())}
    e2e_files = {path(i) for i in items if i.get_closest_marker("e2e")} - ray_files
    heavy_files = {path(i) for i in items if i.get_closest_marker("default_model") or i.get_closest_marker("slow")}

    # `make test` runs on two xdist workers, a file at a time (tests/scheduling.py): the files that share
    # the session's Ray are one unit, so one Ray cluster and its Serve apps serve them all, on one worker,
    # while the other takes the files without it. Units go out longest first (roughly: Ray, servers of
    # their own, the 135M model or slow cases, the rest), so the last ones to finish are short.
    def order(item) -> int:
        file = path(item)
        return 0 if file in ray_files else 1 if file in e2e_files else 2 if file in heavy_files else 3
    items.sort(key=order)  # stable: files and their tests keep their order
    scheduling.publish({path(item): "ray-session" if path(item) in ray_files else path(item) for item in items})


def pytest_configure(config):
    scheduling.configure(config)
    budget.configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return scheduling.make_scheduler(config, log)


@pytest.fixture(scope="session")
def promtool():
    """promtool's `check metrics` (tests/system_tools.py Promtool): the test is marked `system`."""
    from tests.system_tools import Promtool

    return Promtool()


@pytest.fixture(scope="session")
def prometheus() -> str:
    """The Prometheus server's executable: the test is marked `system`."""
    from tests.system_tools import require

    return require("prometheus")


@pytest.fixture(scope="session")
def chromium():
    """Headless Chromium (tests/system_tools.py run_chromium): the test is marked `system`."""
    from tests.system_tools import require, run_chromium

    require("chromium")
    return run_chromium


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per supported architecture (llama is sharded)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        arch: make_checkpoint(root / arch, arch, max_shard_size="100KB" if arch == "llama" else None)
        for arch in ARCHS
    }


@pytest.fixture(scope="session")
def variant_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per attention-variant model type (tests/tiny.py VARIANT_ARCHS)."""
    root = tmp_path_factory.mktemp("tiny-variants")
    return {arch: make_checkpoint(root / arch, arch) for arch in VARIANT_ARCHS}


ORACLE_TOKENS = 24  # the greedy continuation every engine-parity test compares


@pytest.fixture(scope="session")
def oracle(tiny_checkpoints):
    """(arch, dtype) -> (our model, tokenizer, HF's memoised greedy tokens) for tests/tiny.py ARCHS:
    each model and each HF reference built once per run, whichever parity file asks first."""
    from tests.reference import tiny_oracle

    return tiny_oracle(tiny_checkpoints, ORACLE_TOKENS)


@pytest.fixture(scope="session")
def variant_oracle(variant_checkpoints):
    """The same for the attention-variant model types (VARIANT_ARCHS)."""
    from tests.reference import tiny_oracle

    return tiny_oracle(variant_checkpoints, ORACLE_TOKENS)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once to the cache."""
    from models.registry import ensure_default

    return ensure_default()


XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    torch.set_num_threads(1)  # NOTE: two workers share two cores: a second torch thread each only oversubscribes


@pytest.fixture(autouse=True)
def _deterministic(request):
    torch.manual_seed(0)
    # NOTE: the kernels split their work over threads: their tests run with two, even beside another worker
    threads = 2 if XDIST_WORKER and request.node.get_closest_marker("kernel") else None
    if threads:
        torch.set_num_threads(threads)
    yield
    if threads:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (startup costs ~15 s)."""
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_variants(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama (GQA, 4 heads / 2 kv heads) and its MHA and MQA conversions."""
    from models.kv_heads import convert

    root = tmp_path_factory.mktemp("variants")
    src = tiny_checkpoints["llama"]
    return {"tiny-gqa": src, "tiny-mha": convert(src, 4, root / "mha", progress=False),
            "tiny-mqa": convert(src, 1, root / "mqa", progress=False)}


TINY_APP = "attnserve-test"


@pytest.fixture(scope="session")
def serve_url(ray_session, tiny_variants) -> str:
    """Real Ray Serve running the tiny GQA model on 2 replicas plus its MHA and MQA forms."""
    from ray import serve

    from server.deployment import build_app
    from server.engine.config import EngineConfig
    from server.openai_api import ApiLimits
    from server.serve_config import ServeConfig

    cfg = ServeConfig(
        models={name: str(path) for name, path in tiny_variants.items()},
        # NOTE: eager: four replicas would compile three graphs at start; the compiled step in Serve
        # replicas is tests/test_routing_e2e.py's (two replicas, one graph)
        engine=EngineConfig(dtype="float32", block_size=4, kv_cache_memory=None, num_blocks=256, max_model_len=256,
                            max_num_batched_tokens=256, max_num_seqs=32, num_threads=1, enforce_eager=True),
        num_cpus=0.25, limits=ApiLimits(max_n=4, max_tokens=200, max_body_bytes=1024 * 1024),
        model_replicas={"tiny-gqa": 2},
    )
    serve.run(build_app(cfg), name=TINY_APP, route_prefix="/")
    yield ray_session
    serve.delete(TINY_APP)


@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """tests/lora_helpers.py ADAPTERS made with PEFT on the tiny llama (GQA), one seed each."""
    from tests.lora_helpers import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_checkpoints["llama"], root / name, seed=i, **cfg)
            for i, (name, cfg) in enumerate(ADAPTERS.items())}
