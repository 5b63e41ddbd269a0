"""Writes examples/preferences.jsonl: 256 toy preference pairs for configs/tiny-dpo.yaml.

    python examples/make_preferences.py [--out examples/preferences.jsonl] [--pairs 256]

Each pair is a comment line of the running Python's standard library (the tiny preset's
corpus): the prompt is its first half, the chosen completion the true second half, the
rejected one the same words in reverse order. A model that knows English word order should
prefer the chosen one: the reward accuracy shows it learning that. The committed file was
written with Python 3.11.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_jax.data.text import stdlib_documents  # noqa: E402


def pairs(n: int, seed: int = 0) -> list[dict]:
    lines = []
    for _, text in stdlib_documents():
        for line in text.splitlines():
            line = line.strip()
            words = line[1:].split() if line.startswith("# ") else []
            if 8 <= len(words) <= 16 and all(w.isascii() for w in words):
                lines.append(words)
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.choice(len(lines), n, replace=False):
        words = lines[i]
        half = len(words) // 2
        rest = words[half:]
        if rest == rest[::-1]:
            continue
        out.append({"prompt": " ".join(words[:half]), "chosen": " " + " ".join(rest),
                    "rejected": " " + " ".join(rest[::-1])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                  "preferences.jsonl"))
    ap.add_argument("--pairs", type=int, default=256)
    args = ap.parse_args(argv)
    records = pairs(args.pairs)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"wrote {args.out}: {len(records)} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
