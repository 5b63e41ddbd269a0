"""Per-device peak memory of a full training step against sequence length and Ulysses degree P.

    python benchmarks/memory_scaling.py [--presets tiny,llama-1b] [--ps 1,2,4,8]
        [--budget-gb tiny=0.25,llama-1b=24] [--set KEY=VALUE ...] [--target h100]
        [--out-dir benchmarks/results]

Every point is an abstract compile of the whole train step (forward, backward, AdamW update)
through ``trainer.dry_run``: XLA's memory analysis of the partitioned program, per device,
nothing allocated. mesh.data=1 and batch_size=1 throughout, so P is the only thing that splits
the work. On the 8 fake CPU devices this is the CPU compiler's buffer assignment; a GPU compile
of the same program assigns buffers differently (fusion, cuDNN attention), so the absolute
numbers are indicative and the ratios are the point. ``--target h100`` (h200, a100) compiles
the same points with XLA's GPU compiler for P GPUs of that kind instead (no GPU needed: jax's
CUDA plugin, jax >= 0.11); the peak is then device memory, host memory recorded beside it.

It prints a table per preset, fits peak = static + per_token * seq_len per P (what does not
scale with length vs what does), checks two targets and, for a budget, the longest measured
length that fits per P. Results: benchmarks/results/memory_scaling.{json,csv,png}
(memory_scaling_<target>.* with a target).
"""
from __future__ import annotations

import os


import argparse
import csv
import json
import platform
import sys
import time
from pathlib import Path

from _common import (ROOT, add_target, command_line, ints, require_target,  # noqa: E402
                     target_name)  # (first: repo path, fake devices)

GIB, MIB = 2 ** 30, 2 ** 20
# name -> (preset file, default lengths, overrides on top of the preset).
PRESETS = {
    "tiny": ("configs/tiny.yaml", (2048, 4096, 8192, 16384), ()),
    # The issue asks for remat=full; the preset file itself says save_dots.
    "llama-1b": ("configs/llama-1b-32k.yaml", (8192, 16384, 32768, 65536, 131072),
                 ("model.remat=full",)),
}
DEFAULT_BUDGETS = {"tiny": 0.25, "llama-1b": 24.0}
# Targets. P=8 vs P=1 is judged only where length-dependent memory (activations) is at least
# half of P=1's peak: the parameters and optimizer state of a replicated model cannot shrink
# with P, so the ratio says nothing about sequence parallelism where they dominate.
TARGET_P8_OVER_P1 = 0.25
ACTIVATIONS_DOMINATE = 0.5
TARGET_DOUBLING = 2.0
DOUBLING_SLACK = 1.25   # 2x + 25% = 2.5x: linear growth plus room for length-dependent buffers


def _budgets(text: str) -> dict[str, float]:
    """'24' (every preset) or 'tiny=0.25,llama-1b=24' -> {preset: GiB}."""
    if "=" not in text:
        return {name: float(text) for name in PRESETS}
    out = dict(DEFAULT_BUDGETS)
    for item in text.split(","):
        name, value = item.split("=", 1)
        if name not in PRESETS:
            raise ValueError(f"--budget-gb names unknown preset {name!r}; known: {list(PRESETS)}")
        out[name] = float(value)
    return out


def measure(preset: str, lengths, ps, extra_overrides=(), target=None) -> list[dict]:
    """dry_run of every (P, seq_len) of one preset.

    Returns:
      One record per point: preset, p, seq_len, n_layers, peak/argument/temp bytes, flops,
      compile seconds.
    """
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run

    path, _, preset_overrides = PRESETS[preset]
    records = []
    for p in ps:
        for s in lengths:
            cfg = load_config(str(ROOT / path), [*preset_overrides, *extra_overrides,
                                                 "batch_size=1", "mesh.data=1",
                                                 f"mesh.seq={p}", f"seq_len={s}"])
            r = dry_run(cfg, target=target)
            records.append({
                "preset": preset, "p": p, "seq_len": s, "n_layers": cfg.model.n_layers,
                "remat": cfg.model.remat, "dtype": cfg.model.dtype,
                "vocab_parallel": cfg.model.vocab_parallel,
                "param_sharding": cfg.param_sharding, "params": r["params"],
                "compiler": r["compiler"], "peak_bytes": r["peak_bytes_per_device"],
                "host_bytes": r["host_bytes_per_device"], "argument_bytes": r["argument_bytes"],
                "temp_bytes": r["temp_bytes"], "flops": r["flops_per_device"],
                "compile_seconds": r["compile_seconds"]})
            print(f"  {preset} P={p} seq_len={s}: {r['peak_bytes_per_device'] / GIB:.3f} GiB "
                  f"(state {r['argument_bytes'] / GIB:.3f}, temp {r['temp_bytes'] / GIB:.3f}; "
                  f"compile {r['compile_seconds']} s)", flush=True)
    return records


# ----------------------------------------------------------------------------- analysis

def linear_fit(xs, ys) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


def analyse(records: list[dict], budget_bytes: float) -> dict:
    """Ratios, fits, targets and the budget table of one preset's records."""
    peak = {(r["p"], r["seq_len"]): r["peak_bytes"] for r in records}
    ps = sorted({r["p"] for r in records})
    lengths = sorted({r["seq_len"] for r in records})
    fits = {}
    for p in ps:
        xs = [s for s in lengths if (p, s) in peak]
        static, per_token = linear_fit(xs, [peak[p, s] for s in xs])
        fits[p] = {"static_bytes": static, "bytes_per_token": per_token}

    out = {"fits": fits, "p8_over_p1": [], "doubling": [], "budget_gb": budget_bytes / GIB}
    if 1 in ps and 8 in ps:
        for s in lengths:
            if (1, s) in peak and (8, s) in peak:
                share = fits[1]["bytes_per_token"] * s / peak[1, s]
                out["p8_over_p1"].append({"seq_len": s, "ratio": peak[8, s] / peak[1, s],
                                          "p1_activation_share": share})
        judged = [x for x in out["p8_over_p1"] if x["p1_activation_share"] >= ACTIVATIONS_DOMINATE]
        out["target_p8"] = ("not evaluated: no measured length where activations are >= "
                            f"{ACTIVATIONS_DOMINATE:.0%} of P=1's peak" if not judged else
                            "met" if all(x["ratio"] <= TARGET_P8_OVER_P1 for x in judged)
                            else "NOT met")
        out["slope_p8_over_p1"] = fits[8]["bytes_per_token"] / fits[1]["bytes_per_token"]
    else:
        out["target_p8"] = "not evaluated: needs P=1 and P=8"
    for p in ps:
        for s in lengths:
            if (p, s) in peak and (p, 2 * s) in peak:
                out["doubling"].append({"p": p, "seq_len": s,
                                        "ratio": peak[p, 2 * s] / peak[p, s]})
    limit = TARGET_DOUBLING * DOUBLING_SLACK
    out["target_doubling"] = ("not evaluated: no doubled pair of lengths" if not out["doubling"]
                              else "met" if all(d["ratio"] <= limit for d in out["doubling"])
                              else "NOT met")
    out["longest_fitting"] = {
        p: max((s for s in lengths if (p, s) in peak and peak[p, s] <= budget_bytes), default=None)
        for p in ps}
    return out


# ----------------------------------------------------------------------------- output

def print_report(preset: str, records: list[dict], a: dict) -> None:
    ps = sorted({r["p"] for r in records})
    lengths = sorted({r["seq_len"] for r in records})
    peak = {(r["p"], r["seq_len"]): r["peak_bytes"] for r in records}
    big = max(peak.values()) >= GIB
    unit, scale = ("GiB", GIB) if big else ("MiB", MIB)
    r0 = records[0]
    print(f"\n== {preset}: {r0['params'] / 1e6:.1f}M params, n_layers={r0['n_layers']}, "
          f"{r0['dtype']}, remat={r0['remat']}, param_sharding={r0['param_sharding']}, "
          f"batch_size=1, mesh.data=1, compiler: {r0['compiler']}")
    print(f"peak bytes per device ({unit}), full train step")
    print(f"{'seq_len':>8}" + "".join(f"{'P=' + str(p):>11}" for p in ps))
    for s in lengths:
        print(f"{s:>8}" + "".join(f"{peak[p, s] / scale:>11.3f}" if (p, s) in peak else f"{'-':>11}"
                                  for p in ps))
    print(f"fit peak = static + per_token * seq_len ({unit}, KiB/token):")
    for p in ps:
        f = a["fits"][p]
        print(f"  P={p}: static {f['static_bytes'] / scale:9.3f}  per token "
              f"{f['bytes_per_token'] / 1024:9.2f}")
    if a["p8_over_p1"]:
        print(f"P=8 / P=1 at fixed length (target <= {TARGET_P8_OVER_P1} where activations are "
              f">= {ACTIVATIONS_DOMINATE:.0%} of P=1's peak):")
        for x in a["p8_over_p1"]:
            judged = x["p1_activation_share"] >= ACTIVATIONS_DOMINATE
            print(f"  seq_len {x['seq_len']:>7}: {x['ratio']:.3f}  (activations "
                  f"{x['p1_activation_share']:.0%} of P=1 peak{'' if judged else '; not judged'})")
        print(f"  per-token slope P=8 / P=1: {a['slope_p8_over_p1']:.3f} (ideal 1/8 = 0.125)")
    print(f"  target P=8 <= {TARGET_P8_OVER_P1} x P=1: {a['target_p8']}")
    print(f"doubling the length (target <= {TARGET_DOUBLING:g}x, +25% = "
          f"{TARGET_DOUBLING * DOUBLING_SLACK:g}x):")
    for p in ps:
        row = [d for d in a["doubling"] if d["p"] == p]
        print(f"  P={p}: " + ", ".join(f"{d['seq_len']}->{2 * d['seq_len']}: {d['ratio']:.2f}x"
                                       for d in row))
    print(f"  target: {a['target_doubling']}")
    print(f"longest measured seq_len within {a['budget_gb']:g} GiB per device:")
    for p in ps:
        print(f"  P={p}: {a['longest_fitting'][p] or 'none of the measured lengths'}")


def write_outputs(out_dir: Path, records, analysis, meta, target=None) -> str:
    """The three results files; their common path without the suffix."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = target_name("memory_scaling", target)
    with open(out_dir / f"{stem}.json", "w") as f:
        json.dump({"meta": meta, "records": records, "analysis": analysis}, f, indent=1,
                  default=str)
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)
    plot(out_dir / f"{stem}.png", records, analysis)
    return str(out_dir / stem)


def plot(path: Path, records, analysis) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    presets = list(dict.fromkeys(r["preset"] for r in records))
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.2), squeeze=False)
    for ax, preset in zip(axes[0], presets):
        rows = [r for r in records if r["preset"] == preset]
        for p in sorted({r["p"] for r in rows}):
            pts = sorted((r["seq_len"], r["peak_bytes"] / GIB) for r in rows if r["p"] == p)
            ax.plot(*zip(*pts), "o-", label=f"P={p}")
        ax.axhline(analysis[preset]["budget_gb"], color="gray", ls="--",
                   label=f"budget {analysis[preset]['budget_gb']:g} GiB")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(ScalarFormatter())  # 8, 16 rather than 2^3, 2^4
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(f"peak GiB per device ({rows[0]['compiler']}, XLA memory analysis)")
        ax.set_title(f"{preset}: full train step, batch 1, n_layers={rows[0]['n_layers']}")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated, of: "
                    + ", ".join(PRESETS))
    ap.add_argument("--ps", default="1,2,4,8", help="Ulysses degrees (mesh.seq)")
    for name, (_, lengths, _) in PRESETS.items():
        ap.add_argument(f"--{name}-seq-lens", default=",".join(map(str, lengths)))
    ap.add_argument("--llama-1b-layers", type=int, default=None,
                    help="override the 1B preset's n_layers (default: the preset's 16)")
    ap.add_argument("--budget-gb",
                    default=",".join(f"{k}={v:g}" for k, v in DEFAULT_BUDGETS.items()),
                    help="per-device budget in GiB: one number for every preset or "
                         "name=GiB,... (default %(default)s)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every point (repeatable), e.g. "
                         "--set model.vocab_parallel=false")
    add_target(ap)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    require_target(args.target)
    try:
        presets = [p for p in args.presets.split(",") if p]
        unknown = [p for p in presets if p not in PRESETS]
        if unknown:
            raise ValueError(f"unknown presets {unknown}; known: {list(PRESETS)}")
        budgets = _budgets(args.budget_gb)
        ps = ints(args.ps)
        lengths = {p: ints(getattr(args, f"{p.replace('-', '_')}_seq_lens")) for p in presets}
        short = [f"--{p}-seq-lens" for p in presets if len(lengths[p]) < 2]
        if short:
            raise ValueError(f"{', '.join(short)}: give at least two lengths (the script fits "
                             f"peak = static + per_token * seq_len)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax
    t0 = time.time()
    records, analysis = [], {}
    for preset in presets:
        extra = list(args.set)
        if preset == "llama-1b" and args.llama_1b_layers is not None:
            extra.append(f"model.n_layers={args.llama_1b_layers}")
            print(f"note: llama-1b n_layers reduced to {args.llama_1b_layers} (preset: 16) "
                  f"to save compile time")
        rows = measure(preset, lengths[preset], ps, extra, args.target)
        analysis[preset] = analyse(rows, budgets[preset] * GIB)
        records += rows
    for preset in presets:
        print_report(preset, [r for r in records if r["preset"] == preset], analysis[preset])
    meta = {"command": command_line(__file__, argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "devices": (f"P x {records[0]['compiler']} (XLA's GPU compiler, no GPU)"
                        if args.target else
                        f"{jax.device_count()} x {jax.devices()[0].platform}"),
            "seconds": round(time.time() - t0, 1)}
    stem = write_outputs(Path(args.out_dir), records, analysis, meta, args.target)
    print(f"\nwrote {stem}.{{json,csv,png}} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
