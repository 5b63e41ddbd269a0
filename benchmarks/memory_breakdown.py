"""Where the bytes of a compiled train step go, per device: by category, at two lengths.

    python benchmarks/memory_breakdown.py [--config configs/llama3-8b-4m.yaml]
        [--seq-lens 1048576,4194304] [--set KEY=VALUE ...]

Each length is one ``train.py --dry-run`` in its own process (so XLA dumps the compile and
``ulysses_jax/memory.py`` reads its buffer live ranges): the bytes live at the device's peak,
by category (parameters, optimizer state, layer checkpoints, attention, MLP, loss/vocabulary,
embedding, gradients, optimizer update, other), which of them the config's offload options
keep in host memory, and from the two lengths the bytes per local token (per token a device
holds, S/P) of each category. Nothing is allocated. bf16 models compile with float16 as a
stand-in on a CPU (training/dry_run.py says why).
Results: benchmarks/results/memory_breakdown.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _common import ROOT, command_line, ints

GIB, KIB = 2 ** 30, 2 ** 10


def dry_run(config: str, seq_len: int, sets: list[str]) -> dict:
    cmd = [sys.executable, "train.py", "--config", config, "--dry-run", f"seq_len={seq_len}",
           *sets]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama3-8b-4m.yaml")
    ap.add_argument("--seq-lens", default="1048576,4194304")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_breakdown.json"))
    args = ap.parse_args(argv)
    lens = ints(args.seq_lens)
    if len(lens) != 2:
        ap.error(f"--seq-lens needs two lengths (for the per-token slope), got {lens}")
    t0 = time.time()
    runs = {s: dry_run(args.config, s, args.set) for s in lens}
    first, second = (runs[s] for s in lens)
    p = first["mesh"]["seq"] * first["mesh"]["ring"]
    local = [s * first["batch_size"] // first["mesh"]["data"] // p for s in lens]
    cats = list(dict.fromkeys([*first.get("memory_by_category", {}),
                               *second.get("memory_by_category", {})]))
    print(f"{args.config} {' '.join(args.set)}; P={p}; compiled as {first['compiled_dtype']}; "
          f"memory model: {first['memory_model'][:100]}")
    print(f"{'category':<20}" + "".join(f"{f'S={s} GiB':>18}" for s in lens) +
          f"{'KiB per local token':>21}")
    slopes = {}
    for c in cats:
        a = first.get("memory_by_category", {}).get(c, 0.0)
        b = second.get("memory_by_category", {}).get(c, 0.0)
        slopes[c] = (b - a) * GIB / (local[1] - local[0]) / KIB
        print(f"{c:<20}{a:>18.2f}{b:>18.2f}{slopes[c]:>21.1f}")
    for key in ("peak_bytes_per_device", "host_bytes_per_device"):
        a, b = first[key] / GIB, second[key] / GIB
        print(f"{key:<20}{a:>18.2f}{b:>18.2f}"
              f"{(b - a) * GIB / (local[1] - local[0]) / KIB:>21.1f}")
    print(f"({time.time() - t0:.0f} s; categories are what is live at the device's peak)")
    with open(args.out, "w") as f:
        json.dump({"command": command_line(__file__, argv),
                   "date": time.strftime("%Y-%m-%d %H:%M %Z"), "runs": runs,
                   "local_tokens": local, "kib_per_local_token": slopes}, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
