"""AdamW moments stored in bf16 vs fp32: the same training run, its loss curves side by side.

    python benchmarks/moment_dtype.py [--config configs/tiny.yaml] [--steps 300]
        [--set KEY=VALUE ...]

Two ``train.py`` runs in subprocesses, identical but for ``optimizer.moment_dtype`` (float32,
bfloat16): same seed, data, model and schedule. Each run's metrics.jsonl gives the training
loss every ``log_every`` steps and the held-out loss every ``eval_every``; the table prints
both curves and their differences. bf16 moments halve the optimizer state (8 -> 4 bytes per
parameter); the update is still computed in fp32 (optimizer.py rounds only what is stored).
Results: benchmarks/results/moment_dtype.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, command_line


def train(config: str, steps: int, moment_dtype: str, sets: list[str], workdir: Path) -> list:
    cmd = [sys.executable, "train.py", "--config", config, "--workdir", str(workdir),
           "--no-progress", f"steps={steps}", f"optimizer.moment_dtype={moment_dtype}", *sets]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r or "eval_loss" in r]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for both runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/moment_dtype.json"))
    args = ap.parse_args(argv)

    curves, walls = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            t0 = time.time()
            curves[dtype] = train(args.config, args.steps, dtype, args.set, Path(tmp) / dtype)
            walls[dtype] = round(time.time() - t0, 1)

    def by_step(rows, key):
        return {r["step"]: r[key] for r in rows if r.get(key) is not None}

    rows = []
    for key in ("loss", "eval_loss"):
        a, b = by_step(curves["float32"], key), by_step(curves["bfloat16"], key)
        for step in sorted(set(a) & set(b)):
            rows.append({"step": step, "metric": key, "float32": a[step], "bfloat16": b[step],
                         "diff": b[step] - a[step]})
    print(f"{'metric':>9} {'step':>5} {'fp32 moments':>13} {'bf16 moments':>13} {'bf16-fp32':>10}")
    for r in rows:
        print(f"{r['metric']:>9} {r['step']:>5} {r['float32']:13.4f} {r['bfloat16']:13.4f} "
              f"{r['diff']:+10.4f}")
    train_rows = [r for r in rows if r["metric"] == "loss"]
    worst = max(train_rows, key=lambda r: abs(r["diff"]))
    print(f"largest training-loss difference: {worst['diff']:+.4f} at step {worst['step']} "
          f"({abs(worst['diff']) / worst['float32']:.2%} of the fp32 run's loss there); "
          f"wall time {walls['float32']} s (fp32), {walls['bfloat16']} s (bf16)")
    result = {"command": command_line(__file__, argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": args.config, "steps": args.steps, "sets": args.set,
              "wall_s": walls, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
