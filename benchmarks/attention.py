"""Ulysses attention: forward+backward time per P, and all-to-all bytes read from compiled HLO.

    python benchmarks/attention.py [--seq-len 4096 --heads 8 --kv-heads 8 --head-dim 64]
        [--ps 1,2,4,8] [--repeats 7 --warmup 2] [--gqa-kv-heads 2] [--no-deepspeed]

Timing. ``ulysses_attention`` on a (data=1, seq=P) mesh of fake CPU devices against the same
local kernel (``local_attention``, the kernel Ulysses itself runs after the exchange) on one
device, same global shapes and inputs. All variants are timed in interleaved rounds within one
run (round r times every variant once, in a rotated order), so a burst of load from elsewhere
hits them alike; the median over rounds is reported, after warm-up calls. The 8 fake devices
share this machine's cores, so P devices do not bring P times the compute: the ratio measures
the overhead of the exchange and of the sharded program, not a speedup.

Bytes. The forward of ``ulysses_attention`` is compiled for each P and the result sizes of its
all-to-all ops are summed from the HLO (``hlo.collective_bytes``), per device and per layer
(one call = one layer's attention), for an MHA case and a GQA case, against the formula

    all-to-all #1 (q, k, v packed):  B * S * (Hq + 2 * Hkv') * D / P   elements
    all-to-all #2 (attention output): B * S * Hq * D / P                 elements
    forward total:                    B * S * D * (2 * Hq + 2 * Hkv') / P
    Hkv' = Hkv if Hkv % P == 0 else P   (kv heads repeated P / Hkv times when P > Hkv)

With MHA (Hkv = Hq, d = Hq * D, B = 1) that is 4 * S * d / P. Times the dtype's bytes. The
backward runs the transposed exchanges, the same sizes again. HLO result bytes include the 1/P
slice a device keeps for itself, so link traffic is (P - 1) / P of them.

DeepSpeed. If ``ulysses_jax.compare`` provides ``DeepSpeedWorkers`` (DeepSpeed's own
``DistributedAttention``, torch SDPA inside, one gloo CPU process per rank), its forward+backward
time at the same shapes and inputs is added as a column; otherwise that column is skipped.
Results: benchmarks/results/attention.json.
"""
from __future__ import annotations

import os


import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _common import ROOT, command_line  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from ulysses_jax.hlo import collective_bytes, collective_counts  # noqa: E402
from ulysses_jax.attention.kernels import local_attention, resolve_impl  # noqa: E402
from ulysses_jax.mesh import act_spec, make_mesh  # noqa: E402
from ulysses_jax.attention import ulysses_attention  # noqa: E402
from ulysses_jax.attention.ulysses import kv_repeats  # noqa: E402


def effective_kv_heads(hq: int, hkv: int, p: int) -> int:
    """kv heads that travel in the exchange: Hkv, or P when each is repeated P / Hkv times."""
    return hkv * kv_repeats(hq, hkv, p)


def formula_elements(b: int, s: int, hq: int, hkv: int, d: int, p: int) -> int:
    """Forward all-to-all result elements per device per layer (see the module docstring)."""
    return b * s * d * (2 * hq + 2 * effective_kv_heads(hq, hkv, p)) // p


def _fwd_bwd(attn):
    def f(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(do))                                       # out, dq, dk, dv
    return jax.jit(f)


def make_inputs(b, s, hq, hkv, d, seed) -> dict[str, np.ndarray]:
    """Standard-normal q, do [B, S, Hq, D] and k, v [B, S, Hkv, D], float32."""
    rng = np.random.default_rng(seed)
    shapes = {"q": (b, s, hq, d), "k": (b, s, hkv, d), "v": (b, s, hkv, d), "do": (b, s, hq, d)}
    return {n: rng.standard_normal(sh, dtype=np.float32) for n, sh in shapes.items()}


def time_jax(inputs, ps, dtype, impl, warmup, repeats):
    """Median fwd+bwd seconds of the single-device kernel and of ulysses_attention per P.

    Returns:
      ({variant: [seconds per round]}, {variant: max |out - single-device out|}).
    """
    devs = jax.devices("cpu")
    names = ("q", "k", "v", "do")
    variants = {}
    single_args = [jax.device_put(jnp.asarray(inputs[n], dtype), devs[0]) for n in names]
    variants["single"] = (_fwd_bwd(lambda q, k, v: local_attention(q, k, v, causal=True,
                                                                   impl=impl)), single_args)
    for p in ps:
        mesh = make_mesh(seq=p, data=1, devices=devs[:p])
        sh = NamedSharding(mesh, act_spec(mesh))
        args = [jax.device_put(jnp.asarray(inputs[n], dtype), sh) for n in names]
        fn = _fwd_bwd(lambda q, k, v, mesh=mesh: ulysses_attention(q, k, v, mesh=mesh,
                                                                   causal=True, impl=impl))
        variants[f"P={p}"] = (fn, args)

    outs = {}
    for name, (fn, args) in variants.items():
        outs[name] = np.asarray(jax.block_until_ready(fn(*args))[0])  # compile + correctness
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in variants}
    order = list(variants)
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:
            fn, args = variants[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    errors = {n: float(np.max(np.abs(o - outs["single"]))) for n, o in outs.items()}
    return times, errors, outs["single"]


def hlo_bytes(b, s, hq, hkv, d, p, dtype) -> dict:
    """All-to-all bytes per device in the compiled forward and forward+backward, and the formula."""
    mesh = make_mesh(seq=p, data=1, devices=jax.devices("cpu")[:p])
    sh = NamedSharding(mesh, act_spec(mesh))
    q = jax.ShapeDtypeStruct((b, s, hq, d), dtype, sharding=sh)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), dtype, sharding=sh)
    attn = lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True)
    fwd = jax.jit(attn).lower(q, kv, kv).compile().as_text()
    both = _fwd_bwd(attn).lower(q, kv, kv, q).compile().as_text()
    itemsize = jnp.dtype(dtype).itemsize
    formula = formula_elements(b, s, hq, hkv, d, p) * itemsize
    measured = collective_bytes(fwd, "all-to-all")
    return {"p": p, "hq": hq, "hkv": hkv, "hkv_effective": effective_kv_heads(hq, hkv, p),
            "fwd_bytes": measured, "formula_bytes": formula, "match": measured == formula,
            "fwd_bwd_bytes": collective_bytes(both, "all-to-all"),
            "fwd_counts": {k: v for k, v in collective_counts(fwd).items() if v},
            "link_bytes": formula * (p - 1) // p}


def deepspeed_times(inputs, ps, shape, warmup, repeats):
    """DeepSpeed DistributedAttention fwd+bwd seconds per P, or (None, reason) if unavailable."""
    try:
        from ulysses_jax.compare import Case, DeepSpeedUnavailable, DeepSpeedWorkers
    except ImportError as e:
        return None, f"ulysses_jax.compare has no DeepSpeed runner ({e})", None
    b, s, hq, hkv, d = shape
    out, errors = {}, {}
    try:
        with DeepSpeedWorkers(max(ps)) as workers:
            versions = workers.versions
            for p in ps:
                case = Case(p=p, heads=hq, kv_heads=hkv, seq_len=s, head_dim=d, batch=b,
                            dtype="float32", causal=True, warmup=warmup, repeats=repeats)
                res = workers.run(case, inputs)
                out[f"P={p}"] = res.times
                errors[f"P={p}"] = res.results["out"] if res.results is not None else None
    except DeepSpeedUnavailable as e:
        return None, f"DeepSpeed workers cannot start: {e}", None
    return out, versions, errors



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="query heads Hq of the timed case")
    ap.add_argument("--kv-heads", type=int, default=8, help="kv heads of the timed case (MHA)")
    ap.add_argument("--gqa-kv-heads", type=int, default=2, help="kv heads of the GQA bytes case")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--ps", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed column")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention.json"))
    args = ap.parse_args(argv)
    ps = sorted({int(x) for x in args.ps.split(",") if x.strip()})
    b, s, hq, hkv, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    impl = resolve_impl("auto", dtype, d)
    try:
        for p in ps:
            kv_repeats(hq, hkv, p)
            kv_repeats(hq, args.gqa_kv_heads, p)
            if s % p:
                raise ValueError(f"sequence length {s} is not divisible by P={p}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"machine: {os.cpu_count()} CPU cores shared by {jax.device_count()} fake XLA CPU "
          f"devices; jax {jax.__version__}, Python {platform.python_version()}")
    print(f"shapes: B={b} S={s} Hq={hq} Hkv={hkv} D={d} {dtype.name} causal, local kernel {impl}")

    # ---- bytes from HLO
    print("\nforward all-to-all per device per layer, from the compiled HLO vs the formula")
    print("  B*S*D*(2*Hq + 2*Hkv')/P elements, Hkv' = Hkv if Hkv % P == 0 else P;"
          f" MHA: 4*S*d/P with d = Hq*D; x {dtype.itemsize} bytes ({dtype.name})")
    byte_rows = []
    for label, kvh in (("MHA", hq), ("GQA", args.gqa_kv_heads)):
        for p in [p for p in ps if p > 1]:
            row = dict(hlo_bytes(b, s, hq, kvh, d, p, dtype), case=label)
            byte_rows.append(row)
            print(f"  {label} Hq={hq} Hkv={kvh:<2} P={p}: HLO {row['fwd_bytes']:>10} B, formula "
                  f"{row['formula_bytes']:>10} B (Hkv'={row['hkv_effective']}) "
                  f"{'match' if row['match'] else 'MISMATCH'}; fwd+bwd {row['fwd_bwd_bytes']} B "
                  f"(2x formula {2 * row['formula_bytes']}); crosses links: "
                  f"{row['link_bytes']} B; ops {row['fwd_counts']}")
    if 1 in ps:
        print("  P=1: no exchange (0 bytes; the shard_map body skips the all-to-alls)")

    # ---- timing
    print(f"\ntiming forward+backward: {args.warmup} warm-up calls, then median of "
          f"{args.repeats} interleaved rounds")
    inputs = make_inputs(b, s, hq, hkv, d, args.seed)
    times, errors, single_out = time_jax(inputs, ps, dtype, impl, args.warmup, args.repeats)
    med = {n: statistics.median(t) for n, t in times.items()}
    ds_times, ds_info, ds_outs = (None, "skipped (--no-deepspeed)", None)
    if not args.no_deepspeed:
        ds_times, ds_info, ds_outs = deepspeed_times(inputs, ps, (b, s, hq, hkv, d),
                                                     args.warmup, args.repeats)
    ds_med = {n: statistics.median(t) for n, t in ds_times.items()} if ds_times else {}
    header = f"{'variant':>8} {'median ms':>10} {'vs single':>10} {'max|out-single|':>16}"
    if ds_times:
        header += f" {'DeepSpeed ms':>13} {'DS vs single':>13} {'DS max|out-single|':>19}"
    print(header)
    rows = []
    for name in times:
        row = {"variant": name, "median_s": med[name], "ratio_vs_single": med[name] / med["single"],
               "times_s": times[name], "max_abs_err_vs_single": errors[name]}
        line = (f"{name:>8} {med[name] * 1e3:>10.1f} {row['ratio_vs_single']:>10.2f} "
                f"{errors[name]:>16.2e}")
        if name in ds_med:
            ds_err = (float(np.max(np.abs(ds_outs[name] - single_out)))
                      if ds_outs.get(name) is not None else None)
            row.update(deepspeed_median_s=ds_med[name], deepspeed_times_s=ds_times[name],
                       deepspeed_ratio_vs_single=ds_med[name] / med["single"],
                       deepspeed_max_abs_err_vs_single=ds_err)
            line += (f" {ds_med[name] * 1e3:>13.1f} {row['deepspeed_ratio_vs_single']:>13.2f} "
                     f"{ds_err if ds_err is None else format(ds_err, '.2e'):>19}")
        rows.append(row)
        print(line)
    if ds_times:
        print(f"DeepSpeed column: deepspeed.sequence.layer.DistributedAttention, torch SDPA "
              f"inside, one gloo CPU process per rank (torch {ds_info['torch']}, deepspeed "
              f"{ds_info['deepspeed']}); 'vs single' divides by the JAX single-device median")
    else:
        print(f"DeepSpeed column skipped: {ds_info}")
    print(f"note: the {jax.device_count()} fake devices and any DeepSpeed ranks share "
          f"{os.cpu_count()} CPU cores: these ratios measure exchange and partitioning "
          f"overheads, not a speedup")

    result = {"meta": {"command": command_line(__file__, argv),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
                       "python": platform.python_version(), "cpu_count": os.cpu_count(),
                       "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                       "deepspeed": ds_info if ds_times else None},
              "shape": {"batch": b, "seq_len": s, "heads": hq, "kv_heads": hkv, "head_dim": d,
                        "gqa_kv_heads": args.gqa_kv_heads, "dtype": dtype.name, "impl": impl,
                        "causal": True},
              "timing": rows, "all_to_all_bytes": byte_rows,
              "deepspeed_skipped": None if ds_times else ds_info}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all(r["match"] for r in byte_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
