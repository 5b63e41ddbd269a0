"""Packed rows through the chunked kernel: segment skipping against the causal skip alone.

    python benchmarks/packed_attention.py [--seq-len 16384 --docs 8 --heads 8 --kv-heads 2
        --head-dim 64 --block 512 --repeats 3 --warmup 1 --dtype float32]

One row of ``--docs`` documents with random boundaries (ids 1..docs, as the loader packs
them), causal, forward + backward of ``chunked_attention`` on one device, two variants of the
same kernel in one run:
  - "segments": tiles whose query and key blocks share no document are skipped (the kernel);
  - "causal only": only tiles above the diagonal are skipped (``skip_segments=False``, the
    kernel as it was before segment skipping).
Timing: interleaved rounds (round r times each variant once, alternating which goes first),
median over rounds after warm-up. Tiles: the forward and backward loops' own counters.
``ideal`` is sum(document length²) / S², the share of the causal work a perfect skip keeps.
Results: benchmarks/results/packed_attention.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from _common import ROOT, command_line  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ulysses_jax.attention import chunked  # noqa: E402


def packed_row(s: int, docs: int, seed: int) -> np.ndarray:
    """[1, S] int32 ids 1..docs with random boundaries."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, s), docs - 1, replace=False))
    return (1 + np.searchsorted(cuts, np.arange(s), side="right"))[None].astype(np.int32)


def fwd_bwd(plan, scale):
    def loss(q, k, v, seg, ct):
        out = chunked._attention(q, k, v, seg, plan, scale)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def tile_counts(q, k, v, seg, ct, plan, scale):
    padded = chunked._pad_inputs(q, k, v, seg, seg, plan)
    out, lse, fwd = jax.jit(lambda *a: chunked._forward(*a, plan, scale))(*padded)
    d_out = chunked._pad_to(ct, 1, out.shape[1])
    *_, bwd = jax.jit(lambda *a: chunked._backward(*a, plan, scale))(
        *padded, lse, chunked._delta(out, d_out), d_out)
    return int(fwd), int(bwd)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "packed_attention.json"))
    args = ap.parse_args(argv)
    if args.docs < 1 or args.docs > args.seq_len:
        ap.error(f"--docs must be between 1 and --seq-len {args.seq_len}, got {args.docs}")

    s, dtype = args.seq_len, jnp.dtype(args.dtype)
    seg_np = packed_row(s, args.docs, args.seed)
    lengths = np.bincount(seg_np[0])[1:]
    ks = jax.random.split(jax.random.key(args.seed), 4)
    dev = jax.devices()[0]
    q = jax.device_put(jax.random.normal(ks[0], (1, s, args.heads, args.head_dim), dtype), dev)
    k = jax.device_put(jax.random.normal(ks[1], (1, s, args.kv_heads, args.head_dim), dtype), dev)
    v = jax.device_put(jax.random.normal(ks[2], (1, s, args.kv_heads, args.head_dim), dtype), dev)
    ct = jax.device_put(jax.random.normal(ks[3], q.shape, dtype), dev)
    seg = jax.device_put(jnp.asarray(seg_np), dev)
    scale = args.head_dim ** -0.5
    variants = {
        "segments": chunked.block_plan(s, s, True, args.block, args.block),
        "causal only": chunked._Plan(s, s, min(args.block, s), min(args.block, s), True,
                                     skip_segments=False),
    }
    fns = {name: fwd_bwd(plan, scale) for name, plan in variants.items()}
    results = {name: {"tiles_fwd_bwd": tile_counts(q, k, v, seg, ct, plan, scale)}
               for name, plan in variants.items()}
    outs = {}
    for name, fn in fns.items():
        for _ in range(args.warmup):
            outs[name] = jax.block_until_ready(fn(q, k, v, seg, ct))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name](q, k, v, seg, ct))
            times[name].append(time.perf_counter() - t0)
    (va, ga), (vb, gb) = outs["segments"], outs["causal only"]
    max_grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ga, gb))
    for name in fns:
        results[name]["seconds"] = statistics.median(times[name])
        results[name]["all_seconds"] = times[name]
    speedup = results["causal only"]["seconds"] / results["segments"]["seconds"]
    ideal = float((lengths.astype(np.float64) ** 2).sum() / s ** 2)

    print(f"chunked attention fwd+bwd, causal, one row of {args.docs} documents, S={s}, "
          f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.dtype}, block "
          f"{args.block}, {jax.devices()[0].platform}; median of {args.repeats}")
    print(f"{'variant':<12} {'seconds':>9} {'tiles fwd':>10} {'tiles bwd':>10}")
    for name, r in results.items():
        print(f"{name:<12} {r['seconds']:>9.3f} {r['tiles_fwd_bwd'][0]:>10} "
              f"{r['tiles_fwd_bwd'][1]:>10}")
    kept = (results["segments"]["tiles_fwd_bwd"][0] /
            results["causal only"]["tiles_fwd_bwd"][0])
    print(f"speedup {speedup:.2f}x; tiles kept {kept:.3f} of causal; ideal sum(l²)/S² = "
          f"{ideal:.3f}; loss diff {abs(float(va - vb)):.2e}, max grad diff {max_grad_diff:.2e}")
    record = {"command": command_line(__file__, argv), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{jax.devices()[0].platform}", "jax": jax.__version__,
              "args": vars(args), "document_lengths": lengths.tolist(), "ideal_share": ideal,
              "results": results, "speedup": speedup, "max_grad_diff": max_grad_diff}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
