"""`attnserve` command line: convert (and, as they land, generate / serve / loadtest)."""
from __future__ import annotations

import argparse
import sys


def _convert(args: argparse.Namespace) -> int:
    from models.kv_heads import convert
    from models.loader import parse_dtype
    from models.registry import resolve_model

    dtype = parse_dtype(args.dtype) if args.dtype else None
    out = convert(resolve_model(args.model), args.kv_heads, args.out, dtype=dtype)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description="Paged-KV, continuous-batching LLM server.")
    sub = parser.add_subparsers(dest="command", required=True)

    convert = sub.add_parser("convert", help="change a checkpoint's number of K/V heads (MHA <-> GQA <-> MQA)")
    convert.add_argument("--model", required=True, help="checkpoint directory, .gguf file or model name")
    convert.add_argument("--kv-heads", type=int, required=True, help="target K/V heads (num_heads = MHA, 1 = MQA)")
    convert.add_argument("--out", required=True, help="output directory (HF layout, safetensors)")
    convert.add_argument("--dtype", choices=["float32", "bfloat16"], help="weight dtype to write (default: as read)")
    convert.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"attnserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
