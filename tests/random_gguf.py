"""Llama-shaped GGUF files of random blocks, typed as llama-quantize types them: what loading costs in memory
and time does not depend on the weights' values, so a file of any size is written in seconds, without
llama.cpp. The blocks are valid (finite fp16 scales); the model they make answers nonsense.

`python -m tests.random_gguf OUT_DIR --hidden 2048 --layers 16 ...` writes one for a measurement.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from tests.tiny_gguf import TOKENIZER_FILES, _write_metadata

# Where each type's fp16 scales lie in its block (ggml-common.h): random bytes there could be inf or NaN
_F16_AT = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q4_K: (0, 2),
           T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's llama-quant.cpp: the layers a _M mix gives more bits (the first and last eighth, every third)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m(name: str, num_layers: int, tied: bool) -> T:
    """The type llama-quantize's Q4_K_M gives a matrix: Q6_K for the output (the tied table), and for attn_v
    and ffn_down in use_more_bits layers; Q4_K elsewhere."""
    if name == "output" or (tied and name == "token_embd"):
        return T.Q6_K
    part = name.split(".")
    if len(part) == 3 and part[2] in ("attn_v", "ffn_down") and use_more_bits(int(part[1]), num_layers):
        return T.Q6_K
    return T.Q4_K


def random_blocks(rng: np.random.Generator, kind: T, n: int, k: int, signed: bool = False) -> np.ndarray:
    """(n, k) weights as (n, bytes per row) uint8: random bytes, each fp16 scale set to one in [1e-3, 1e-2)
    (`signed`: either sign)."""
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)  # (blocks, type size)
    for at in _F16_AT[kind]:
        scales = rng.uniform(1e-3, 1e-2, (len(raw), 1)) * (rng.choice([-1, 1], (len(raw), 1)) if signed else 1)
        raw[:, at:at + 2] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(n, k // block * size)


def hf_config(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool,
              bos: int, eos: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": ffn, "vocab_size": vocab, "tie_word_embeddings": tied,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}


def copy_vocab(writer: gguf.GGUFWriter, source: Path, skip: tuple[str, ...]) -> int:
    """The tokenizer.* fields of the GGUF `source` (one llama.cpp's converter wrote) into `writer`, but `skip`;
    returns its number of tokens: what llama.cpp needs to load a file, which this writer has no vocabulary for."""
    reader = gguf.GGUFReader(source)
    tokens = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name in skip:
            continue
        value = field.contents()
        writer.add_key_value(name, value, field.types[0], field.types[1] if len(field.types) > 1 else None)
        if name == "tokenizer.ggml.tokens":
            tokens = len(value)
    return tokens


def write_random_gguf(out_dir: Path, cfg: dict, tokenizer_dir: Path, seed: int = 0, types=None,
                      vocab_from: Path | None = None) -> Path:
    """`out_dir/model.gguf` (returned) of a Llama config `cfg` (hf_config's keys) typed as Q4_K_M (else
    `types(name, num_layers, tied)`), with the tokenizer files of `tokenizer_dir` beside it; `vocab_from`: a
    GGUF whose vocabulary fields to copy (then llama.cpp runs the file too; cfg's vocab_size must be its)."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("random-llama")
    _write_metadata(writer, cfg)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    if vocab_from is not None:
        ids = tuple(f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "padding"))
        if copy_vocab(writer, vocab_from, ids) != cfg["vocab_size"]:
            raise ValueError(f"{vocab_from}'s vocabulary is not the config's {cfg['vocab_size']} tokens")
    h, n, tied = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["tie_word_embeddings"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    matrices = {"token_embd": (cfg["vocab_size"], h)}
    if not tied:
        matrices["output"] = (cfg["vocab_size"], h)
    for i in range(n):
        matrices.update({f"blk.{i}.attn_q": (h, h), f"blk.{i}.attn_k": (kv, h), f"blk.{i}.attn_v": (kv, h),
                         f"blk.{i}.attn_output": (h, h), f"blk.{i}.ffn_gate": (cfg["intermediate_size"], h),
                         f"blk.{i}.ffn_up": (cfg["intermediate_size"], h),
                         f"blk.{i}.ffn_down": (h, cfg["intermediate_size"])})
    for name, (rows, cols) in matrices.items():
        kind = (types or q4_k_m)(name, n, tied)
        raw = random_blocks(rng, kind, rows, cols)
        writer.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    ones = np.ones(h, dtype=np.float32)
    writer.add_tensor("output_norm.weight", ones)
    for i in range(n):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    for key, default in (("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("ffn", 8192)):
        p.add_argument(f"--{key}", type=int, default=default)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--vocab-from", type=Path, help="a converter-written GGUF whose vocabulary to copy, for llama.cpp")
    args = p.parse_args()
    tok = json.loads((args.tokenizer / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    if args.vocab_from is not None:  # NOTE: the converter's token list: the table must have as many rows
        vocab = len(gguf.GGUFReader(args.vocab_from).fields["tokenizer.ggml.tokens"].contents())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos = ids.get("<|im_end|>", ids.get("<|endoftext|>", 0))
    cfg = hf_config(args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, vocab, not args.untied,
                    ids.get("<|im_start|>", eos), eos)
    print(write_random_gguf(args.out, cfg, args.tokenizer, vocab_from=args.vocab_from))


if __name__ == "__main__":
    main()
