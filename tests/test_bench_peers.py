"""The embeddings, prompt-logprobs and LoRA benchmarks against vLLM run end to end on a tiny model (vLLM, in its own venv, is
skipped and says so where the venv is missing, as in every test), and the one runner of vLLM's side
keeps figures a script wrote before its process died, and only those."""
import json
import math
import signal
import stat
import statistics
from argparse import Namespace

from loadtests.bench_embeddings import main as bench_embeddings
from loadtests.bench_engine import run_vllm
from loadtests.bench_lora import main as bench_lora
from loadtests.bench_prompt_logprobs import main as bench_prompt_logprobs


def test_bench_embeddings_quick_run(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "embed.json"
    bench_embeddings(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--inputs", "6",
                      "--tokens", "12", "--repeats", "2", "--check", "3", "--threads", "1",
                      "--peers-venv", str(tmp_path / "no-venv"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert "make peers" in data["vllm"]["skipped"] and data["cosines"] is None
    ours = data["attnserve"]
    assert len(ours["runs"]) == 2 and min(ours["runs"]) > 0 and ours["tokens_per_s"] == statistics.median(ours["runs"])
    assert len(ours["embeddings"]) == 3 and all(math.isclose(math.hypot(*e), 1.0, rel_tol=1e-4) for e in ours["embeddings"])
    table = capsys.readouterr().out
    assert "| attnserve |" in table and "| vllm | skipped:" in table and "inputs=6 tokens=12" in table


def test_bench_prompt_logprobs_quick_run(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "plp.json"
    bench_prompt_logprobs(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--tokens", "40",
                           "--repeats", "2", "--threads", "1", "--peers-venv", str(tmp_path / "no-venv"),
                           "--json", str(out)])
    data = json.loads(out.read_text())
    assert "make peers" in data["vllm"]["skipped"]
    ours = data["attnserve"]
    assert set(ours["times_s"]) == {"None", "0", "5"} and all(len(t) == 2 for t in ours["times_s"].values())
    assert len(ours["prompt_logprobs"]) == 39 and all(lp <= 0 for lp in ours["prompt_logprobs"])
    table = capsys.readouterr().out
    assert "| no prompt logprobs |" in table and "| prompt_logprobs=5 |" in table and "largest overhead" in table


def test_bench_lora_quick_run(tiny_checkpoints, tmp_path, capsys):
    """Eager: the script's rounds, processes and ratios are the subject; the compiled step with adapter rows
    is test_lora_variants' and test_lora_model's (each of its four processes compiled one: ~60 s of 2 cores)."""
    out = tmp_path / "lora.json"
    bench_lora(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--requests", "4", "--adapters", "2",
                "--rank", "8", "--min-prompt", "8", "--max-prompt", "16", "--max-tokens", "4", "--repeats", "2", "--rounds", "2",
                "--threads", "1", "--enforce-eager", "--peers-venv", str(tmp_path / "no-venv"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert "make peers" in data["vllm"]["skipped"]
    ours, base = data["attnserve"], data["attnserve_base"]
    for r in (ours, base):
        assert min(r["runs"]) > 0 and r["tokens_per_s"] == statistics.median(r["runs"]) and r["step"] == "eager"
    assert ours["lora_loads"] == 2 and len(ours["load_ms"]) == 2 and min(ours["load_ms"]) > 0
    for r in (ours, base):  # two rounds of two runs, each round its own process
        assert len(r["runs"]) == 4 and len(r["round_medians"]) == 2
    assert ours["round_ratios"] == [a / b for a, b in zip(ours["round_medians"], base["round_medians"])]
    table = capsys.readouterr().out
    assert "| attnserve_base |" in table and "median of the rounds' ratios" in table and "adapter load" in table


FAKE_PYTHON = """#!/bin/sh
# vLLM's python as run_vllm starts it (SCRIPT SPEC OUT): {write} writes OUT, then it aborts (SIGABRT)
[ "{write}" = yes ] && echo '{{"tokens_per_s": 7}}' > "$3"
echo "terminate called without an active exception" >&2
kill -ABRT $$
"""


def test_run_vllm_keeps_figures_written_before_a_crash_and_only_those(tmp_path):
    for write in ("yes", "no"):
        venv = tmp_path / write
        (venv / "bin").mkdir(parents=True)
        python = venv / "bin" / "python"
        python.write_text(FAKE_PYTHON.format(write=write))
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
        result = run_vllm(Namespace(peers_venv=str(venv), threads=1), "vllm_embed.py", {"model": "m"})
        if write == "yes":
            assert result == {"tokens_per_s": 7}
        else:
            assert result["skipped"].startswith(f"vLLM failed (exit {-signal.SIGABRT})")
            assert "without an active exception" in result["skipped"]
