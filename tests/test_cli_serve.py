"""`make serve`'s command, Ray's `serve run deploy/serve.yaml` and the README's sharded `attnserve
generate`, each on its own Ray, with the default model, answering the README's curl and openai
snippets; SIGTERM drains in-flight streams."""
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.servers import BIN, ROOT, free_port, running, wait_ready
from tests.test_two_nodes import pids_with

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def readme_block(lang: str, must_contain: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return next(b for b in blocks if must_contain in b)


def env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PATH": f"{BIN}:{os.environ['PATH']}"}


def started_by(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` started `pid`, directly or through its children (/proc's parent links)."""
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        if pid == ancestor:
            return True
    return False


def stream_until_cut(url: str, out: list, started: threading.Event) -> None:
    """One long greedy stream; records its status, its SSE lines and any transport error."""
    # NOTE: 64 tokens: in flight when SIGTERM comes (sent once all three have a first token), and short
    # enough to finish within the 20 s drain on a slow CPU shared with another test worker
    body = {"model": "default", "prompt": "1 2 3", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out.append(("status", r.status_code))
            for line in r.iter_lines():
                if line:
                    out.append(("line", line))
                    started.set()
    except httpx.HTTPError as e:
        out.append(("exception", type(e).__name__))
    started.set()


def test_make_serve_answers_the_readme_snippets_and_drains_on_sigterm(tmp_path):
    """`make serve`'s command as a user runs it: the README's curl and openai snippets; then SIGTERM
    with three streams in flight: each drains to [DONE] or is cut cleanly (never left hanging), and
    the process exits 0."""
    dry = subprocess.run(["make", "--no-print-directory", "-n", "serve"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    command = next(line for line in dry.splitlines() if "/bin/attnserve " in line).split()
    assert command[-1] == "serve" and command[0].endswith("/bin/attnserve")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:  # NOTE: a file, not a pipe: Ray's logs would fill a pipe nobody reads yet
        proc = subprocess.Popen([str(BIN / "attnserve"), "serve", "--port", str(port)], cwd=ROOT, env=env(),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    streams = []
    try:
        wait_ready(url, proc, timeout=300)
        # the cluster it started runs Serve's controller at its slower loop (server/cli.py LOCAL_CLUSTER_ENV)
        (controller,) = [p for p in pids_with("ray::ServeController") if started_by(p, proc.pid)]
        assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5" in Path(f"/proc/{controller}/environ").read_text().split("\0")
        path = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["cpu_path"]
        from models.native.cpu_features import machine_isa

        # --dtype auto: bf16 only where this CPU (or the cap CI runs under) has bf16 arithmetic
        native_bf16 = machine_isa() in ("avx512_bf16", "amx")
        assert path["isa"] == machine_isa() and path["attention"] == f"native-{machine_isa()}"
        # the shipped GGUF as stored: every linear quantized (Q4_1 layers, the Q8_0 head)
        assert (path["dtype"], path["weight_dtype"], path["linear"], path["quantization"]) == (
            "bfloat16" if native_bf16 else "float32", "Q4_1+Q8_0", "quantized", "Q4_1+Q8_0")
        curl = readme_block("bash", "curl ").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120, check=True).stdout
        assert "Paris" in out and '"finish_reason"' in out
        snippet = readme_block("python", "OpenAI(").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        res = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, env=env())
        assert res.returncode == 0, res.stderr
        assert "Paris" in res.stdout
        snippet = readme_block("python", "response_format=City").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        res = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, env=env())
        assert res.returncode == 0, res.stderr
        assert "name='Paris'" in res.stdout and "name='get_weather'" in res.stdout, res.stdout
        for _ in range(3):  # in flight when the signal comes
            lines, started = [], threading.Event()
            thread = threading.Thread(target=stream_until_cut, args=(url, lines, started), daemon=True)
            thread.start()
            started.wait(60)
            streams.append((thread, lines))
    finally:
        proc.send_signal(signal.SIGTERM)
        for thread, _ in streams:
            thread.join(timeout=120)
            assert not thread.is_alive(), "an in-flight request hung through shutdown"
        proc.wait(timeout=120)
    output = log.read_text()
    assert proc.returncode == 0, output[-3000:]
    assert f"attnserve is up at {url}" in output and "shutting down" in output
    ends = []
    for lines in (lines for _, lines in streams):  # drained to the end, or cut cleanly: never left hanging
        sse = [v for k, v in lines if k == "line"]
        assert sse and (sse[-1] == "data: [DONE]" or any(k == "exception" for k, _ in lines)), lines[-3:]
        ends.append(sse[-1])
    assert "data: [DONE]" in ends  # the drain let at least one finish
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def offline_answer(serve_yaml, question: str, max_tokens: int) -> str:
    """The greedy chat answer of an LLMEngine built in this process from serve.yaml's engine fields."""
    from dataclasses import replace

    import yaml

    from server.engine import LLMEngine, SamplingParams
    from server.serve_config import ServeConfig
    from tests.test_default_model import chat_ids

    (app,) = yaml.safe_load(serve_yaml.read_text())["applications"]
    cfg = ServeConfig.from_args(app["args"]).engine_config("default")
    engine = LLMEngine(replace(cfg, kv_cache_memory="32MiB"))  # NOTE: the pool's size changes no token
    (group,) = engine.generate([chat_ids(engine.tokenizer, question)], SamplingParams(max_tokens=max_tokens, temperature=0))
    return group[0].text


def test_serve_run_deploy_serve_yaml_with_an_8bit_kv_cache(tmp_path):
    """serve.yaml as shipped, with its `kv_cache_dtype` switched to fp8_e4m3: the pool holds twice
    bf16's blocks in what the memory budget leaves after the weights, and /v1/models, usage and
    /metrics say so. The answer is the greedy one of an engine built offline from the same file: an
    8-bit cache may flip a near tie (on an AVX2 CPU, fp32 with e4m3 opens with "L'" where the
    first-token gap to "The" is 0.08 nats), so the text itself is not the check."""
    port = free_port()
    config = (ROOT / "deploy" / "serve.yaml").read_text().replace("port: 8000", f"port: {port}")
    assert "kv_cache_dtype: auto" in config
    (tmp_path / "serve.yaml").write_text(config.replace("kv_cache_dtype: auto", "kv_cache_dtype: fp8_e4m3"))
    expected = offline_answer(tmp_path / "serve.yaml", "What is the capital of France?", max_tokens=16)
    cmd = [str(BIN / "serve"), "run", str(tmp_path / "serve.yaml")]
    with running(cmd, f"http://127.0.0.1:{port}", tmp_path / "serve.log", env=env(), stop_signal=signal.SIGINT,
                 timeout=300) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        per_token = 2 * 30 * 3 * 64  # one byte per element: half of bf16's 23,040
        assert (model["kv_cache_dtype"], model["kv_bytes_per_token"]) == ("fp8_e4m3", per_token)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
        usage = r.json()["usage"]
        blocks = -(-(usage["prompt_tokens"] + usage["completion_tokens"] - 1) // 16)  # the last token is never cached
        assert usage["kv_cache_bytes"] == blocks * 16 * per_token
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
                   for s in fam.samples}
        labels = (("attention", "gqa"), ("kv_cache_dtype", "fp8_e4m3"), ("kv_heads", "3"), ("model", "default"))
        assert samples[("attnserve_kv_bytes_per_token", labels)] == per_token
        weights = ("attnserve_model_weight_bytes", (*labels, ("quantization", model["quantization"])))
        assert samples[weights] == model["weight_bytes"] > 0
        budget = int(1.5 * 2**30)  # serve.yaml's memory_budget, kv_cache_memory auto
        assert samples[("attnserve_kv_blocks", (*labels, ("state", "total")))] == \
            (budget - model["weight_bytes"]) // (16 * per_token)


# NOTE: here, not beside the other tensor-parallel tests on the session's Ray: it starts a Ray of its own
def test_readme_generate_command_shards_the_default_model():
    """The README's `attnserve generate --tensor-parallel-size 2` line, run as a user would (its own
    local Ray, two workers of half a CPU)."""
    import json
    import types

    line = next(x for x in readme_block("bash", "--tensor-parallel-size").splitlines() if " generate " in x)
    out = subprocess.run(["bash", "-c", line.replace(".venv/bin/", f"{BIN}/") + " --max-tokens 12"],
                         capture_output=True, text=True, timeout=600, env=env(), check=True).stdout
    row = json.loads(out.splitlines()[-1])
    # NOTE: its first token is a near-tie ("The" / "L'", 0.13 apart at TP=1 in bf16): the ranks' partial
    # sums, rounded to bf16 each, can flip it. The rule of reduced precision (tests/reference.py):
    # TP=1's tokens up to a first difference that TP=1 itself weighed as a near-tie.
    from server.engine import EngineConfig, LLMEngine, SamplingParams
    from tests.reference import NEAR_TIE, first_divergences

    one = LLMEngine(EngineConfig(model="default"))
    ref = one.generate([row["prompt_token_ids"]], SamplingParams(max_tokens=12, temperature=0, logprobs=5))[0][0]
    (leading,), gaps = first_divergences([ref], [types.SimpleNamespace(token_ids=row["token_ids"])])
    assert all(gap <= NEAR_TIE for gap in gaps), (gaps, row["text"], ref.text)
    if not gaps:
        assert "Paris" in row["text"]
