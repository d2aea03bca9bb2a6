"""Two Ray nodes on one machine (`ray start --head` + `ray start --address`), one cluster for the
module: bench_parallel's TP=2 / PP=2 forms on it, `attnserve serve --address` with a pipeline stage on
each node, then with a model replica on each, and the second node's raylet killed under load.

Node A (head) holds the ingress, the metrics hub and one replica; node B the other replica
(custom resources place them); the ingress's cache-aware router spreads prompts that share no
prefix over both. Killing B's raylet ends its requests (with an error, or done if its worker
outlives the raylet a moment), never with a hang; traffic goes on through A; Serve brings B's
replica back when B rejoins.
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtests.servers import BIN, ROOT, free_port, running

pytestmark = pytest.mark.e2e
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}


def ray_start(*args: str) -> None:
    proc = subprocess.run([str(BIN / "ray"), "start", "--disable-usage-stats", "--num-cpus", "1", *args],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


WORKER_PORTS = 20000 + random.randrange(40) * 300  # NOTE: below the ephemeral range free_port() draws from


def node_ports(node: int) -> list[str]:
    """Explicit ports for a second raylet on this machine; worker ports in a range of their own per node."""
    base = WORKER_PORTS + 100 * node
    return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
            "--min-worker-port", str(base), "--max-worker-port", str(base + 99)]


def pids_with(text: str, name: str = "") -> list[int]:
    """Processes whose command line holds `text` (and `name`)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pid.isdigit() and text in cmd and name in cmd:
            found.append(int(pid))
    return found


def replicas_by_node(url: str) -> dict[str, list[str]]:
    """{} until a replica's first report reaches the application's state (they push it as they start)."""
    models = httpx.get(f"{url}/dashboard/data", timeout=30).json()["models"]
    assert len(models) <= 1, models
    return models[0]["replicas_by_node"] if models else {}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


class Load(threading.Thread):
    """Streams chat completions back to back on `workers` connections; records each outcome."""

    def __init__(self, url: str, workers: int = 4) -> None:
        super().__init__(daemon=True)
        self.url, self.workers = url, workers
        self.outcomes: list[tuple[float, str]] = []  # (finish time, "ok" | "error-event" | "http-5xx")
        self.stop = threading.Event()

    def one(self, client: httpx.Client) -> str:
        # NOTE: distinct first blocks: no prefix is cached anywhere, so the router spreads them (pow2)
        prompt = [random.randrange(100, 300) for _ in range(24)]
        body = {"model": "tiny", "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True,
                "prompt": prompt}
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code >= 500:
                return "http-5xx"
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        if any('"error"' in line for line in lines):
            return "error-event"
        assert lines[-1] == "data: [DONE]"
        return "ok"

    def loop(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(30.0)) as client:  # NOTE: a hung stream fails the test here
            while not self.stop.is_set():
                self.outcomes.append((time.monotonic(), self.one(client)))

    def run(self) -> None:
        threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.fixture(scope="module")
def cluster():
    """A head node and node B on this machine (1 CPU each), for every test here (the one that kills
    B's raylet runs last); yields (GCS address, temp dir, node B's `ray start` arguments, HTTP port);
    every process of the cluster is killed after.

    NOTE: one HTTP port for every `attnserve serve --address` here: Serve's proxy keeps the port
    of the first application a cluster starts, and a later one's --port is not where it answers."""
    temp_dir = tempfile.mkdtemp(prefix="attnserve-2n-", dir="/tmp")  # NOTE: every process of this cluster names it
    address = f"127.0.0.1:{free_port()}"
    node_b = ["--address", address, "--resources", json.dumps({"replica_slot": 1, "node_b": 1})]
    try:
        ray_start("--head", "--include-dashboard", "false", "--port", address.rsplit(":", 1)[1], "--temp-dir", temp_dir,
                  "--ray-client-server-port",
                  str(free_port()), "--resources", json.dumps({"replica_slot": 1, "head": 1}), *node_ports(0))
        ray_start(*node_b, *node_ports(1))
        yield address, temp_dir, node_b, free_port()
    finally:
        for pid in pids_with(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_bench_parallel_quick_run(cluster, tiny_checkpoints, tmp_path):
    """loadtests/bench_parallel.py on this cluster (`--address`): one process, TP=2 and PP=2 (a
    stage on each node) on the tiny model, with the workers' communication timers."""
    out = tmp_path / "parallel.json"
    proc = subprocess.run([sys.executable, str(ROOT / "loadtests" / "bench_parallel.py"), "--address", cluster[0],
                           "--model", str(tiny_checkpoints["llama"]), "--forms", "tp1,tp2,pp2", "--repeats", "1",
                           "--batch", "2", "--prompt-len", "16", "--max-tokens", "4", "--enforce-eager",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["tp1", "tp2", "pp2"]
    for form in ("tp2", "pp2"):
        r = results[form]
        assert r["ms_per_token_b1"] > 0 and r["tokens_per_s"] > 0 and len(r["workers"]) == 2
        ranks = r["comm_b2"]["ranks"]
        assert all(x["steps"] > 0 and 0 < x["step_ms"] and x["comm_ms"] <= x["step_ms"] for x in ranks)
    assert all(x["collective_ms"] > 0 for x in results["tp2"]["comm_b1"]["ranks"])  # shared-memory all-reduces
    assert results["pp2"]["comm_b1"]["ranks"][1]["recv_ms"] > 0  # stage 1 waits on stage 0's hidden states
    assert "comm ms/step" in proc.stdout and "pp2" in proc.stdout


@pytest.mark.slow
def test_pipeline_stages_on_two_nodes(cluster, tiny_variants, tmp_path):
    """`attnserve serve --pipeline-parallel-size 2` on two Ray nodes: one stage on each (SPREAD),
    hidden states sent between them, the unsharded model's greedy text."""
    from server.engine import EngineConfig, LLMEngine, SamplingParams

    path = tiny_variants["tiny-gqa"]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, num_blocks=256,
                                    kv_cache_memory=None, enforce_eager=True))
    prompts = ["Beautiful is better than", "Errors should never pass", "Now is better than never"]
    expected = [g[0].text for g in engine.generate([engine.tokenizer(p)["input_ids"] for p in prompts],
                                                    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    http_port = cluster[3]
    cmd = [str(BIN / "attnserve"), "serve", "--address", cluster[0], "--port", str(http_port),
           "--proxy-location", "HeadOnly", "--model", f"tiny={path}", "--pipeline-parallel-size", "2",
           "--num-cpus", "1", "--dtype", "float32", "--enforce-eager", "--num-blocks", "128"]
    url = f"http://127.0.0.1:{http_port}"
    with running(cmd, url, tmp_path / "serve.log", timeout=300):
        (model,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        stages = sorted(model["workers"], key=lambda w: w["pp_rank"])
        assert model["pipeline_parallel_size"] == 2 and [w["pp_rank"] for w in stages] == [0, 1]
        assert stages[0]["node_id"] != stages[1]["node_id"]  # one stage per node
        assert stages[0]["layers"][1] == stages[1]["layers"][0]
        for prompt, text in zip(prompts, expected):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


@pytest.mark.slow
def test_second_node_killed_under_load_then_rejoins(cluster, tiny_variants, tmp_path):
    address, temp_dir, node_b, http_port = cluster
    cmd = [str(BIN / "attnserve"), "serve", "--address", address, "--port", str(http_port),
           "--proxy-location", "HeadOnly", "--model", f"tiny={tiny_variants['tiny-gqa']}", "--replicas", "2",
           "--num-cpus", "0.5", "--dtype", "float32", "--enforce-eager", "--kv-cache-memory", "4MiB",
           "--replica-resources", '{"replica_slot": 1}', "--ingress-resources", '{"head": 0.01}']
    url = f"http://127.0.0.1:{http_port}"
    with running(cmd, url, tmp_path / "serve.log", timeout=300):
        nodes = wait_for(lambda: (lambda n: n if len(n) == 2 else None)(replicas_by_node(url)), 120,
                         "a replica on each node")
        assert sorted(len(ids) for ids in nodes.values()) == [1, 1]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'attnserve_replicas{attention="gqa",kv_cache_dtype="float32",kv_heads="2",model="tiny"} 2.0' in metrics  # both nodes summed

        load = Load(url)
        load.start()
        wait_for(lambda: len(load.outcomes) >= 8, 60, "traffic before the kill")
        raylet_b = [p for p in pids_with(temp_dir, "raylet") if p in pids_with('"node_b"', "raylet")
                    or p in pids_with("node_b", "raylet")]
        assert len(raylet_b) == 1, raylet_b
        killed_at = time.monotonic()
        os.kill(raylet_b[0], signal.SIGKILL)

        # traffic goes on through node A
        wait_for(lambda: sum(1 for t, o in load.outcomes if t > killed_at + 5 and o == "ok") >= 8, 90,
                 "requests completing on node A after the kill")
        ray_start(*node_b, *node_ports(2))  # node B rejoins; Serve places the replica there again
        wait_for(lambda: (lambda n: n if len(n) == 2 else None)(replicas_by_node(url)), 180,
                 "the replica back on the rejoined node")
        load.stop.set()
        load.join(timeout=60)
        assert not load.is_alive()  # every stream ended: none hung past its timeout
        outcomes = [o for _, o in load.outcomes]
        assert set(outcomes) <= {"ok", "error-event", "http-5xx"}
        assert outcomes.count("ok") > len(outcomes) // 2
        # no block left held on the live replicas (the dead one's last report goes stale in 15 s)
        wait_for(lambda: httpx.get(f"{url}/dashboard/data", timeout=30).json()["models"][0]["kv_blocks_used"] == 0,
                 40, "every KV block free")
        # NOTE: B's streams in flight at the kill end either way: with an error, or complete when its
        # worker outlives its raylet for a moment; what must never happen is a hang (timeout above)
        # B's replica did die: the controller saw its actor crash, or its node's death (which of the two
        # it logs first depends on when the GCS misses B's heartbeats)
        log = (tmp_path / "serve.log").read_text()
        assert "its node has died" in log or re.search(r"Replica\(id='\w+', deployment='model-tiny'.*\) crashed", log)
