"""Memory of Ulysses attention alone per device, for each P: does it fall as 1/P?

    python benchmarks/attention_memory.py [--seq-len 65536 --heads 32 --kv-heads 8
        --head-dim 128 --dtype bfloat16 --ps 1,2,4,8] [--no-segments]

For each P, forward + backward of ``ulysses_attention`` (the kernel ``impl="auto"`` picks on
this backend; chunked on a CPU) on a (data=1, seq=P) mesh is compiled from abstract shapes,
inputs and cotangent sharded P("data", "seq") as in the model, segment ids included. Per
device: XLA's peak (arguments, temporaries, outputs) and, from its buffer live ranges
(ulysses_jax/memory.py), the bytes live at the peak by the shape of the buffer, so the part
that does not shrink with P shows by name. bf16 models compile with float16 as a stand-in on
a CPU (same bytes; see training/dry_run.py). The ideal is 1/P of P=1.
Results: benchmarks/results/attention_memory.json.
"""
from __future__ import annotations

import os
import tempfile

_DUMP = tempfile.mkdtemp(prefix="attn_mem_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={_DUMP} --xla_dump_hlo_module_re=.*jit_fwd_bwd.*"
                           f" --xla_dump_hlo_pass_re=^$").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

from _common import ROOT, command_line, ints  # noqa: E402  (repo path, fake devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from ulysses_jax import memory  # noqa: E402
from ulysses_jax.attention import ulysses_attention  # noqa: E402
from ulysses_jax.mesh import act_spec, make_mesh  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20


def measure(s, n, kh, h, dtype, p, segments):
    mesh = make_mesh(seq=p, data=1, devices=jax.devices()[:p])
    sh = NamedSharding(mesh, act_spec(mesh, 2))
    q = jax.ShapeDtypeStruct((1, s, n, h), dtype, sharding=sh)
    kv = jax.ShapeDtypeStruct((1, s, kh, h), dtype, sharding=sh)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32, sharding=NamedSharding(mesh, act_spec(mesh)))

    def fwd_bwd(q, k, v, ct, seg):
        out, vjp = jax.vjp(lambda q, k, v: ulysses_attention(
            q, k, v, mesh=mesh, segment_ids=seg if segments else None), q, k, v)
        return vjp(ct)

    fwd_bwd.__name__ = "fwd_bwd"
    memory.clear_dump(_DUMP)
    compiled = jax.jit(fwd_bwd).lower(q, kv, kv, q, seg).compile()
    mem = compiled.memory_analysis()
    peak = int(max(mem.peak_memory_in_bytes or 0, mem.argument_size_in_bytes +
                   mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes))
    buffers, _ = memory.parse(*memory.latest_dump(_DUMP, "jit_fwd_bwd"))
    _, at = memory.usage(buffers)
    live = {}
    for start, end, size, members in memory._groups(buffers):
        if start <= at <= end:
            key = members[0].shape
            live[key] = live.get(key, 0) + size
    return {"peak_bytes": peak, "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "live_at_peak_by_shape": dict(sorted(live.items(), key=lambda kv: -kv[1])[:12])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--ps", default="1,2,4,8")
    ap.add_argument("--no-segments", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_memory.json"))
    args = ap.parse_args(argv)
    dtype = jnp.dtype("float16" if args.dtype == "bfloat16" and jax.default_backend() == "cpu"
                      else args.dtype)
    results = {}
    try:
        for p in ints(args.ps):
            t0 = time.time()
            results[p] = measure(args.seq_len, args.heads, args.kv_heads, args.head_dim, dtype,
                                 p, not args.no_segments)
            print(f"P={p}: peak {results[p]['peak_bytes'] / MIB:9.1f} MiB "
                  f"({time.time() - t0:.0f} s)", flush=True)
    finally:
        shutil.rmtree(_DUMP, ignore_errors=True)
    base = results[min(results)]["peak_bytes"]
    print(f"\nS={args.seq_len}, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
          f"{args.dtype} (compiled as {dtype.name}), segment ids {not args.no_segments}")
    print(f"{'P':>3} {'peak MiB':>10} {'vs P=1':>7} {'ideal':>6}")
    for p, r in results.items():
        print(f"{p:>3} {r['peak_bytes'] / MIB:10.1f} {r['peak_bytes'] / base:7.3f} {1 / p:6.3f}")
    for p, r in results.items():
        print(f"P={p} live at the peak, largest shapes (MiB): " + ", ".join(
            f"{k} {v / MIB:.1f}" for k, v in list(r["live_at_peak_by_shape"].items())[:6]))
    with open(args.out, "w") as f:
        json.dump({"command": command_line(__file__, argv),
                   "date": time.strftime("%Y-%m-%d %H:%M %Z"), "jax": jax.__version__,
                   "backend": jax.default_backend(), "args": vars(args),
                   "compiled_dtype": dtype.name, "results": results}, f, indent=2)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
