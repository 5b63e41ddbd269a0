"""Writes examples/retrieval.jsonl: the verifiable task of configs/tiny-grpo.yaml.

    python examples/make_retrieval.py [--out examples/retrieval.jsonl] [--rows 1024]

Each prompt is a filler of random words with one sentence "the key is N." somewhere inside
(N a digit), ending in "key:". The row's ``answer`` is N: the built-in
reward ``answer_match`` gives 1.0 to a completion whose last number is N. Finding the key in
the filler and writing it out is a retrieval skill, and the reward says only whether the
answer was right.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

WORDS = ("red", "sea", "old", "map", "sun", "cat", "far", "low", "ink", "dry", "owl", "bag",
         "tin", "fog", "elm", "cup", "jam", "oak", "ray", "wax")


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 9)))]
        key = int(rng.integers(0, 10))
        words.insert(int(rng.integers(0, len(words) + 1)), f"the key is {key}.")
        out.append({"prompt": " ".join(words) + "\nkey:", "answer": str(key)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="examples/retrieval.jsonl")
    parser.add_argument("--rows", type=int, default=1024)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows(args.rows):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.rows} prompts to {args.out}")


if __name__ == "__main__":
    main()
