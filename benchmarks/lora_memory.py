"""What LoRA buys in device memory: the longest Llama-3-8B sequence that fits a per-device
budget with LoRA against full fine-tuning, on 1 device and on 8.

    python benchmarks/lora_memory.py [--memory-gb 80] [--rows full_offload,full,lora]
        [--p 1,8] [--search-preset] [--target h100]

Rows (each with the preset's other memory options kept: remat full, model.offload_checkpoints,
model.mlp_chunk=2048, model.loss_chunk=2048, ZeRO-3 at P=8):

- ``full_offload``: full fine-tuning, the preset as it is (optimizer.offload=true: fp32
  weights and AdamW moments in host memory). Its search is docs/PERF.md's ("LoRA") and is
  only repeated with ``--search-preset``; its dry-run at the common length always runs.
- ``full``: full fine-tuning with optimizer.offload=false (weights, moments, gradients on
  the device).
- ``lora``: LoRA rank 16, alpha 32, the default targets (every projection), frozen base
  stored in bf16 (model.lora.base_dtype=bfloat16), optimizer.offload=false.
- ``lora_mlp`` (not in the default ``--rows``): the same with adapters on the MLP only
  (``model.lora.targets=[gate,up,down]``).
- ``lora_offload`` (not in the default ``--rows``): ``lora`` with the preset's
  optimizer.offload=true (the frozen bf16 base in host memory, streamed layer by layer).

Per row and P: the planner's search (``ulysses_jax.plan.longest_fitting_seq_len``: doubling
from one unit, then bisection; one abstract compile per probe, every probe recorded), and one
``--dry-run`` at a common length (131,072 tokens at P=1, 1,048,576 at P=8) for the argument /
temporaries / peak split, the bytes live at the peak by category, and the trainable
parameters. Presets: configs/llama3-8b-1gpu.yaml (P=1), configs/llama3-8b-4m.yaml (P=8).
Nothing is allocated; bf16 compiles as float16 on a CPU (training/dry_run.py says why).
``--target h100`` (h200, a100) compiles every probe with XLA's GPU compiler for P GPUs of
that kind instead (no GPU needed: jax's CUDA plugin, jax >= 0.11; bf16 stays bf16).
Results: benchmarks/results/lora_memory.json (lora_memory_<target>.json with a target),
rewritten after every row; runs of other (row, P) pairs already in it are kept, so rows can
be added by later invocations.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time

from _common import (ROOT, add_target, command_line, ints, require_target, target_name,
                     write_results)

GIB = 2 ** 30
PRESETS = {1: ("configs/llama3-8b-1gpu.yaml", 65536, 2097152, 131072),
           8: ("configs/llama3-8b-4m.yaml", 262144, 8388608, 1048576)}  # granularity, max, common
ROWS = {
    "full_offload": ("full fine-tuning, preset (optimizer.offload=true)", []),
    "full": ("full fine-tuning, optimizer.offload=false", ["optimizer.offload=false"]),
    "lora": ("LoRA r16 a32 all targets, bf16 base, optimizer.offload=false",
             ["optimizer.offload=false", "model.lora.rank=16", "model.lora.alpha=32",
              "model.lora.base_dtype=bfloat16"]),
    "lora_mlp": ("LoRA r16 a32 on gate/up/down only, bf16 base, optimizer.offload=false",
                 ["optimizer.offload=false", "model.lora.rank=16", "model.lora.alpha=32",
                  "model.lora.base_dtype=bfloat16", "model.lora.targets=[gate,up,down]"]),
    "lora_offload": ("LoRA r16 a32 all targets, bf16 base, optimizer.offload=true",
                     ["model.lora.rank=16", "model.lora.alpha=32",
                      "model.lora.base_dtype=bfloat16"]),
}
KEEP = ("peak_bytes_per_device", "host_bytes_per_device", "argument_bytes", "temp_bytes",
        "memory_by_category", "params", "trainable_params", "compile_seconds", "memory_model",
        "compiler")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory-gb", type=float, default=80.0)
    ap.add_argument("--rows", default="full_offload,full,lora")
    ap.add_argument("--p", default="1,8")
    ap.add_argument("--search-preset", action="store_true",
                    help="also search the full_offload row (docs/PERF.md, \"LoRA\", has it)")
    add_target(ap)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    require_target(args.target)
    name = target_name("lora_memory.json", args.target)
    rows = [r for r in args.rows.split(",") if r]
    ps = ints(args.p)

    # XLA dumps every CPU compile so dry_run can split host from device memory (offload
    # options); XLA's GPU compiler reports host bytes itself.
    dump = None if args.target else tempfile.mkdtemp(prefix="lora_memory_")
    from ulysses_jax import memory  # (JAX imported, its backends not started yet)
    if dump:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {memory.dump_flags(dump)}"
    import jax
    jax.config.update("jax_enable_compilation_cache", False)  # a cached program dumps nothing
    from ulysses_jax.config import load_config
    from ulysses_jax.plan import longest_fitting_seq_len
    from ulysses_jax.training.dry_run import dry_run

    budget = int(args.memory_gb * GIB)
    path = os.path.join(args.out, name)
    earlier = []
    if os.path.exists(path):  # keep the other (row, P) pairs measured before
        with open(path) as f:
            old = json.load(f)
        if old.get("memory_gb") == args.memory_gb:
            # Each kept run says which invocation measured it (the file's top level says
            # the latest one).
            inv = {k: old[k] for k in ("command", "started", "wall_seconds") if k in old}
            earlier = [r if "invocation" in r else {"invocation": inv, **r}
                       for r in old.get("runs", []) if not (r["row"] in rows and r["p"] in ps)]
    result = {"command": command_line(__file__, argv), "memory_gb": args.memory_gb,
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "runs": list(earlier)}
    t_all = time.time()
    try:
        for p in ps:
            config, gran, max_len, common = PRESETS[p]
            for row in rows:
                label, sets = ROWS[row]
                cfg = load_config(str(ROOT / config), sets)
                run = {"row": row, "label": label, "p": p, "config": config, "overrides": sets,
                       "granularity": gran, "max_seq_len": max_len}
                t0 = time.time()
                d = dry_run(dataclasses.replace(cfg, seq_len=common), target=args.target)
                run["dry_run"] = {"seq_len": common, **{k: d.get(k) for k in KEEP}}
                print(f"P={p} {row}: dry-run at {common}: peak "
                      f"{d['peak_bytes_per_device'] / GIB:.2f} GiB, host "
                      f"{d['host_bytes_per_device'] / GIB:.2f} GiB, arguments "
                      f"{d['argument_bytes'] / GIB:.2f}, temps {d['temp_bytes'] / GIB:.2f}, "
                      f"params {d['params']:,}, trainable {d['trainable_params']:,} "
                      f"({time.time() - t0:.0f} s)", flush=True)
                if row != "full_offload" or args.search_preset:
                    probes = []

                    def measure(c):
                        r = dry_run(c, target=args.target)
                        probes.append({"seq_len": c.seq_len, **{k: r.get(k) for k in KEEP}})
                        return r["peak_bytes_per_device"], r["host_bytes_per_device"]

                    t0 = time.time()
                    best = longest_fitting_seq_len(
                        cfg, budget, granularity=gran, max_seq_len=max_len, measure=measure,
                        progress=lambda line: print(f"{row}{line}", flush=True))
                    over = [q for q in probes if q["peak_bytes_per_device"] > budget]
                    run["search"] = {
                        "longest_seq_len": best, "probes": probes,
                        "at_longest": next((q for q in probes if q["seq_len"] == best), None),
                        "first_over": min(over, key=lambda q: q["seq_len"]) if over else None,
                        "wall_seconds": round(time.time() - t0, 1)}
                    print(f"P={p} {row}: longest seq_len {best} ({len(probes)} compiles, "
                          f"{time.time() - t0:.0f} s)", flush=True)
                result["runs"].append(run)
                result["wall_seconds"] = round(time.time() - t_all, 1)
                write_results(args.out, name, result)
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)

    print(f"\n{'P':>2}  {'row':<13}{'longest':>10}{'device GiB':>11}{'host GiB':>9}"
          f"{'next over':>11}{'peak@common':>12}{'args':>7}{'temps':>7}{'trainable':>16}")
    for run in result["runs"]:
        s, d = run.get("search"), run["dry_run"]
        at = (s or {}).get("at_longest") or {}
        over = (s or {}).get("first_over") or {}
        print(f"{run['p']:>2}  {run['row']:<13}"
              f"{'-' if not s else s['longest_seq_len'] or 'none':>10}"
              f"{at.get('peak_bytes_per_device', 0) / GIB:>11.2f}"
              f"{at.get('host_bytes_per_device', 0) / GIB:>9.2f}"
              f"{over.get('seq_len', '-'):>11}"
              f"{d['peak_bytes_per_device'] / GIB:>12.2f}{d['argument_bytes'] / GIB:>7.2f}"
              f"{d['temp_bytes'] / GIB:>7.2f}{d['trainable_params']:>16,}")
    print(f"({result['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
