"""8-bit KV cache: one scale per layer ("tensor", what attnserve serves) against one per block and
K/V head ("block"), measured as perplexity on the held-out play.

    python loadtests/kv_scale_granularity.py --start 0 --tokens 8000

Both round K/V as a pool would store them, then attend densely over the rounded values: "tensor"
with the calibrated power-of-two scales of `kvcache.quant`, "block" with each 16-token block's own
|max| per head mapped onto the format's largest value (the finest scale a block can have once full,
so an upper bound on what per-block scales could give). This is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvcache.quant import KV_CACHE_DTYPES, dequantize, quantize, scales_for  # noqa: E402
from models import load_model, load_tokenizer, resolve_model  # noqa: E402
from models.attention import DenseAttention  # noqa: E402
from models.corpus import held_out_text  # noqa: E402
from models.perplexity import perplexity  # noqa: E402


def round_per_block(x: torch.Tensor, dtype: torch.dtype, block_size: int = 16) -> torch.Tensor:
    """x (T, Hkv, D) stored with one scale per block of tokens and head, read back."""
    t, h, d = x.shape
    n = -(-t // block_size)
    blocks = F.pad(x.float(), (0, 0, 0, 0, 0, n * block_size - t)).view(n, block_size, h, d)  # (N, bs, Hkv, D)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max  # (N, 1, Hkv, 1)
    stored = (blocks / scale).to(dtype).float() * scale
    return stored.view(n * block_size, h, d)[:t].to(x.dtype)  # (T, Hkv, D)


class RoundedKV:
    """Dense attention over K/V rounded to 8 bits at the given granularity."""

    def __init__(self, num_tokens: int, granularity: str, dtype: torch.dtype | None, scales) -> None:
        self.dense = DenseAttention((num_tokens,))
        self.granularity, self.dtype, self.scales = granularity, dtype, scales

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.granularity == "tensor":
            sk, sv = self.scales.k[layer], self.scales.v[layer]
            k = dequantize(quantize(k, sk, self.dtype), sk, k.dtype)
            v = dequantize(quantize(v, sv, self.dtype), sv, v.dtype)
        elif self.granularity == "block":
            k, v = round_per_block(k, self.dtype), round_per_block(v, self.dtype)
        return self.dense(layer, q, k, v)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--start", type=int, default=0, help="first token of the held-out play to score")
    ap.add_argument("--tokens", type=int, default=8000, help="tokens to score")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model, tok = load_model(path, torch.bfloat16), load_tokenizer(path)
    ids = tok(held_out_text())["input_ids"][args.start:args.start + args.tokens]
    base = perplexity(model, ids, attention=lambda n: RoundedKV(n, "none", None, None))
    print(f"{args.model}, held-out tokens {args.start}..{args.start + len(ids)}, bf16 model, window 1024 stride 512")
    print(f"{'kv dtype':<10}{'scales':<8}{'perplexity':>12}{'increase':>10}")
    print(f"{'bfloat16':<10}{'-':<8}{base:>12.4f}{'':>10}")
    for name, dtype in KV_CACHE_DTYPES.items():
        scales = scales_for(model, dtype, tok)
        for granularity in ("tensor", "block"):
            ppl = perplexity(model, ids, attention=lambda n: RoundedKV(n, granularity, dtype, scales))
            print(f"{name:<10}{granularity:<8}{ppl:>12.4f}{ppl / base - 1:>10.2%}", flush=True)


if __name__ == "__main__":
    main()
