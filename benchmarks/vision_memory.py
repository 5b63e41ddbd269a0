"""Memory of the Qwen2.5-VL vision tower split by frames over the devices against replicated
on every device, from compiled memory analysis (nothing allocated).

    python benchmarks/vision_memory.py [--patches 16384,65536] [--ps 4,8]
        [--set KEY=VALUE ...] [--target h100] [--out-dir benchmarks/results]

The train step (forward, backward, AdamW) of a model with Qwen2.5-VL-7B's vision tower
(32 blocks of width 1280, 16 heads, MLP 3420, windows of 112 pixels, full attention at
blocks 7, 15, 23, 31) and, to isolate the tower, a one-layer decoder of width 3584 with a
small vocabulary; parameters and optimizer state split over the devices (ZeRO-3, so the
tower's 0.67B weights do not hide the difference); bf16 compute (compiled with float16 as the stand-in, as --dry-run does on
a CPU), remat full, batch 1, seq_len 8192 x P. ``--patches`` is the batch's patch budget N:
split (``model.vision.split=true``) gives each of the P devices N / P + one frame's slots
(data.vision_patches), replicated gives every device all N. The peak per device is XLA's
(``train.py --dry-run``'s compile on fake CPU devices; with ``--target h100``, h200 or a100,
XLA's GPU compiler for P GPUs of that kind, no GPU needed: jax's CUDA plugin, jax >= 0.11).
Written to benchmarks/results/vision_memory.json (vision_memory_<target>.json with a target)
with the command and the date.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

from _common import (ROOT, add_target, command_line, compiled_on, ints,  # noqa: E402
                     require_target, target_name, write_results)  # (first: sets up)

GIB = 2 ** 30
FRAME = 1024  # slots one frame needs beyond N / P when split (a 448 x 448 image)
MODEL = ["model.d_model=3584", "model.n_layers=1", "model.n_heads=28", "model.n_kv_heads=4",
         "model.head_dim=128", "model.ffn_dim=1024", "model.vocab_size=4096",
         "model.mrope_section=[16,24,24]", "model.vision.depth=32",
         "model.vision.hidden_size=1280", "model.vision.num_heads=16",
         "model.vision.intermediate_size=3420", "model.vision.window_size=112",
         "model.vision.fullatt_block_indexes=[7,15,23,31]", "model.dtype=bfloat16",
         "model.remat=full", "model.loss_chunk=1024", "batch_size=1", "mesh.data=1",
         "eval_batches=0", "param_sharding=zero3"]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patches", default="16384,65536", help="patch budgets N per batch")
    ap.add_argument("--ps", default="4,8", help="devices P (mesh.seq)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override (repeatable)")
    add_target(ap)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    require_target(args.target)
    import jax
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run

    preset = str(ROOT / "configs" / "tiny-qwen2.5-vl.yaml")
    rows, t_all = [], time.time()
    print(f"{'N':>7} {'P':>2}  {'replicated GiB':>14}  {'split GiB':>9}  {'split/repl':>10}  "
          f"{'temp repl/split GiB':>19}", flush=True)
    for n in ints(args.patches):
        for p in ints(args.ps):
            row = {"patches": n, "p": p}
            for split, slots in ((False, n), (True, n // p + FRAME)):
                cfg = load_config(preset, MODEL + args.set + [
                    f"seq_len={8192 * p}", f"mesh.seq={p}", f"model.vision.split={split}",
                    f"data.vision_patches={slots}"])
                r = dry_run(cfg, target=args.target)
                row["split" if split else "replicated"] = {
                    k: r[k] for k in ("peak_bytes_per_device", "temp_bytes", "argument_bytes",
                                      "params", "compile_seconds", "compiler")
                } | {"slots_per_device": slots}
            row["ratio"] = round(row["split"]["peak_bytes_per_device"]
                                 / row["replicated"]["peak_bytes_per_device"], 4)
            rows.append(row)
            print(f"{n:>7} {p:>2}  {row['replicated']['peak_bytes_per_device'] / GIB:>14.3f}  "
                  f"{row['split']['peak_bytes_per_device'] / GIB:>9.3f}  {row['ratio']:>10.3f}  "
                  f"{row['replicated']['temp_bytes'] / GIB:>9.3f}/"
                  f"{row['split']['temp_bytes'] / GIB:.3f}", flush=True)
    out = {"command": command_line(__file__, argv), "overrides": MODEL + args.set,
           "rows": rows, "jax": jax.__version__, "python": platform.python_version(),
           "machine": compiled_on(args.target),
           "wall_seconds": round(time.time() - t_all, 1),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    write_results(args.out_dir, target_name("vision_memory.json", args.target), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
