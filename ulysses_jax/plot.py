"""Loss curve PNG from a run's metrics.jsonl: python -m ulysses_jax.plot WORKDIR [--out PNG]."""
from __future__ import annotations

import argparse
import os
import sys

from .training.run_dir import METRICS, read_metrics


def plot_metrics(workdir: str, out: str | None = None) -> str:
    """Plots training (and held-out) loss against step; returns the PNG path.

    Raises:
      ValueError: no run in ``workdir``, a damaged metrics line (named by file:line), no
        logged loss yet, or ``out`` cannot be written; the message says which.
    """
    path = os.path.join(workdir, METRICS)
    if not os.path.isdir(workdir):
        raise ValueError(f"WORKDIR {workdir}: not a directory; pass the --workdir of a run")
    if not os.path.isfile(path):
        raise ValueError(f"WORKDIR {workdir}: has no {METRICS}; pass the --workdir of a run "
                         f"that has logged a step")
    records = read_metrics(path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if not train:
        raise ValueError(f"{path} has no logged loss yet")
    # matplotlib here, not at the top: it is slow to import; the Agg backend must be chosen
    # before pyplot is imported.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    try:
        fig.savefig(out, dpi=120)
    except (OSError, ValueError) as e:  # a missing directory, an unknown image format
        raise ValueError(f"--out {out}: cannot be written ({e})") from None
    finally:
        plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ulysses_jax.plot", description=__doc__)
    p.add_argument("workdir")
    p.add_argument("--out", help="PNG path (default WORKDIR/loss.png)")
    args = p.parse_args(argv)
    try:
        print(plot_metrics(args.workdir, args.out))
    except (OSError, ValueError) as e:  # OSError: e.g. metrics.jsonl not readable
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
