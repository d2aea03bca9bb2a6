"""The GGUF types kept in 8-bit codes (Q2_K, Q3_K, IQ4_NL, IQ4_XS) load and answer as their dequantized
weights do: a tiny Llama of random blocks of each, served as stored and served dequantized."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.random_gguf import hf_config, write_random_gguf
from tests.tiny import train_tokenizer

TYPES = {"token_embd": T.IQ4_NL, "output": T.Q2_K, "attn_q": T.Q2_K, "attn_k": T.Q3_K, "attn_v": T.IQ4_XS,
         "attn_output": T.Q3_K, "ffn_gate": T.IQ4_XS, "ffn_up": T.Q2_K, "ffn_down": T.IQ4_NL}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    tok = train_tokenizer()
    root = tmp_path_factory.mktemp("gguf-types")
    tok.save_pretrained(root / "tokenizer")
    ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    cfg = hf_config(256, 2, 4, 2, 512, len(tok), False, *ids)  # K 256 and 512: whole super-blocks
    return write_random_gguf(root / "model", cfg, root / "tokenizer",
                             types=lambda name, n, tied: TYPES[name.split(".")[-1]])


def _engine(path, quantization: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization=quantization, activations="exact",
                                  num_blocks=64, kv_cache_memory=None, block_size=4, enforce_eager=True))


def test_low_bit_and_iq4_files_answer_as_their_dequantized_weights(path):
    stored, dense = _engine(path, "auto"), _engine(path, "none")
    assert stored.info.quantization == "IQ4_NL+IQ4_XS+Q2_K+Q3_K" and dense.info.quantization == "none"
    assert stored.info.weight_bytes < dense.info.weight_bytes / 2  # 8-bit codes, not fp32
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 130))]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = [g[0].token_ids for g in stored.generate(prompts, greedy)]
    want = [g[0].token_ids for g in dense.generate(prompts, greedy)]
    assert got == want
