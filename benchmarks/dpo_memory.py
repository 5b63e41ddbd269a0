"""What DPO's train step costs in device memory against the SFT step at the same tokens.

    python benchmarks/dpo_memory.py [--cases lora_8b,full_1b,tiny] [--target h100]

Each case compiles three train steps from abstract shapes (``train.py --dry-run``'s
``dry_run``, nothing allocated) with the same rows per micro-batch: ``sft`` (objective sft,
batch_size 2B), ``dpo`` with the case's reference (B pairs: the same 2B sequences), and
``dpo`` with the other reference where the case allows it. The reference adds no parameter
memory either way (``base``: the LoRA base with the adapters zeroed; ``precompute``: a value
per row in the batch); what ``base`` adds is its forward pass's working memory. Per row:
XLA's peak, argument and temporary bytes per device and the bytes live at the peak by
category (``memory.py``). bf16 compiles as float16 on a CPU (training/dry_run.py says why).
``--target h100`` (h200, a100) compiles the same steps with XLA's GPU compiler for the case's
GPUs instead (no GPU needed: jax's CUDA plugin, jax >= 0.11; no category split there).
Results: benchmarks/results/dpo_memory.json (dpo_memory_<target>.json with a target).

Cases:
- ``lora_8b``: configs/llama3-8b-dpo-lora-64k.yaml (LoRA r16, bf16 base, 65,536 tokens per
  sequence, P=8, one pair per micro-batch); sft vs dpo base vs dpo precompute.
- ``full_1b``: configs/llama-1b-32k.yaml at P=4 with one pair (two 32k sequences) per step;
  sft vs dpo precompute (full fine-tuning has no adapters to turn off).
- ``tiny``: configs/tiny.yaml at 4096 tokens, P=8, 2 pairs; sft vs dpo precompute.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from _common import ROOT, add_target, command_line, require_target, target_name, write_results

GIB = 2 ** 30
CASES = {
    "lora_8b": ("configs/llama3-8b-dpo-lora-64k.yaml", [],
                ("base", "precompute")),
    "full_1b": ("configs/llama-1b-32k.yaml",
                ["mesh.seq=4", "mesh.data=1", "batch_size=1", "grad_accum_steps=1"],
                ("precompute",)),
    "tiny": ("configs/tiny.yaml", ["seq_len=4096", "batch_size=2"], ("precompute",)),
}
KEEP = ("peak_bytes_per_device", "host_bytes_per_device", "compiler", "argument_bytes",
        "temp_bytes", "memory_by_category",
        "params", "trainable_params", "compile_seconds")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    add_target(ap)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    require_target(args.target)
    # XLA dumps every CPU compile for the bytes by category (a GPU compile is not read so)
    dump = None if args.target else tempfile.mkdtemp(prefix="dpo_memory_")
    from ulysses_jax import memory  # (JAX imported, its backends not started yet)
    if dump:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {memory.dump_flags(dump)}"
    import jax
    jax.config.update("jax_enable_compilation_cache", False)  # a cached program dumps nothing
    from ulysses_jax.config import load_config
    from ulysses_jax.training.dry_run import dry_run

    result = {"command": command_line(__file__, argv),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": []}
    t0 = time.time()
    lines = []
    for case in [c for c in args.cases.split(",") if c]:
        preset, over, references = CASES[case]
        base = load_config(str(ROOT / preset), over)
        pairs = base.batch_size
        rows = [("sft", ["objective=sft", f"batch_size={2 * pairs}"])]
        rows += [(f"dpo {ref}", ["objective=dpo", f"dpo.reference={ref}"]) for ref in references]
        for name, extra in rows:
            cfg = load_config(str(ROOT / preset), over + extra)
            d = dry_run(cfg, target=args.target)
            run = {"case": case, "row": name, "overrides": over + extra,
                   **{k: d.get(k) for k in KEEP}}
            result["runs"].append(run)
            cats = d.get("memory_by_category") or {}
            lines.append(f"{case:8} {name:15} {d['peak_bytes_per_device'] / GIB:9.3f} "
                         f"{d['argument_bytes'] / GIB:9.3f} {d['temp_bytes'] / GIB:9.3f}  "
                         + ", ".join(f"{k} {v:.2f}" for k, v in cats.items() if v >= 0.01))
            print(lines[-1], flush=True)
    result["wall_seconds"] = round(time.time() - t0, 1)
    path = write_results(args.out, target_name("dpo_memory.json", args.target), result)
    print(f"\n{'case':8} {'row':15} {'peak GiB':>9} {'args GiB':>9} {'temp GiB':>9}  "
          f"live at the peak by category (GiB)")
    print("\n".join(lines))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
