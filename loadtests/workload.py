"""Prompt workloads from real English text: Shakespeare's plays (`models/corpus.py`), all but the
one `attnserve eval` holds out.

    python loadtests/workload.py --out loadtests/out/workload.jsonl --num 2000 --seed 0

Each JSONL record: {"id", "kind", "prompt", "num_words", "max_tokens"}; `kind` is `chat`
(lognormal lengths), `long` (uniform long prompts) or `shared_prefix` (one fixed system
passage plus a short question). Deterministic for a seed.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from models.corpus import corpus_words

DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "out" / "workload.jsonl"
QUESTIONS = ("Summarise this passage in one sentence.", "Who is speaking here, and to whom?",
             "What happens next?", "Explain the main image in plain English.", "List the characters mentioned.")


@dataclass(frozen=True)
class LengthSpec:
    """Prompt lengths in words: lognormal around `median`, clipped to [min_words, max_words]."""

    median: float = 120.0
    sigma: float = 0.9
    min_words: int = 8
    max_words: int = 1500
    long_min: int = 1000
    long_max: int = 3000
    shared_prefix_words: int = 200

    def __post_init__(self) -> None:
        if not (0 < self.min_words <= self.median <= self.max_words) or self.sigma <= 0:
            raise ValueError("need 0 < min_words <= median <= max_words and sigma > 0")
        if not 0 < self.long_min <= self.long_max:
            raise ValueError("need 0 < long_min <= long_max")

    def sample(self, rng: random.Random) -> int:
        n = int(round(math.exp(rng.gauss(math.log(self.median), self.sigma))))
        return min(self.max_words, max(self.min_words, n))


def build(num: int, seed: int = 0, spec: LengthSpec | None = None, mix: dict[str, float] | None = None,
          max_tokens: tuple[int, ...] = (32, 64, 128)) -> list[dict]:
    spec = spec or LengthSpec()
    mix = mix or {"chat": 0.8, "long": 0.1, "shared_prefix": 0.1}
    words = corpus_words()
    rng = random.Random(seed)
    system = " ".join(words[:spec.shared_prefix_words])
    kinds, weights = zip(*sorted(mix.items()))
    out = []
    for i in range(num):
        kind = rng.choices(kinds, weights)[0]
        if kind == "shared_prefix":
            prompt, n = f"{system}\n\n{rng.choice(QUESTIONS)}", spec.shared_prefix_words
        else:
            n = rng.randint(spec.long_min, spec.long_max) if kind == "long" else spec.sample(rng)
            start = rng.randrange(0, len(words) - n)
            prompt = " ".join(words[start:start + n])
        out.append({"id": i, "kind": kind, "prompt": prompt, "num_words": n, "max_tokens": rng.choice(max_tokens)})
    return out


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--num", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--median-words", type=float, default=120)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--max-words", type=int, default=1500)
    args = ap.parse_args(argv)
    spec = LengthSpec(median=args.median_words, sigma=args.sigma, max_words=args.max_words)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for record in build(args.num, args.seed, spec):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.num} prompts to {out} ({json.dumps(asdict(spec))})")
    return out


def ensure(path: Path = DEFAULT_WORKLOAD) -> Path:
    """The workload at `path`, built with the default settings if it is missing."""
    if not path.exists():
        main(["--out", str(path)])
    return path


if __name__ == "__main__":
    main()
