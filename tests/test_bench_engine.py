"""The engine benchmark script runs end to end on a tiny model and writes its JSON."""
import json

from loadtests.bench_engine import main


def test_bench_engine_quick_run(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--num-requests", "4", "--max-tokens", "6",
          "--min-prompt", "4", "--max-prompt", "40", "--threads", "1", "--profile", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"attnserve", "hf_generate", "hf_generate_batch"}
    for name, row in data.items():
        assert row["output_tokens_per_s"] > 0 and row["ttft_p50_s"] >= 0, name
    ours = data["attnserve"]
    assert ours["batch1_tokens_per_s"] > 0 and ours["roofline_tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert "hf_generate_batch" in table and "of the roofline" in table
    assert "batch-1 profile" in table and "Self CPU time total" in table
