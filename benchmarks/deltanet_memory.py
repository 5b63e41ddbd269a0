"""Memory of a Gated DeltaNet layer against a full-attention layer, from compiled memory
analysis (nothing allocated): the whole train step of a one-layer Qwen3-Next model whose
layer is one or the other, at the same sequence length S and Ulysses degree P.

    python benchmarks/deltanet_memory.py [--seq-lens 8192,16384,32768] [--ps 1,4]
        [--set KEY=VALUE ...] [--target h100] [--out-dir benchmarks/results]

The layer has Qwen3-Next-80B-A3B's shapes (d_model 2048; attention 16 query / 2 kv heads of
256, partial RoPE 0.25; DeltaNet 16 key / 32 value heads of 128, convolution width 4), bf16
compute (compiled with float16 as the stand-in, as --dry-run does on a CPU), remat full,
batch 1, and, to isolate the token mixer, a small dense MLP (ffn 512) and vocabulary (4096)
shared by both. Each step is ``train.py --dry-run``'s compile (forward, backward, AdamW) on
fake CPU devices (with ``--target h100``, h200 or a100: XLA's GPU compiler for P GPUs of that
kind, no GPU needed: jax's CUDA plugin, jax >= 0.11); the peak per device is XLA's.
Results: the peak of each, the DeltaNet / attention ratio per (S, P), the compiled
all-to-alls, and how far the DeltaNet peaks are from a straight line in S (memory linear
in S). Written to
benchmarks/results/deltanet_memory.json (deltanet_memory_<target>.json with a target) with
the command and the date.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

from _common import (ROOT, add_target, command_line, compiled_on, ints,  # noqa: E402
                     require_target, target_name, write_results)  # (first: sets up)

GIB = 2 ** 30
LAYER = ["model.family=qwen3_next", "model.n_layers=1", "model.d_model=2048",
         "model.n_heads=16", "model.n_kv_heads=2", "model.head_dim=256",
         "model.partial_rotary_factor=0.25", "model.linear_key_heads=16",
         "model.linear_value_heads=32", "model.linear_key_dim=128",
         "model.linear_value_dim=128", "model.linear_conv=4", "model.ffn_dim=512",
         "model.num_experts=0", "model.vocab_size=4096", "model.tie_embeddings=false",
         "model.dtype=bfloat16", "model.remat=full", "model.loss_chunk=1024",
         "batch_size=1", "mesh.data=1", "eval_batches=0"]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="8192,16384,32768")
    ap.add_argument("--ps", default="1,4", help="Ulysses degrees P (mesh.seq)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override (repeatable)")
    add_target(ap)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return ap.parse_args(argv)


def _line_deviation(xs: list[int], ys: list[int]) -> float:
    """Largest |y - fit| / y of the least-squares line through (xs, ys); 0 for < 3 points."""
    if len(xs) < 3:
        return 0.0
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(abs(y - (my + slope * (x - mx))) / y for x, y in zip(xs, ys))


def main(argv=None) -> int:
    args = _args(argv)
    require_target(args.target)
    import jax
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run

    preset = str(ROOT / "configs" / "tiny-qwen3-next.yaml")
    rows, t_all = [], time.time()
    print(f"{'S':>7} {'P':>2}  {'attention GiB':>13}  {'DeltaNet GiB':>12}  {'ratio':>5}  "
          f"{'all-to-alls A/D':>15}", flush=True)
    for s in ints(args.seq_lens):
        for p in ints(args.ps):
            row = {"seq_len": s, "p": p}
            for mixer, name in (("A", "attention"), ("D", "deltanet")):
                cfg = load_config(preset, LAYER + args.set + [
                    f"model.mixer_pattern={mixer}", f"seq_len={s}", f"mesh.seq={p}"])
                r = dry_run(cfg, target=args.target)
                row[name] = {k: r[k] for k in ("peak_bytes_per_device", "temp_bytes",
                                               "argument_bytes", "params",
                                               "compile_seconds", "compiler")}
                row[name]["all_to_all"] = r["collectives"].get("all-to-all", 0)
            row["ratio"] = round(row["deltanet"]["peak_bytes_per_device"]
                                 / row["attention"]["peak_bytes_per_device"], 4)
            rows.append(row)
            print(f"{s:>7} {p:>2}  {row['attention']['peak_bytes_per_device'] / GIB:>13.3f}  "
                  f"{row['deltanet']['peak_bytes_per_device'] / GIB:>12.3f}  "
                  f"{row['ratio']:>5.3f}  "
                  f"{row['attention']['all_to_all']:>7}/{row['deltanet']['all_to_all']}",
                  flush=True)
    linear = {}
    for p in ints(args.ps):
        pts = [(r["seq_len"], r["deltanet"]["peak_bytes_per_device"]) for r in rows
               if r["p"] == p]
        linear[str(p)] = round(_line_deviation(*zip(*pts)), 5) if len(pts) > 2 else None
        print(f"P={p}: DeltaNet peaks within {100 * (linear[str(p)] or 0):.2f}% of a line in S")
    out = {"command": command_line(__file__, argv), "layer_overrides": LAYER + args.set,
           "rows": rows, "max_ratio": max(r["ratio"] for r in rows),
           "deltanet_line_deviation_by_p": linear,
           "jax": jax.__version__, "python": platform.python_version(),
           "machine": compiled_on(args.target),
           "wall_seconds": round(time.time() - t_all, 1),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    write_results(args.out_dir, target_name("deltanet_memory.json", args.target), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
