"""The default path (causal, no window, even heads) before and after a change: same program?

    python benchmarks/default_path.py --base DIR [--rounds 3] [--seq-len 8192]

``DIR`` is a copy of the code before the change (e.g. ``git archive <commit> | tar -x -C DIR``);
this tree is "after". For each tree, in a subprocess of its own (``--worker``):
  - ``train.py --dry-run`` of configs/tiny.yaml (and at seq_len 4096): XLA's peak and temp
    bytes per device of the compiled train step, and a fingerprint (sha256) of the compiled
    HLO text with its metadata (source lines, op names) removed: equal fingerprints mean the
    same program;
  - the chunked kernel alone, forward + backward, causal, B=1, 8 query / 2 kv heads of 64,
    fp32, block 512: its HLO fingerprint, and median seconds over ``--repeats`` calls after a warm-up.
Timing rounds alternate the trees (base, after, after, base, ...) and the table reports the
median over rounds. Results: benchmarks/results/default_path.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRY_RUNS = {"tiny": [], "tiny_4k": ["seq_len=4096"], "tiny_ring": ["mesh.seq=4", "mesh.ring=2"]}


def _fingerprint(hlo: str) -> str:
    """sha256 of the program: the stack-frame tables (file names, lines) and every
    instruction's metadata are dropped, since they change whenever the source moves."""
    lines = [line for line in hlo.splitlines() if not re.match(
        r"^(FileNames|FunctionNames|FileLocations|StackFrames)$|^\d+ ", line)]
    text = re.sub(r", metadata=\{[^}]*\}", "", "\n".join(lines))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker(tree: str, seq_len: int, repeats: int, timing_only: bool) -> dict:
    sys.path.insert(0, tree)
    from ulysses_jax.mesh import request_cpu_devices
    request_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    from ulysses_jax.attention.chunked import chunked_attention
    from ulysses_jax.config import load_config
    try:
        from ulysses_jax.training.dry_run import compile_step, peak_bytes_per_device
    except ImportError:  # a tree from before dry_run.py moved out of trainer.py
        from ulysses_jax.training.trainer import compile_step, peak_bytes_per_device

    out = {"tree": tree}
    if not timing_only:
        for name, over in DRY_RUNS.items():
            cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), over)
            compiled, _ = compile_step(cfg)
            mem = compiled.memory_analysis()
            out[name] = {"peak_bytes_per_device": peak_bytes_per_device(compiled),
                         "temp_bytes": int(mem.temp_size_in_bytes),
                         "hlo_fingerprint": _fingerprint(compiled.as_text())}
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, seq_len, 8, 64))
    k = jax.random.normal(ks[1], (1, seq_len, 2, 64))
    v = jax.random.normal(ks[2], (1, seq_len, 2, 64))
    ct = jax.random.normal(ks[3], q.shape)

    def loss(q, k, v):
        return jnp.sum(chunked_attention(q, k, v, causal=True) * ct)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    if not timing_only:
        out["chunked_hlo_fingerprint"] = _fingerprint(fn.lower(q, k, v).compile().as_text())
    jax.block_until_ready(fn(q, k, v))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v))
        times.append(time.perf_counter() - t0)
    out["chunked_seconds"] = statistics.median(times)
    return out


def _run_worker(tree: str, args, timing_only: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", tree, "--seq-len", str(args.seq_len),
           "--repeats", str(args.repeats)] + (["--timing-only"] if timing_only else [])
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if run.returncode:
        raise RuntimeError(f"worker for {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="directory holding the code before the change")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "default_path.json"))
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq_len, args.repeats, args.timing_only)))
        return 0
    if not args.base:
        ap.error("--base DIR is required")
    trees = {"before": os.path.abspath(args.base), "after": str(ROOT)}
    t0 = time.time()
    results = {name: _run_worker(tree, args, timing_only=False) for name, tree in trees.items()}
    times = {name: [r["chunked_seconds"]] for name, r in results.items()}
    order = ["after", "before"]
    for r in range(1, args.rounds):
        for name in (order if r % 2 else order[::-1]):
            times[name].append(_run_worker(trees[name], args, timing_only=True)["chunked_seconds"])
    print(f"default path, before ({trees['before']}) and after ({trees['after']})")
    print(f"{'':<28} {'before':>16} {'after':>16}")
    for name in DRY_RUNS:
        for key in ("peak_bytes_per_device", "temp_bytes", "hlo_fingerprint"):
            b, a = results["before"][name][key], results["after"][name][key]
            print(f"{name + ' ' + key:<28} {b!s:>16} {a!s:>16}")
    b, a = (results[n]["chunked_hlo_fingerprint"] for n in ("before", "after"))
    print(f"{'chunked hlo_fingerprint':<28} {b:>16} {a:>16}")
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{'chunked fwd+bwd s (median)':<28} {med['before']:>16.3f} {med['after']:>16.3f}")
    record = {"command": " ".join(["python", "benchmarks/default_path.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
              "seq_len": args.seq_len, "results": results, "chunked_seconds_rounds": times,
              "chunked_seconds_median": med, "wall_seconds": round(time.time() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
