"""Loss curve PNG from a run's metrics.jsonl: python -m ulysses_jax.plot WORKDIR [--out PNG]."""
from __future__ import annotations

import argparse
import json
import os


def plot_metrics(workdir: str, out: str | None = None) -> str:
    """Plots training (and held-out) loss against step; returns the PNG path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if not train:
        raise ValueError(f"{workdir}/metrics.jsonl has no logged loss yet")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train loss")
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.abspath(workdir)))
    ax.grid(alpha=0.3)
    ax.legend()
    out = out or os.path.join(workdir, "loss.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("workdir")
    p.add_argument("--out", help="PNG path (default WORKDIR/loss.png)")
    args = p.parse_args(argv)
    print(plot_metrics(args.workdir, args.out))


if __name__ == "__main__":
    main()
