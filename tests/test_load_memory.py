"""Loading a GGUF file holds its packed weights and one chunk of one matrix, never the model twice: peak
resident memory (bytes, not seconds) in a process of its own, against the same process loading a tiny
model (the runtime's fixed cost)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.random_gguf import hf_config, write_random_gguf
from tests.tiny import train_tokenizer

PROBE = """
import json, sys
from models.loader import load_for_serving
from models.native.memory import resident_bytes
model = load_for_serving(sys.argv[1])
rss, peak = resident_bytes()
print(json.dumps({"served": model.weight_bytes(), "rss": rss, "peak": peak, "kinds": model.quantization}))
"""


REFUSED = """
import json, sys
from models.native.memory import resident_bytes
from server.engine import EngineConfig, LLMEngine
try:
    LLMEngine(EngineConfig(model=sys.argv[1], memory_budget="256MiB", enforce_eager=True))
except ValueError as e:
    print(json.dumps({"error": str(e), "peak": resident_bytes()[1]}))
"""


def _load(path: Path, probe: str = PROBE) -> dict:
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tok = train_tokenizer()
    root = tmp_path_factory.mktemp("load-memory")
    tok.save_pretrained(root / "tokenizer")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    shapes = {"tiny": (256, 2, 512), "scaled": (2048, 16, 8192)}  # hidden, layers, FFN: 4 MB and 560 MB of Q4_K_M
    return {name: write_random_gguf(root / name, hf_config(h, n, h // 64, h // 256, ffn, len(tok), True,
                                                           ids["<|im_start|>"], ids["<|im_end|>"]), root / "tokenizer")
            for name, (h, n, ffn) in shapes.items()}


@pytest.mark.slow  # writes and loads a 560 MB file: ~13 s
def test_loading_peaks_at_the_served_weights_plus_a_tenth(files):
    tiny, scaled = _load(files["tiny"]), _load(files["scaled"])
    assert scaled["kinds"] == "Q4_K+Q6_K"
    # before, every matrix was decoded whole and packed, then copied into huge pages: 3.4 bytes a weight
    assert scaled["peak"] <= 1.1 * scaled["served"] + tiny["peak"], (scaled, tiny)
    assert scaled["served"] < 1.5 * files["scaled"].stat().st_size  # as served today: 6 bits a Q4_K weight


def test_a_model_over_its_budget_is_refused_before_its_weights_are_read(files):
    tiny, refused = _load(files["tiny"]), _load(files["scaled"], REFUSED)
    assert "leaves no room for a KV cache" in refused["error"] and "256.0 MiB" in refused["error"]
    assert "estimated from the checkpoint" in refused["error"]
    assert refused["peak"] < tiny["peak"] + 150 * 2**20, refused  # loading it would add ~800 MB
