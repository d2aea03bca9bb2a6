"""Quantized weights on the serving side: EngineConfig's quantization and memory budget, the KV pool
sized from what the weights leave, the CLI flags, and eval rows per weight format."""
import dataclasses
import json
import re

import pytest

from models.native.cpu_path import QUANTIZATIONS
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.config import parse_size

BUDGET = "2MiB"  # the tiny Llama's fp32 weights take about a fifth of it: ~1,600 blocks of 4 tokens remain


def tiny_engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", block_size=4, enforce_eager=True, memory_budget=BUDGET)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def pool_bytes(engine: LLMEngine) -> int:
    return engine.info.num_blocks * engine.kv_spec.bytes_per_block


# ---- EngineConfig ------------------------------------------------------------------------------
def test_config_defaults_and_validation():
    cfg = EngineConfig()
    assert (cfg.quantization, cfg.kv_cache_memory, cfg.memory_budget) == ("auto", "auto", "auto")
    for q in QUANTIZATIONS:
        assert EngineConfig(quantization=q).quantization == q
    for bad in ("int3", "INT8", "fp8", ""):
        with pytest.raises(ValueError, match=r"quantization must be one of auto, none, int8, int4, int4_g128"):
            EngineConfig(quantization=bad)
    assert EngineConfig(memory_budget="512MiB").memory_budget == 512 * 2**20
    assert EngineConfig(memory_budget=12345).memory_budget == 12345
    with pytest.raises(ValueError, match="memory_budget: cannot parse size 'lots'"):
        EngineConfig(memory_budget="lots")
    for bad in (0, "0GiB", -5):
        with pytest.raises(ValueError, match="memory_budget must be positive"):
            EngineConfig(memory_budget=bad)
    with pytest.raises(ValueError, match="kv_cache_memory: cannot parse size 'some'"):
        EngineConfig(kv_cache_memory="some")
    with pytest.raises(ValueError, match="give kv_cache_memory"):
        EngineConfig(kv_cache_memory=None)
    assert EngineConfig(kv_cache_memory=None, num_blocks=8).num_blocks == 8
    assert EngineConfig(kv_cache_memory="1GiB").kv_cache_memory == 2**30  # a size: the pool itself
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.quantization = "int8"


def test_kv_budget_is_the_memory_budget_minus_the_weights():
    cfg = EngineConfig(memory_budget="1GiB")
    assert cfg.kv_budget(300 * 2**20) == 2**30 - 300 * 2**20
    assert cfg.kv_budget(300 * 2**20) - cfg.kv_budget(100 * 2**20) == -200 * 2**20  # lighter weights, bigger pool
    assert EngineConfig(memory_budget="1GiB", kv_cache_memory="256MiB").kv_budget(300 * 2**20) == 256 * 2**20
    with pytest.raises(ValueError) as e:
        EngineConfig(memory_budget="100MB").kv_budget(200_000_000, "none")
    msg = str(e.value)
    assert "100000000" in msg and "200000000" in msg  # both numbers
    assert "memory_budget" in msg and "--quantization" in msg and "kv_cache_memory" in msg and "num_blocks" in msg
    with pytest.raises(ValueError, match="leaves no room"):  # equal: nothing left either
        EngineConfig(memory_budget=1000).kv_budget(1000)


def test_auto_budget_takes_what_the_machine_has_up_to_its_pool():
    from server.engine.config import AUTO_KV_POOL, HEADROOM, MIN_AUTO_KV_POOL

    cfg = EngineConfig()
    assert cfg.kv_budget(300 * 2**20) == AUTO_KV_POOL  # nothing known of the machine
    assert cfg.kv_budget(300 * 2**20, available=64 * 2**30) == AUTO_KV_POOL
    assert cfg.kv_budget(300 * 2**20, available=HEADROOM + 2**30) == 2**30  # what is left, less the headroom
    with pytest.raises(ValueError, match="no memory left for a KV cache") as e:
        cfg.kv_budget(300 * 2**20, available=HEADROOM)
    assert "300.0 MiB" in str(e.value) and "512.0 MiB" in str(e.value)
    cfg.check_fits(8 * 2**30, available=None)  # not Linux: nothing to check against
    cfg.check_fits(8 * 2**30, available=8 * 2**30 + MIN_AUTO_KV_POOL + HEADROOM)
    with pytest.raises(ValueError, match="does not fit in memory") as e:
        cfg.check_fits(8 * 2**30, available=6 * 2**30)
    assert all(s in str(e.value) for s in ("8.00 GiB", "6.00 GiB", "256.0 MiB", "--kv-cache-memory", "--quantization"))
    with pytest.raises(ValueError, match=r"KV pool 4.00 GiB"):  # a pool asked for counts whole
        EngineConfig(kv_cache_memory="4GiB").check_fits(2**30, available=5 * 2**30)
    EngineConfig(kv_cache_memory=None, num_blocks=8).check_fits(2**30, available=2**30 + HEADROOM)
    with pytest.raises(ValueError, match="leaves no room for a KV cache"):  # a budget below the weights
        EngineConfig(memory_budget="1GiB").check_fits(2**30, available=None)


# ---- the engine's KV pool ----------------------------------------------------------------------
def test_auto_pool_is_what_the_weights_leave(tiny_checkpoints):
    e = tiny_engine(tiny_checkpoints["llama"])
    weights = e.model.weight_bytes()
    assert e.info.weight_bytes == weights > 0 and e.info.quantization == e.model.quantization == "none"
    left = parse_size(BUDGET) - weights
    bpb = e.kv_spec.bytes_per_block
    assert pool_bytes(e) <= left < pool_bytes(e) + bpb  # as many whole blocks as fit, to one block
    assert e.cache.num_blocks == e.kv.num_blocks == e.info.num_blocks
    out = e.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0][0]
    assert len(out.token_ids) == 4 and e.kv.num_used_blocks == 0  # it serves
    # explicit sizes win over the budget
    assert tiny_engine(tiny_checkpoints["llama"], kv_cache_memory=64 * bpb).info.num_blocks == 64
    assert tiny_engine(tiny_checkpoints["llama"], kv_cache_memory=None, num_blocks=7).info.num_blocks == 7
    # a bigger budget: every extra byte is KV
    bigger = tiny_engine(tiny_checkpoints["llama"], memory_budget=parse_size(BUDGET) + 100 * bpb)
    assert bigger.info.num_blocks == e.info.num_blocks + 100


def test_a_budget_below_the_weights_is_a_clear_error(tiny_checkpoints, monkeypatch):
    import models.loader
    from models.loader import load_for_serving

    weights = load_for_serving(tiny_checkpoints["llama"], "float32").weight_bytes()
    built = []
    monkeypatch.setattr(models.loader, "model_from_checkpoint", lambda *a, **k: built.append(1))
    with pytest.raises(ValueError, match="leaves no room for a KV cache") as e:  # before any weight is read
        tiny_engine(tiny_checkpoints["llama"], memory_budget=weights // 2)
    assert not built
    estimate = int(re.search(r"weights take about (\d+) bytes", str(e.value)).group(1))
    assert str(weights // 2) in str(e.value) and abs(estimate - weights) <= weights // 100
    monkeypatch.undo()
    with pytest.raises(ValueError, match="below one block") as e:  # room, but under one block
        tiny_engine(tiny_checkpoints["llama"], memory_budget=weights + 10)
    assert "memory_budget" in str(e.value)
    assert tiny_engine(tiny_checkpoints["llama"], memory_budget=weights // 2, num_blocks=5).info.num_blocks == 5


@pytest.mark.parametrize("quantization, format_", [("int8", "int8"), ("int4", "int4_g32")])
def test_quantized_weights_buy_kv_blocks(tiny_checkpoints, quantization, format_):
    """Needs the loader to honour `quantization`: the pool grows by exactly the bytes the weights
    no longer take, to one block."""
    full = tiny_engine(tiny_checkpoints["llama"], quantization="none")
    small = tiny_engine(tiny_checkpoints["llama"], quantization=quantization)
    assert small.info.quantization == small.model.quantization == format_
    assert small.info.weight_bytes == small.model.weight_bytes() < full.info.weight_bytes
    saved = full.info.weight_bytes - small.info.weight_bytes
    bpb = full.kv_spec.bytes_per_block
    assert small.info.num_blocks > full.info.num_blocks
    assert abs((pool_bytes(small) - pool_bytes(full)) - saved) < bpb
    out = small.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0][0]
    assert len(out.token_ids) == 4


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_takes_quantization_and_memory_budget():
    from server.cli import _engine_config, build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["serve"]):
        cfg = _engine_config(parser.parse_args(command))
        assert (cfg.quantization, cfg.memory_budget, cfg.kv_cache_memory) == ("auto", "auto", "auto")
        for q in QUANTIZATIONS:
            assert _engine_config(parser.parse_args([*command, "--quantization", q])).quantization == q
        assert cfg.activations == "auto"
        for a in ("exact", "int8"):
            assert _engine_config(parser.parse_args([*command, "--activations", a])).activations == a
        cfg = _engine_config(parser.parse_args([*command, "--quantization", "int4_g128", "--memory-budget", "3GiB"]))
        assert (cfg.quantization, cfg.memory_budget, cfg.kv_cache_memory) == ("int4_g128", 3 * 2**30, "auto")
        cfg = _engine_config(parser.parse_args([*command, "--kv-cache-memory", "256MiB"]))
        assert cfg.kv_cache_memory == 256 * 2**20
        cfg = _engine_config(parser.parse_args([*command, "--num-blocks", "9"]))
        assert (cfg.num_blocks, cfg.kv_cache_memory) == (9, None)
        for bad in (["--quantization", "int3"], ["--quantization", "int8", "int4"]):
            with pytest.raises(SystemExit):
                parser.parse_args([*command, *bad])
        with pytest.raises(ValueError, match="memory_budget: cannot parse size"):
            _engine_config(parser.parse_args([*command, "--memory-budget", "huge"]))
    assert parser.parse_args(["eval"]).quantization == ["auto"]
    assert parser.parse_args(["eval", "--quantization", "none", "int8", "int4"]).quantization == ["none", "int8", "int4"]
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--quantization", "none", "int5"])


def test_cli_generate_says_why_a_budget_is_too_small(tiny_checkpoints, capsys):
    from server.cli import main

    assert main(["generate", "--model", str(tiny_checkpoints["llama"]), "--dtype", "float32", "--prompt", "hi",
                 "--memory-budget", "1KB", "--enforce-eager"]) == 2
    err = capsys.readouterr().err
    assert "attnserve generate: error: memory_budget (1000 bytes" in err and "--memory-budget" in err


# ---- eval --------------------------------------------------------------------------------------
TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York, and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried. ") * 4


def run_eval(path, tmp_path, *quantizations) -> list[dict]:
    from server.cli import main

    text, out = tmp_path / "text.txt", tmp_path / "eval.json"
    text.write_text(TEXT)
    args = ["eval", "--text", str(text), "--dtype", "float32", "--window", "48", "--stride", "16",
            "--model", str(path), "--json", str(out)]
    assert main([*args, *(["--quantization", *quantizations] if quantizations else [])]) == 0
    return json.loads(out.read_text())


def test_eval_rows_carry_the_weight_format_and_bytes(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    from models.loader import load_for_serving
    from server import eval_results
    from server.cli import EVAL_KEYS

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_checkpoints["llama"]
    (row,) = run_eval(path, tmp_path)  # default: auto, a safetensors checkpoint as stored
    assert tuple(row) == EVAL_KEYS and row["quantization"] == "none"
    assert row["weight_bytes"] == load_for_serving(path, "float32").weight_bytes()
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("model"))
    assert "weights" in header and "weight bytes" in header and "perplexity" in header
    assert row["activations"] == "exact"  # nothing quantized
    assert f" none {'exact':>16} {row['weight_bytes']:13d} " in table
    assert eval_results.load() == [row]


def test_eval_one_row_per_model_and_quantization(tiny_checkpoints, tmp_path, monkeypatch):
    """Needs the loader to honour `quantization`."""
    from server import eval_results

    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path / "cache"))
    rows = run_eval(tiny_checkpoints["llama"], tmp_path, "none", "int8", "int4")
    assert [r["quantization"] for r in rows] == ["none", "int8", "int4_g32"]
    full, int8, int4 = rows
    assert full["weight_bytes"] > int8["weight_bytes"] > int4["weight_bytes"]
    assert full["kv_bytes_per_token"] == int8["kv_bytes_per_token"] == int4["kv_bytes_per_token"]
    assert int8["perplexity"] != full["perplexity"] and int8["perplexity"] == pytest.approx(full["perplexity"], rel=0.05)
    assert sorted(r["quantization"] for r in eval_results.load()) == ["int4_g32", "int8", "none"]  # all kept


@pytest.mark.default_model
def test_default_model_is_held_at_its_files_size():
    """The shipped Q4_1 file served as stored: its tied Q8_0 table is read by the embedding out of
    the LM head's panels (held once), so the weights in memory take no more than the file."""
    import torch

    from models.loader import load_for_serving, read_checkpoint
    from models.quant_linear import QuantEmbedding
    from models.registry import resolve_model, stored_gguf

    path = stored_gguf(resolve_model("default"))
    model = load_for_serving(path, dtype="float32", quantization="auto")
    assert isinstance(model.embed, QuantEmbedding) and model.embed.codes.data_ptr() == model.lm_head.codes.data_ptr()
    assert model.weight_bytes() <= path.stat().st_size, (model.weight_bytes(), path.stat().st_size)
    ids = torch.tensor([0, 1, 2, 17, 9000, 49151])
    table = read_checkpoint(path).tensors["model.embed_tokens.weight"]  # the file's rows, dequantized by gguf
    assert torch.equal(model.embed(ids), table[ids].float())
