"""Hybrid Ulysses x Ring: bytes each collective moves per attention layer, and peak memory.

    python benchmarks/hybrid_comm.py [--seq-len 4096 --heads 8 --kv-heads 8 --gqa-kv-heads 2
        --head-dim 64] [--meshes 8x1,4x2,2x4,1x8] [--mem-lengths 2048,4096,8192,16384]
        [--out benchmarks/results/hybrid_comm.json]

A mesh is written UxR: U the seq (all-to-all) axis size, R the ring axis size, P = U*R devices.

1. Bytes. The attention forward, and forward+backward, are compiled for each mesh at the same
global shapes: ``ulysses_attention`` when R == 1, ``hybrid_attention(layout="zigzag")`` when
R > 1. Collective result sizes are read from the HLO per device and per layer (one call = one
layer's attention). A collective inside a while body appears once in the text but runs once per
iteration, so each computation's bytes are multiplied by how often it runs: the product of the
``known_trip_count`` of the while loops around it (XLA's own annotation; collectives in a
loop without one are an error). Formulas, elements per device per layer (x the dtype's
bytes; dK/dV accumulators always fp32):

    Hkv' = Hkv * kv_repeats(Hq, Hkv, U)          kv heads after repetition (split over U)
    all-to-all, forward   B * (S/R) * D * (2*Hq + 2*Hkv') / U    (q, k, v packed + output;
                          0 when U == 1)                        backward: the same again
    ring block            blk = B * (S/R) * (Hkv'/U) * D         one K (or V) block
    collective-permute, forward    (R-1) * 2 * blk               K and V, R-1 steps
                        backward   (R-1) * (2 * blk + 2 * blk_f32) + 2 * blk_f32
                                   K, V and their dK, dV travel together R-1 times; one more
                                   hop returns dK, dV to their owner
    segment ids (B * (S/R) int32 per message): + (R-1) permutes forward and (R-1) backward,
                 and one all-gather over the seq axis (result B * S/R) when U > 1

All-to-all results include the 1/U slice a device keeps, so link traffic is (U-1)/U of them;
every ring message crosses a link.

2. Memory. ``trainer.dry_run`` (abstract compile of the full train step, XLA memory analysis)
of configs/tiny.yaml with model.n_heads=4, model.n_kv_heads=2, batch_size=1, mesh.data=1, at
several lengths, for P=1, Ulysses U=4 (4 devices), U=8 (rejected: 4 heads), and the hybrids.
Peak = a + b*S + c*S^2 is fitted per mesh: the S^2 part is what the ring's dense
[B, K', G, C, C] tiles (C = S/(2R)) can add; activations are linear in S. A smaller table
compiles attention alone (fwd+bwd, the tiny model's heads) once plainly and once inside a
2-step ``lax.scan`` under ``grad``, as the model's layer loop runs it.
Results: benchmarks/results/hybrid_comm.json.
"""
from __future__ import annotations

import os


import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from _common import ROOT, command_line  # noqa: E402  (first: repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from ulysses_jax.config import ConfigError, load_config  # noqa: E402
from ulysses_jax.hlo import (COLLECTIVES, collective_bytes, collective_counts,  # noqa: E402
                             executed_collectives)
from ulysses_jax.mesh import act_spec, make_mesh  # noqa: E402
from ulysses_jax.attention.ring import hybrid_attention  # noqa: E402
from ulysses_jax.training.dry_run import dry_run  # noqa: E402
from ulysses_jax.attention import ulysses_attention  # noqa: E402
from ulysses_jax.attention.ulysses import kv_repeats  # noqa: E402

MIB = 2 ** 20
MEMORY_OVERRIDES = ("model.n_heads=4", "model.n_kv_heads=2", "batch_size=1", "mesh.data=1")
MEMORY_MESHES = ((1, 1), (4, 1), (8, 1), (4, 2), (2, 4), (1, 8))   # (U, R)


# ----------------------------------------------------------------------------- formulas

def formula_bytes(b, s, hq, hkv, d, u, r, itemsize, segments: bool) -> dict:
    """Per-device, per-layer result bytes of each collective (see the module docstring)."""
    hkv_eff = hkv * kv_repeats(hq, hkv, u, r)
    t = s // r                                                  # tokens per ring block
    a2a = b * t * d * (2 * hq + 2 * hkv_eff) // u * itemsize if u > 1 else 0
    blk, blk32 = (b * t * (hkv_eff // u) * d * n for n in (itemsize, 4))
    seg_msg = b * t * 4 if segments else 0
    cp_fwd = (r - 1) * (2 * blk + seg_msg)
    cp_bwd = (r - 1) * (2 * blk + 2 * blk32 + seg_msg) + 2 * blk32 if r > 1 else 0
    gather = b * t * 4 if segments and u > 1 else 0
    return {"hkv_effective": hkv_eff, "kv_step": 2 * blk + seg_msg,
            "fwd": {"all-to-all": a2a, "collective-permute": cp_fwd, "all-gather": gather},
            "fwd_bwd": {"all-to-all": 2 * a2a, "collective-permute": cp_fwd + cp_bwd,
                        "all-gather": gather}}


def tile_bytes(hq: int, u: int, r: int, s: int) -> int:
    """One fp32 score tile [B=1, K', G, C, C] of the ring kernel: (Hq/U) * C^2 * 4 bytes."""
    c = s // (2 * r)
    return (hq // u) * c * c * 4


# ----------------------------------------------------------------------------- measurements

def _attention(mesh, r: int, seg):
    if r == 1:
        return lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg)
    return lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, causal=True, segment_ids=seg,
                                            layout="zigzag")


def _abstract(mesh, shapes, dtype):
    sh = NamedSharding(mesh, act_spec(mesh))
    return [jax.ShapeDtypeStruct(x, dt, sharding=sh) for x, dt in
            ((shapes[0], dtype), (shapes[1], dtype), (shapes[1], dtype), (shapes[0], dtype),
             (shapes[0][:2], jnp.int32))]


def hlo_bytes(b, s, hq, hkv, d, u, r, dtype, segments: bool) -> dict:
    """Measured (static text and executed) and formula bytes of one mesh and head case."""
    mesh = make_mesh(seq=u, ring=r, data=1, devices=jax.devices()[:u * r])
    q, k, v, do, seg = _abstract(mesh, ((b, s, hq, d), (b, s, hkv, d)), dtype)

    def fwd(q, k, v, seg):
        return _attention(mesh, r, seg if segments else None)(q, k, v)

    def fwd_bwd(q, k, v, do, seg):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, seg), q, k, v)
        return (out, *vjp(do))

    texts = {"fwd": jax.jit(fwd).lower(q, k, v, seg).compile().as_text(),
             "fwd_bwd": jax.jit(fwd_bwd).lower(q, k, v, do, seg).compile().as_text()}
    want = formula_bytes(b, s, hq, hkv, d, u, r, jnp.dtype(dtype).itemsize, segments)
    row = {"u": u, "r": r, "hq": hq, "hkv": hkv, "segments": segments,
           "hkv_effective": want["hkv_effective"]}
    for part, text in texts.items():
        ex = executed_collectives(text)
        static = {op: collective_bytes(text, op) for op in COLLECTIVES}
        row[part] = {"static_bytes": {op: n for op, n in static.items() if n},
                     "executed_bytes": {op: n for op, n in ex["bytes"].items() if n},
                     "executed_counts": {op: n for op, n in ex["counts"].items() if n},
                     "formula_bytes": {op: n for op, n in want[part].items() if n},
                     "loops": [lp for lp in ex["loops"] if lp["collective_permutes_in_body"]],
                     "in_conditional": ex["in_conditional"]}
        row[part]["status"] = _status(row[part], want, part, r)
        # What reaches another device: all-to-all and all-gather keep a 1/U slice at home.
        crosses = (u - 1) / u
        row[part]["link_bytes"] = int(sum(n * (crosses if op in ("all-to-all", "all-gather") else 1)
                                          for op, n in ex["bytes"].items()))
    return row


def _status(m: dict, want: dict, part: str, r: int) -> str:
    """"match", "cse" (a known, explained difference) or "MISMATCH".

    With R == 2 there is no loop: the backward's one K/V (and segment-id) permute is the same
    op on the same operands as the forward's, and XLA's CSE merges the two. With R > 2 they sit
    in different while loops and both run.
    """
    got, formula = m["executed_bytes"], m["formula_bytes"]
    if got == formula:
        return "match"
    merged = dict(formula, **{"collective-permute":
                              formula.get("collective-permute", 0) - want["kv_step"]})
    if part == "fwd_bwd" and r == 2 and got == merged:
        return "cse"
    return "MISMATCH"


def attention_temp(s, hq, hkv, d, u, r) -> dict:
    """Temp bytes of attention fwd+bwd alone and inside a 2-step lax.scan under grad."""
    mesh = make_mesh(seq=u, ring=r, data=1, devices=jax.devices()[:u * r])
    q, k, v, _, seg = _abstract(mesh, ((1, s, hq, d), (1, s, hkv, d)), jnp.float32)

    def plain(q, k, v, seg):
        return jax.grad(lambda q: _attention(mesh, r, seg)(q, k, v).sum())(q)

    def scanned(q, k, v, seg):
        # K and V depend on the carried activation, as in a model layer: with K/V the same
        # in every step, JAX could hoist their whole ring rotation out of the scan.
        def layer(x, _):
            kx, vx = k + x[:, :, :hkv], v - x[:, :, :hkv]
            return _attention(mesh, r, seg)(x, kx, vx), None

        def loss(q):
            return jax.lax.scan(layer, q, None, length=2)[0].sum()
        return jax.grad(loss)(q)

    out = {"u": u, "r": r, "seq_len": s, "tile_bytes": tile_bytes(hq, u, r, s) if r > 1 else None}
    for name, fn in (("plain", plain), ("scan2", scanned)):
        mem = jax.jit(fn).lower(q, k, v, seg).compile().memory_analysis()
        out[f"{name}_temp_bytes"] = int(mem.temp_size_in_bytes)
    return out


def memory_table(lengths) -> tuple[list[dict], dict]:
    """dry_run of the tiny preset per (U, R) and length; U=8 records its ConfigError."""
    rows, errors = [], {}
    for u, r in MEMORY_MESHES:
        for s in lengths:
            overrides = [*MEMORY_OVERRIDES, f"mesh.seq={u}", f"mesh.ring={r}", f"seq_len={s}"]
            try:
                cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), overrides)
            except ConfigError as e:
                errors[f"{u}x{r}"] = {"overrides": overrides, "error": str(e)}
                break
            res = dry_run(cfg)
            rows.append({"u": u, "r": r, "p": u * r, "seq_len": s,
                         "peak_bytes": res["peak_bytes_per_device"],
                         "temp_bytes": res["temp_bytes"], "argument_bytes": res["argument_bytes"],
                         "tile_bytes": tile_bytes(4, u, r, s) if r > 1 else None,
                         "collectives": {k: v for k, v in res["collectives"].items() if v},
                         "compile_seconds": res["compile_seconds"]})
            print(f"  U={u} R={r} seq_len={s}: peak {res['peak_bytes_per_device'] / MIB:.1f} MiB "
                  f"(compile {res['compile_seconds']} s)", flush=True)
    return rows, errors


def quadratic_fits(rows) -> dict:
    """Least squares peak = a + b*S + c*S^2 per mesh, and the S^2 share at the longest S.

    Needs at least 4 lengths (3 coefficients and one degree of freedom to show the residual);
    returns {} with fewer.
    """
    fits = {}
    for key in sorted({(x["u"], x["r"]) for x in rows}):
        pts = [x for x in rows if (x["u"], x["r"]) == key]
        if len(pts) < 4:
            return {}
        s = np.array([x["seq_len"] for x in pts], float)
        y = np.array([x["peak_bytes"] for x in pts], float)
        top = s.max()
        design = np.stack([np.ones_like(s), s / top, (s / top) ** 2], 1)   # scaled: well posed
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        fits[f"{key[0]}x{key[1]}"] = {
            "const_bytes": float(coef[0]), "bytes_per_token": float(coef[1] / top),
            "bytes_per_token_squared": float(coef[2] / top ** 2),
            "quadratic_share_at_max": float(coef[2] / y[s == top][0]),
            "max_abs_residual_bytes": float(np.max(np.abs(design @ coef - y)))}
    return fits


# ----------------------------------------------------------------------------- report

def _fmt(d: dict) -> str:
    short = {"all-to-all": "a2a", "collective-permute": "cp", "all-gather": "ag",
             "all-reduce": "ar", "reduce-scatter": "rs"}
    return " ".join(f"{short[k]}={v}" for k, v in d.items()) or "none"


def print_bytes(rows) -> None:
    print(f"{'case':<8}{'UxR':>5} {'part':<8} {'HLO text (once)':<32} {'executed (x trips)':<32} "
          f"{'formula':<32} {'status':<8} link bytes")
    for x in rows:
        case = ("MHA" if x["hq"] == x["hkv"] else "GQA") + ("+seg" if x["segments"] else "")
        for part in ("fwd", "fwd_bwd"):
            m = x[part]
            print(f"{case:<8}{x['u']}x{x['r']:<3} {part:<8} {_fmt(m['static_bytes']):<32} "
                  f"{_fmt(m['executed_bytes']):<32} {_fmt(m['formula_bytes']):<32} "
                  f"{m['status']:<8} {m['link_bytes']}")
            for lp in m["loops"]:
                print(f"{'':<14}while loop, known_trip_count {lp['trip_count']} "
                      f"(code: R-1 = {x['r'] - 1}), {lp['collective_permutes_in_body']} "
                      f"collective-permute(s) in the body: {lp['op_name']}")
            if m["in_conditional"]:
                print(f"{'':<14}collectives inside a conditional branch (counted as if taken): "
                      f"{m['in_conditional']}")



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gqa-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--meshes", default="8x1,4x2,2x4,1x8", help="UxR list for the bytes table")
    ap.add_argument("--mem-lengths", default="2048,4096,8192,16384")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_comm.json"))
    args = ap.parse_args(argv)
    t_start = time.time()
    b, s, hq, d = args.batch, args.seq_len, args.heads, args.head_dim
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    lengths = sorted({int(x) for x in args.mem_lengths.split(",")})
    print(f"machine: {os.cpu_count()} CPU cores, {jax.device_count()} fake XLA CPU devices; "
          f"jax {jax.__version__}, Python {platform.python_version()}")

    print(f"\n== 1. bytes per device per attention layer: B={b} S={s} Hq={hq} D={d} float32 "
          f"causal, zigzag ring layout")
    print("cp = collective-permute, a2a = all-to-all, ag = all-gather (result bytes; "
          "'HLO text' counts each op once, 'executed' multiplies by the trip counts)")
    cases = [(args.kv_heads, False), (args.gqa_kv_heads, False), (args.kv_heads, True)]
    byte_rows = []
    for hkv, segments in cases:
        for u, r in meshes:
            byte_rows.append(hlo_bytes(b, s, hq, hkv, d, u, r, jnp.float32, segments))
    print_bytes(byte_rows)

    ms = max(lengths)
    print(f"\n== 2a. attention fwd+bwd temp memory per device, S={ms} Hq=4 Hkv=2 D=16 fp32, "
          f"segment ids: alone vs inside a 2-step lax.scan under grad")
    temp_rows = [attention_temp(ms, 4, 2, 16, u, r) for u, r in ((1, 1), (4, 1), (4, 2),
                                                                  (2, 4), (1, 8))]
    print(f"{'UxR':>5} {'alone MiB':>10} {'in scan MiB':>12} {'one tile MiB':>13}")
    for x in temp_rows:
        tile = "-" if x["tile_bytes"] is None else f"{x['tile_bytes'] / MIB:.1f}"
        print(f"{x['u']}x{x['r']:<3} {x['plain_temp_bytes'] / MIB:>10.1f} "
              f"{x['scan2_temp_bytes'] / MIB:>12.1f} {tile:>13}")

    print(f"\n== 2b. train step peak per device (dry_run), configs/tiny.yaml "
          f"{' '.join(MEMORY_OVERRIDES)}")
    mem_rows, errors = memory_table(lengths)
    for key, e in errors.items():
        print(f"  {key}: ConfigError: {e['error']}")
    fits = quadratic_fits(mem_rows)
    keys = sorted({(x["u"], x["r"]) for x in mem_rows}, key=lambda k: (k[0] * k[1], -k[0]))
    peak = {(x["u"], x["r"], x["seq_len"]): x["peak_bytes"] for x in mem_rows}
    print(f"{'seq_len':>8}" + "".join(f"{f'{u}x{r} (P={u * r})':>14}" for u, r in keys))
    for L in lengths:
        print(f"{L:>8}" + "".join(f"{peak[u, r, L] / MIB:>14.1f}" for u, r in keys))
    print("fit peak = a + b*S + c*S^2 (a MiB, b KiB/token, share of c*S^2 in the peak at the "
          f"longest S){'' if fits else ': skipped, needs 4 or more lengths'}")
    for k, f in fits.items():
        print(f"  {k}: a {f['const_bytes'] / MIB:8.2f}  b {f['bytes_per_token'] / 1024:7.2f}  "
              f"c*S^2 share {f['quadratic_share_at_max']:.0%}  (max residual "
              f"{f['max_abs_residual_bytes'] / MIB:.2f} MiB)")

    ok = all(x[p]["status"] != "MISMATCH" for x in byte_rows for p in ("fwd", "fwd_bwd"))
    wall = round(time.time() - t_start, 1)
    result = {"meta": {"command": command_line(__file__, argv),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jax": jax.__version__,
                       "python": platform.python_version(), "cpu_count": os.cpu_count(),
                       "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
                       "wall_seconds": wall},
              "bytes_shape": {"batch": b, "seq_len": s, "heads": hq, "kv_heads": args.kv_heads,
                              "gqa_kv_heads": args.gqa_kv_heads, "head_dim": d,
                              "dtype": "float32", "causal": True, "layout": "zigzag"},
              "bytes": byte_rows, "all_explained": ok, "attention_temp": temp_rows,
              "memory": {"preset": "configs/tiny.yaml", "overrides": list(MEMORY_OVERRIDES),
                         "rows": mem_rows, "config_errors": errors, "fits": fits}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nexecuted bytes = formula, or differ only by the R=2 CSE: {ok}; wall {wall} s; "
          f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
