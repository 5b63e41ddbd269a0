"""DPO step time and step_tokens packed (``dpo.packing=true``, the default) against padded
(``false``): the same pairs, the same losses, fewer rows read.

    python benchmarks/dpo_packing.py [--steps 7] [--out benchmarks/results]

The store: 24 text pairs drawn with a seeded generator so that their documents (the prompt
once, then the chosen and the rejected completion, bytes as tokens) average about 281 tokens
and the longest is 494, as SmolLM2-135M-Instruct's conversational pairs of the issue do. The
run: ``seq_len=1536 batch_size=4 mesh.seq=3 model.lora.rank=8`` (LoRA, the base as the
reference) on 3 fake CPU devices, a tiny SmolLM2-shaped model (3 heads, 2 layers: the real
135M model takes minutes a step on 2 cores; the rows and tokens are the same). Each row of
the table is a run of ``--steps`` steps; step time is the median of the steps' own
``train_s`` after step 1 (compilation excluded), ``step_tokens`` the rows read x seq_len per
step, ``real`` the tokens of the step's sequences. Results:
benchmarks/results/dpo_packing.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time

import numpy as np

from _common import ROOT, command_line, compiled_on, write_results

RUN = ["objective=dpo", "seq_len=1536", "batch_size=4", "mesh.seq=3", "mesh.data=1",
       "model.lora.rank=8", "model.lora.alpha=16", "model.vocab_size=257",
       "model.d_model=96", "model.n_layers=2", "model.n_heads=3", "model.n_kv_heads=3",
       "model.head_dim=32", "model.ffn_dim=256", "model.loss_chunk=128",
       "data.heldout_fraction=0", "eval_batches=0", "checkpoint_every=0", "log_every=1",
       "log_tensorboard=false", "optimizer.warmup_steps=0"]
WORDS = ("the", "a", "model", "answer", "question", "long", "context", "sequence", "token",
         "device", "packing", "row", "segment", "pair", "reward", "policy")


def _text(rng, n: int) -> str:
    """About ``n`` bytes of words, cut to exactly ``n``."""
    out = ""
    while len(out) < n:
        out += " " + str(rng.choice(WORDS))
    return out[:n]


def write_pairs(path: str, seed: int = 0) -> list[int]:
    """24 text pairs (prompt, chosen, rejected bytes: 50-195, 10-130, 10-130; the last
    220, 136, 136: a 494-token document with the two EOS); their document lengths."""
    rng = np.random.default_rng(seed)
    sizes = [(int(rng.integers(50, 196)), int(rng.integers(10, 131)),
              int(rng.integers(10, 131))) for _ in range(23)] + [(220, 136, 136)]
    with open(path, "w") as f:
        for p, c, r in sizes:
            f.write(json.dumps({"prompt": _text(rng, p), "chosen": _text(rng, c),
                                "rejected": _text(rng, r)}) + "\n")
    return [p + c + r + 2 for p, c, r in sizes]


def real_tokens(cfg, steps: int) -> list[int]:
    """The tokens of each step's sequences, in the order the trainer reads them."""
    from ulysses_jax.config import rows_per_batch
    from ulysses_jax.data import run_data, text as data_lib
    rows, _ = run_data.load_data(cfg)
    it = data_lib.BatchIterator(rows, rows_per_batch(cfg), cfg.seed)
    return [int((next(it)["segment_ids"] > 0).sum()) for _ in range(steps)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    from ulysses_jax.config import load_config
    from ulysses_jax.data.prepare import prepare
    from ulysses_jax.training.trainer import train

    tmp = tempfile.mkdtemp(prefix="dpo_packing_")
    docs = write_pairs(f"{tmp}/pairs.jsonl")
    prepare([f"{tmp}/pairs.jsonl"], f"{tmp}/store", None, preference=True, progress=False)
    result = {"command": command_line(__file__, argv), "machine": compiled_on(None),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "pairs": len(docs), "document_tokens_mean": float(np.mean(docs)),
              "document_tokens_max": max(docs), "overrides": RUN, "runs": []}
    over = RUN + [f"data.source={tmp}/store", f"steps={args.steps}"]
    real = real_tokens(load_config(None, over), args.steps)
    for packing in (True, False):
        cfg = load_config(None, over + [f"dpo.packing={str(packing).lower()}"])
        workdir = f"{tmp}/{'packed' if packing else 'padded'}"
        train(cfg, workdir, progress=False)
        with open(f"{workdir}/metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        result["runs"].append({
            "packing": packing, "loss": [r["loss"] for r in records],
            "step_tokens": [r["step_tokens"] for r in records],
            "train_s": [r["train_s"] for r in records],
            "median_train_s": statistics.median(r["train_s"] for r in records[1:])})
    packed, padded = result["runs"]
    result["real_tokens"] = real
    result["rows_real_tokens_fill_at_least"] = [math.ceil(t / 1536) for t in real]
    lines = [f"{len(docs)} pairs, documents {np.mean(docs):.0f} tokens on average, longest "
             f"{max(docs)}; seq_len 1536, 4 pairs a step, mesh.seq 3",
             f"{'step':>4} {'real':>6} {'ceil(real/S)':>12} {'packed':>8} {'padded':>8} "
             f"{'packed/padded':>13}"]
    for i, t in enumerate(real):
        a, b = packed["step_tokens"][i], padded["step_tokens"][i]
        lines.append(f"{i + 1:>4} {t:>6} {math.ceil(t / 1536):>12} {a:>8} {b:>8} "
                     f"{a / b:>13.3f}")
    mean = lambda run: float(np.mean(run["step_tokens"]))  # noqa: E731
    lines.append(f"mean step_tokens packed {mean(packed):.0f}, padded {mean(padded):.0f} "
                 f"({mean(packed) / mean(padded):.3f}); median step time packed "
                 f"{packed['median_train_s']:.3f} s, padded {padded['median_train_s']:.3f} s "
                 f"({packed['median_train_s'] / padded['median_train_s']:.3f}); loss of the "
                 f"last step packed {packed['loss'][-1]:.6f}, padded {padded['loss'][-1]:.6f}")
    result["table"] = lines
    print("\n".join(lines))
    write_results(args.out, "dpo_packing.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
