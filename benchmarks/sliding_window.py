"""Sliding-window attention against full causal attention: time, tiles, ring traffic, memory.

    python benchmarks/sliding_window.py [--seq-len 16384 --window 1024 --heads 8 --kv-heads 2
        --head-dim 64 --block 512 --repeats 1 --warmup 1 --ring 8]

Three measurements, one run each:
  1. kernel: forward + backward of the chunked kernel on one device, causal, B=1, fp32, with
     the window and without it (the same kernel); median seconds over ``--repeats`` timed
     calls after ``--warmup``; tiles (query block x key block) from the loops' own counters;
     XLA's temp bytes of the compiled fwd+bwd. ``ideal`` is the ratio of visible (query, key)
     pairs, (S²/2) / (W·S - W(W-1)/2).
  2. ring: hybrid attention over a ring of ``--ring`` devices (seq axis 1), the same shapes,
     compiled only: collective-permute bytes per device as executed (loop trip counts), forward
     and forward + backward, with and without the window, contiguous and zigzag layouts, and
     the ring steps each direction runs.
  3. model: XLA's temp bytes of the tiny model's loss + gradients (4 layers, seq=4 mesh,
     S=256, window 16) for layer patterns G, L and LG: the mixed pattern runs both attention
     kinds in one scan (lax.switch); its residuals share buffers with one kind's.
Results: benchmarks/results/sliding_window.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from _common import ROOT, command_line  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ulysses_jax import make_mesh  # noqa: E402
from ulysses_jax.attention import chunked  # noqa: E402
from ulysses_jax.attention.ring import hybrid_attention, ring_steps  # noqa: E402
from ulysses_jax.hlo import executed_collectives  # noqa: E402


def kernel(args) -> dict:
    s, w = args.seq_len, args.window
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, s, args.heads, args.head_dim))
    k = jax.random.normal(ks[1], (1, s, args.kv_heads, args.head_dim))
    v = jax.random.normal(ks[2], (1, s, args.kv_heads, args.head_dim))
    ct = jax.random.normal(ks[3], q.shape)
    scale = args.head_dim ** -0.5
    out = {}
    for name, window in (("window", w), ("causal", None)):
        plan = chunked.block_plan(s, s, True, args.block, args.block, window=window)
        loss = lambda q, k, v: jnp.sum(chunked._attention(q, k, v, None, plan, scale) * ct)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        temp = fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
        padded = chunked._pad_inputs(q, k, v, None, None, plan)
        o, lse, fwd_tiles = jax.jit(lambda *a: chunked._forward(*a, plan, scale))(*padded)
        *_, bwd_tiles = jax.jit(lambda *a: chunked._backward(*a, plan, scale))(
            *padded, lse, chunked._delta(o, ct), ct)
        for _ in range(args.warmup):
            jax.block_until_ready(fn(q, k, v))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": statistics.median(times), "all_seconds": times,
                     "tiles_fwd_bwd": [int(fwd_tiles), int(bwd_tiles)], "temp_bytes": int(temp)}
        print(f"  kernel {name:<7} {out[name]['seconds']:9.2f} s  tiles {int(fwd_tiles):5d} "
              f"fwd {int(bwd_tiles):5d} bwd  temp {temp / 2**20:8.1f} MiB", flush=True)
    out["ideal_work_ratio"] = (s * s / 2) / (w * s - w * (w - 1) / 2)
    return out


def ring(args) -> list[dict]:
    r, s, w = args.ring, args.seq_len, args.window
    mesh = make_mesh(seq=1, ring=r, data=1, devices=jax.devices()[:r])
    q = jax.ShapeDtypeStruct((1, s, args.heads, args.head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, s, args.kv_heads, args.head_dim), jnp.float32)
    rows = []
    for layout in ("contiguous", "zigzag"):
        nc = 2 if layout == "zigzag" else 1
        for window in (None, w):
            fn = lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, layout=layout,
                                                  window=window)
            fwd = jax.jit(fn).lower(q, kv, kv).compile().as_text()
            bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
                          ).lower(q, kv, kv).compile().as_text()
            sent = [executed_collectives(t)["bytes"]["collective-permute"] for t in (fwd, bwd)]
            row = {"layout": layout, "window": window,
                   "ring_steps": ring_steps(r, nc, s // (r * nc), True, window),
                   "permute_bytes_fwd": sent[0], "permute_bytes_fwd_bwd": sent[1]}
            rows.append(row)
            print(f"  ring {layout:<10} window {str(window):>5}: steps {row['ring_steps']}, "
                  f"permute MiB fwd {sent[0] / 2**20:7.2f}, fwd+bwd {sent[1] / 2**20:7.2f}",
                  flush=True)
    return rows


def model_memory() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_model import _batch, _setup  # the model tests' tiny config
    from ulysses_jax.training.objectives.sft import loss_fn
    out = {}
    for pattern in ("G", "L", "LG"):
        over = {"model.sliding_window": 16, "model.layer_pattern": pattern, "model.n_layers": 4,
                "seq_len": 256}
        _, mesh, g, st, _, _ = _setup(4, 1, **over)
        batch = _batch(0, s=256)
        grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(g, p, batch, mesh)[0]))
        out[pattern] = int(grad.lower(st["params"]).compile().memory_analysis()
                           .temp_size_in_bytes)
        print(f"  model layer_pattern {pattern:<3} temp {out[pattern] / 2**20:7.2f} MiB",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ring", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sliding_window.json"))
    args = ap.parse_args(argv)
    if not 1 <= args.window < args.seq_len:
        ap.error(f"--window must be in [1, --seq-len), got {args.window}")
    t0 = time.time()
    print(f"S={args.seq_len}, W={args.window}, {args.heads}/{args.kv_heads} heads of "
          f"{args.head_dim}, fp32, block {args.block}, causal, forward + backward")
    results = {"kernel": kernel(args)}
    kern = results["kernel"]
    print(f"  speedup {kern['causal']['seconds'] / kern['window']['seconds']:.2f}x, tiles "
          f"{kern['causal']['tiles_fwd_bwd'][0] / kern['window']['tiles_fwd_bwd'][0]:.2f}x "
          f"fewer, ideal (pairs) {kern['ideal_work_ratio']:.2f}x")
    results["ring"] = ring(args)
    results["model_temp_bytes"] = model_memory()
    record = {"command": command_line(__file__, argv), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{jax.devices()[0].platform}", "jax": jax.__version__,
              "args": vars(args), "results": results, "wall_seconds": round(time.time() - t0, 1)}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
