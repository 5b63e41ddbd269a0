"""What the vocabulary split costs and saves: peak memory and executed collective bytes of a
full train step, ``model.vocab_parallel`` on and off, in the same code.

    python benchmarks/vocab_comm.py [--config configs/llama-1b-32k.yaml] [--ps 2,8]
        [--seq-lens 8192,32768] [--set KEY=VALUE ...] [--out-dir benchmarks/results]

Each point compiles the whole train step from abstract shapes (``trainer.compile_step``;
nothing allocated) with ``batch_size=1 mesh.data=1 mesh.seq=P model.remat=full`` on top of the
preset. Peak bytes per device are XLA's memory analysis (as ``--dry-run`` reports). Collective
bytes are read from the compiled HLO with loops counted as executed (``hybrid_comm``'s
``executed_collectives``: each op's result bytes times the known trip counts of the while
loops around it; the loss and embedding chunk loops are ``lax.map``s); they are result sizes
per device, so an all-gather counts what a device ends up holding, a reduce-scatter its slice.

The split adds collectives that grow with the sequence (hidden states gathered by the loss,
twice with its recomputation, the embedding's reduce-scatter and its transpose, token and
target ids) and removes the gathers of the whole table and head and the summing of their
gradients. The script prints both sides and the difference per collective; it does not
predict the replicated path's bytes, which depend on how XLA places the casts and gathers
(on the CPU compiler the ZeRO-3 gradient sums appear as all-reduce, not reduce-scatter).
XLA's CPU compiler also promotes bf16 collectives to f32 (converts around them, reductions
named ``*_promoted`` in the HLO), so the bf16 traffic of both paths is counted at 4 bytes per
element here; a GPU compile moves it in bf16.
Results: benchmarks/results/vocab_comm.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from _common import ROOT, command_line, ints  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402

from hybrid_comm import executed_collectives  # noqa: E402
from ulysses_jax.config import load_config  # noqa: E402
from ulysses_jax.hlo import COLLECTIVES  # noqa: E402
from ulysses_jax.training.dry_run import compile_step, peak_bytes_per_device  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20


def measure(config: str, p: int, s: int, split: bool, extra=()) -> dict:
    """Peak bytes and executed collective bytes of one compiled train step."""
    cfg = load_config(config, ["model.remat=full", "batch_size=1", "mesh.data=1",
                               f"mesh.seq={p}", f"seq_len={s}", *extra,
                               f"model.vocab_parallel={str(split).lower()}"])
    t0 = time.time()
    compiled, _ = compile_step(cfg)
    ex = executed_collectives(compiled.as_text())
    m = cfg.model
    return {"p": p, "seq_len": s, "vocab_parallel": split, "peak_bytes": peak_bytes_per_device(compiled),
            "collective_bytes": ex["bytes"], "collective_counts": ex["counts"],
            "d_model": m.d_model, "vocab_size": m.vocab_size, "dtype": m.dtype,
            "compile_seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/llama-1b-32k.yaml")
    ap.add_argument("--ps", default="2,8", help="sequence-parallel degrees (mesh.seq)")
    ap.add_argument("--seq-lens", default="8192,32768")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override (repeatable)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    config = str(ROOT / args.config) if not Path(args.config).is_absolute() else args.config
    t0 = time.time()
    rows = []
    for p in ints(args.ps):
        for s in ints(args.seq_lens):
            for split in (False, True):
                r = measure(config, p, s, split, args.set)
                rows.append(r)
                print(f"  P={p} seq_len={s} vocab_parallel={split}: peak "
                      f"{r['peak_bytes'] / GIB:.3f} GiB (compile {r['compile_seconds']} s)",
                      flush=True)

    ops = [op for op in COLLECTIVES if any(r["collective_bytes"][op] for r in rows)]
    print(f"\n{args.config}, remat full, batch 1; executed collective result bytes per device "
          f"per step (MiB)")
    print(f"{'P':>2} {'seq_len':>8} {'split':>5} {'peak GiB':>9} "
          + " ".join(f"{op:>18}" for op in ops) + f" {'total':>9}")
    for r in rows:
        b = r["collective_bytes"]
        print(f"{r['p']:>2} {r['seq_len']:>8} {'on' if r['vocab_parallel'] else 'off':>5} "
              f"{r['peak_bytes'] / GIB:>9.3f} "
              + " ".join(f"{b[op] / MIB:>18.1f}" for op in ops)
              + f" {sum(b.values()) / MIB:>9.1f}")
    print("\non - off per collective (MiB), and total:")
    for off, on in zip(rows[::2], rows[1::2]):
        diff = {op: (on["collective_bytes"][op] - off["collective_bytes"][op]) / MIB for op in ops}
        total = sum(diff.values())
        print(f"  P={on['p']} seq_len={on['seq_len']}: "
              + ", ".join(f"{op} {v:+.1f}" for op, v in diff.items())
              + f"; total {total:+.1f} ({total * MIB / sum(off['collective_bytes'].values()):+.1%})"
              f"; peak {on['peak_bytes'] / GIB:.3f} vs {off['peak_bytes'] / GIB:.3f} GiB")
    meta = {"command": command_line(__file__, argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
            "python": platform.python_version(),
            "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
            "seconds": round(time.time() - t0, 1)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab_comm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nwrote {out}/vocab_comm.json in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
