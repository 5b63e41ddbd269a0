"""What padding heads costs: query heads that the seq axis size P does not divide.

    python benchmarks/uneven_heads.py [--seq-len 4096 --head-dim 64 --repeats 7 --warmup 1]

For each case (N query / K kv heads on P devices) and its even neighbour (the padded head
counts given as real heads), on a (data=1, seq=P) mesh of fake CPU devices, B=1, fp32, causal,
the chunked kernel:
  - the layout ``attention.heads.head_layout`` picks (padded query / kv heads, kv copies);
  - all-to-all result bytes per device of the compiled forward (read from the HLO) and the
    formula B·S·H·4·((N' + 2K'R)/P + N'/P);
  - forward + backward seconds: median and minimum over ``--repeats`` interleaved rounds
    (each round times every case once, in rotated order) after ``--warmup``; the fake
    devices share the host's cores, so compare rows, not absolute speed.
A padded case should move the bytes and take the time of its even neighbour: the padding
costs N'/N in attention compute and the exchange's extra heads, and nothing else.
Results: benchmarks/results/uneven_heads.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from _common import ROOT, command_line  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ulysses_jax import make_mesh, ulysses_attention  # noqa: E402
from ulysses_jax.head_layout import head_layout  # noqa: E402
from ulysses_jax.hlo import collective_bytes, collective_counts  # noqa: E402

CASES = [((3, 3), (4, 4), 2), ((7, 7), (8, 8), 4), ((12, 4), (16, 4), 8), ((7, 1), (8, 1), 4)]


def build(n, k, p, args) -> tuple[dict, callable, tuple]:
    """The case's layout and HLO bytes, and its jitted fwd+bwd with inputs (warmed up)."""
    mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
    s, h = args.seq_len, args.head_dim
    ks = jax.random.split(jax.random.key(n * 100 + k), 4)
    q, ct = (jax.random.normal(x, (1, s, n, h)) for x in (ks[0], ks[3]))
    kk, v = (jax.random.normal(x, (1, s, k, h)) for x in (ks[1], ks[2]))
    attn = lambda q, kk, v: ulysses_attention(q, kk, v, mesh=mesh, impl="chunked")
    text = jax.jit(attn).lower(q, kk, v).compile().as_text()
    lay = head_layout(n, k, p)
    formula = 4 * h * (s * (lay.n_pad + 2 * lay.kv_sent) // p + s // p * lay.n_pad)
    fn = jax.jit(jax.value_and_grad(lambda q, kk, v: jnp.sum(attn(q, kk, v) * ct),
                                    argnums=(0, 1, 2)))
    for _ in range(args.warmup):
        jax.block_until_ready(fn(q, kk, v))
    row = {"n": n, "k": k, "p": p, "n_pad": lay.n_pad, "k_pad": lay.k_pad, "reps": lay.reps,
           "all_to_all_count": collective_counts(text)["all-to-all"],
           "all_to_all_bytes": collective_bytes(text, "all-to-all"),
           "formula_bytes": formula, "describe": lay.describe()}
    return row, fn, (q, kk, v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "uneven_heads.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    cases = [build(n, k, p, args) for uneven, even, p in CASES for n, k in (uneven, even)]
    times = [[] for _ in cases]
    for r in range(args.repeats):  # interleaved: round r times every case once, rotated
        for i in [(j + r) % len(cases) for j in range(len(cases))]:
            _, fn, inputs = cases[i]
            t1 = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            times[i].append(time.perf_counter() - t1)
    print(f"S={args.seq_len}, head dim {args.head_dim}, fp32, causal, chunked kernel; "
          f"{args.repeats} interleaved rounds")
    print(f"{'heads':>8} {'P':>2} {'padded to':>10} {'a2a MiB':>8} {'formula':>8} "
          f"{'median s':>9} {'min s':>7}")
    rows = []
    for (r, _, _), t in zip(cases, times):
        r.update(seconds=statistics.median(t), min_seconds=min(t), all_seconds=t)
        rows.append(r)
        heads, padded = f"{r['n']}/{r['k']}", f"{r['n_pad']}/{r['k_pad']}x{r['reps']}"
        print(f"{heads:>8} {r['p']:>2} {padded:>10} {r['all_to_all_bytes'] / 2**20:8.2f} "
              f"{r['formula_bytes'] / 2**20:8.2f} {r['seconds']:9.3f} {r['min_seconds']:7.3f}")
    record = {"command": command_line(__file__, argv), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{jax.devices()[0].platform}", "jax": jax.__version__,
              "args": vars(args), "rows": rows, "wall_seconds": round(time.time() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
