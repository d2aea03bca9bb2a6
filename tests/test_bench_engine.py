"""The engine benchmark script runs end to end on a tiny model and writes its JSON; vLLM, which
lives in its own venv, is skipped (and says so) where that venv is missing, as in every test."""
import json

from loadtests.bench_engine import STEP_BATCHES, main


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
    assert data["attnserve"]["startup"]["cold"] > 0 and data["attnserve"]["startup"]["warm"] > 0
    table = capsys.readouterr().out
    assert "hf_generate_batch" in table and "of the roofline" in table and "prefill GFLOP/s" in table
    assert "skipped:" in table and "make peers" in table
    assert "batch-1 decode profile" in table and "batch-32 decode profile" in table and "Self CPU time total" in table
    assert "cold compile cache" in table and "attnserve path: device=cpu isa=" in table
