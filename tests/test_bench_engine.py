"""The engine benchmark script runs end to end on a tiny model and writes its JSON; vLLM, which
lives in its own venv, is skipped (and says so) where that venv is missing, as in every test. Its
`--startup` run is also the test that a new process loads the compiled step from the disk cache."""
import json

import pytest

from loadtests.bench_engine import L3_FASTER, STEP_BATCHES, main
from models.native.memory import l3_bytes


@pytest.mark.slow  # ~90 s: six systems, a profile, a cold and a warm start
def test_bench_engine_quick_run(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--num-requests", "4", "--max-tokens", "6",
          "--min-prompt", "4", "--max-prompt", "40", "--threads", "1", "--step-tokens", "4", "--prefill-tokens", "48",
          "--systems", "attnserve,attnserve_eager,vllm,llamacpp,hf_generate,hf_generate_batch",
          "--peers-venv", str(tmp_path / "no-venv"), "--llama-bench", str(tmp_path / "no-llama-bench"),
          "--profile", "--startup", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"attnserve", "attnserve_eager", "vllm", "llamacpp", "hf_generate", "hf_generate_batch"}
    assert "make peers" in data.pop("vllm")["skipped"] and "make peers" in data.pop("llamacpp")["skipped"]
    for name, row in data.items():
        assert row["output_tokens_per_s"] > 0 and row["ttft_p50_s"] >= 0, name
    for name in ("attnserve", "attnserve_eager"):
        row = data[name]
        assert set(row["step_ms"]) == {str(b) for b in STEP_BATCHES} and min(row["step_ms"].values()) > 0
        assert row["prefill_s"] > 0 and row["roofline_tokens_per_s"] > 0 and row["prefill_flops"] > 0
    assert data["attnserve"]["compile_s"] > 0 and data["attnserve_eager"]["compile_s"] == 0
    ours = data["attnserve"]  # the roofline against the level the weights live in
    assert ours["l3_bytes"] == l3_bytes() and ours["dram_bandwidth_gb_s"] > 0
    assert ours["weights_fit_l3"] == (ours["l3_bytes"] is not None and ours["weight_bytes"] <= ours["l3_bytes"])
    # the level is measured: the L3's only where the weights fit it and a read of their size beats DRAM's
    faster = ours["read_bandwidth_gb_s"] > L3_FASTER * ours["dram_bandwidth_gb_s"]
    assert ours["roofline_level"] == ("L3" if ours["weights_fit_l3"] and faster else "DRAM")
    assert ours["roofline_tokens_per_s"] == pytest.approx(ours["read_bandwidth_gb_s"] * 1e9 / ours["weight_bytes"])
    startup = data["attnserve"]["startup"]
    assert startup["cold"] > 0 and startup["warm"] > 0
    # a new process with an empty compile cache compiles; the next loads what it left, compiling nothing
    assert startup["cache"]["cold"]["misses"] >= 1 and startup["cache"]["cold"]["hits"] == 0
    assert startup["cache"]["warm"]["hits"] >= 1 and startup["cache"]["warm"]["misses"] == 0
    table = capsys.readouterr().out
    assert "hf_generate_batch" in table and "of the roofline" in table and "prefill GFLOP/s" in table
    assert f"read as one buffer of their size: the {ours['roofline_level']}'s; L3 " in table
    assert "skipped:" in table and "make peers" in table
    assert "batch-1 decode profile" in table and "batch-32 decode profile" in table and "Self CPU time total" in table
    assert "cold compile cache" in table and "graphs compiled" in table and "attnserve path: device=cpu isa=" in table


def test_bench_structured_quick_run(tiny_checkpoints, tmp_path, capsys):
    from loadtests.bench_structured import main as bench_structured

    out = tmp_path / "structured.json"
    bench_structured(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--batches", "1", "4",
                      "--max-tokens", "6", "--repeats", "1", "--num-schemas", "2", "--answer-tokens", "8",
                      "--peers-venv", str(tmp_path / "no-venv"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert "make peers" in data["vllm"]["skipped"]
    ours = data["attnserve"]
    assert set(ours["tok_s"]) == {"1", "4"} and all(min(t.values()) > 0 for t in ours["tok_s"].values())
    assert ours["ttft_ms"]["new"] > 0 and ours["compile_ms"]["cold"][0] > ours["compile_ms"]["cached"][0]
    assert len(ours["answers"]) == 50
    table = capsys.readouterr().out
    assert "step overhead" in table and "TTFT, new schema" in table and "parse and validate" in table


def test_bench_speculative_quick_run(tiny_checkpoints, tmp_path, capsys):
    """Quick mode end to end on the tiny model (its own draft), in fp32: speculation must not change a
    greedy output; vLLM is skipped (no venv)."""
    from loadtests.bench_speculative import main as bench_speculative

    tiny, out = str(tiny_checkpoints["llama"]), tmp_path / "spec.json"
    bench_speculative(["--quick", "--model", tiny, "--draft-model", tiny, "--dtype", "float32", "--threads", "1",
                       "--systems", "attnserve,attnserve_ngram,attnserve_draft,vllm_ngram",
                       "--disable-by-batch-size", "64", "--no-auto-disable", "--peers-venv", str(tmp_path / "no-venv"),
                       "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["batch_sizes"] == [1, 2] and data["config"]["max_tokens"] == 16
    workloads = {"copy", "code_edit", "extract", "chat"}
    assert set(data["workloads"]) == workloads and all(len(w["about"]) == 2 for w in data["workloads"].values())
    results = data["results"]
    assert "make peers" in results["vllm_ngram"]["skipped"]
    assert results["attnserve_ngram"]["spec_config"]["disable_by_batch_size"] == 64
    drafted = 0
    for system in ("attnserve", "attnserve_ngram", "attnserve_draft"):
        assert set(results[system]["workloads"]) == workloads
        for name, rows in results[system]["workloads"].items():
            assert set(rows) == {"1", "2"}
            for batch, row in rows.items():
                assert row["tok_s"] > 0 and len(row["outputs"]) == 2 and 0 < row["num_output_tokens"] <= 2 * 16
                if system != "attnserve":
                    assert row["accepted"] <= row["drafted"] and row["steps"] <= row["drafted"]
                    drafted += row["drafted"]
                    same = data["comparisons"][system][name][batch]["identical_outputs"]
                    assert same["same"] == same["total"] == 2, (system, name, batch, same)
                    assert data["comparisons"][system][name][batch]["vs_attnserve"] > 0
    assert drafted > 0
    # the draft is the target itself: every draft it makes is accepted
    draft = results["attnserve_draft"]["workloads"]["chat"]["1"]
    assert draft["drafted"] > 0 and draft["accepted"] == draft["drafted"]
    table = capsys.readouterr().out
    assert "| workload | batch | system | tok/s" in table and "skipped:" in table and "attnserve_draft" in table


def test_bench_window_quick_run(tiny_checkpoints, tmp_path, capsys):
    """The sliding-window benchmark: the same model with and without windows; the KV one sequence
    holds, read off the pool, shrinks with the windowed layers."""
    from loadtests.bench_window import main as bench_window

    out = tmp_path / "window.json"
    bench_window(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--window", "24",
                  "--batch-sizes", "1,2", "--repeats", "1", "--step-tokens", "4", "--max-num-batched-tokens", "128",
                  "--kv-cache-memory", "64MiB", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["global", "window", "alternate"]
    kv = {form: r["kv_bytes_per_seq"] for form, r in results.items()}
    assert kv["window"] < kv["alternate"] < kv["global"]
    for r in results.values():
        assert min(r["step_ms"].values()) > 0 and r["prefill_s"] > 0 and r["length"] == 96
    table = capsys.readouterr().out
    assert "window 24, sequences of 96 tokens" in table and "alternate" in table


FAKE_LLAMA_BENCH = """#!/bin/sh
# llama-bench as `make peers` builds it: {crash} crashes on prefill (SIGILL, as the native build's AMX code
# in a VM that refuses the tiles), else one JSON row for the test asked for
case " $* " in *" -p 0 "*) prompt=0 ;; *) prompt=1 ;; esac
if [ "$prompt" = 1 ] && [ "{crash}" = yes ]; then echo "invalid opcode" >&2; kill -ILL $$; fi
if [ "$prompt" = 1 ]; then echo '[{{"n_prompt": 512, "n_gen": 0, "samples_ts": [{pp}, {pp}, {pp}]}}]'
else echo '[{{"n_prompt": 0, "n_gen": 128, "samples_ts": [{tg}, {tg}, {tg}], "cpu_info": "fake"}}]'; fi
"""


def test_llamacpp_figures_come_from_the_first_build_that_runs_them(tmp_path):
    """The native build decodes but crashes on prefill: the prefill comes from the AVX-512 build without
    AMX, and each figure names its build; a build that runs both takes both."""
    import argparse

    from loadtests.bench_engine import bench_llamacpp

    builds = {}
    for name, crash, tg, pp in (("native", "yes", 200.0, 0), ("avx512", "no", 90.0, 300.0)):
        bench = tmp_path / f"llama.cpp-{name}" / "bin" / "llama-bench"
        bench.parent.mkdir(parents=True)
        bench.write_text(FAKE_LLAMA_BENCH.format(crash=crash, tg=tg, pp=pp))
        bench.chmod(0o755)
        builds[name] = bench
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = argparse.Namespace(llama_bench=f"{builds['native']},{builds['avx512']}", gguf=str(gguf), threads=2,
                              prefill_tokens=512, repeats=3)
    row = bench_llamacpp(args)
    assert (row["decode_build"], row["prefill_build"]) == ("native", "avx512")
    assert row["batch1_tokens_per_s"] == 200.0 and row["prefill_s"] == pytest.approx(512 / 300.0)
    assert len(row["failures"]) == 1 and "failed (signal 4)" in row["failures"][0]
    args.llama_bench = str(builds["avx512"])
    row = bench_llamacpp(args)
    assert (row["decode_build"], row["prefill_build"], row["failures"]) == ("avx512", "avx512", [])
    args.llama_bench = str(builds["native"])  # no build prefills: skipped, saying why
    assert "failed (signal 4)" in bench_llamacpp(args)["skipped"]
