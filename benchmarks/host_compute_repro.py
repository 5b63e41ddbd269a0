"""Two forms of host computation that XLA:GPU's stock pipeline cannot compile, in a few lines of
jax each, and the forms ulysses_jax/training/host_compute.py uses instead. For XLA's tracker.

    python benchmarks/host_compute_repro.py [--out benchmarks/results/host_compute_repro.json]

Each case is compiled in a process of its own (an abort takes the process with it) by XLA's
GPU compiler for compile-only H100s (ulysses_jax/gpu_target.py: no GPU needed, XLA's stock
pipeline, no pass turned off), on jax with its CUDA plugin (jax 0.12.0.1 here). On a machine
with GPUs the same ``jax.jit(f)(x, ...)`` compiles through the same passes. The table gives
each case's exit (0, or the signal), XLA's message, and the collectives left inside host
code (``hlo.host_collectives``).

  - ``forward``: a host computation (``compute_on("device_host")``) whose result tuple holds
    one of its own arguments unchanged. ``hlo_host_device_type_call_wrapper`` aborts:
    "Check failed: instruction->opcode() != HloOpcode::kParameter Parameter instructions
    cannot be added to a computation after it has been built" (SIGABRT). ``forward_outside``:
    the same function through ``host_compute.computed_on_host``, which takes that result
    from the argument outside the host computation.
  - ``host_reduce``: a host computation that reduces over an axis the mesh splits (a
    global norm of a gradient split over 2 devices). The partitioner puts an all-reduce in
    the host program; with the latency-hiding scheduler on (what GPU runs use)
    ``MemoryPressureMetadata::ComputeBufferAllocations`` segfaults (SIGSEGV);
    ``host_reduce_no_lhs``: without the scheduler it compiles, an all-reduce inside host
    code. ``by_shard``: the shares summed on the host per device (``host_compute.by_shard``)
    and added up on the device (``host_compute.global_norm``), scheduler on.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("forward", "forward_outside", "host_reduce", "host_reduce_no_lhs", "by_shard")


def run_case(case: str) -> None:
    """Compiles ``case`` (this process); prints one JSON line if the compile returns."""
    lhs = case != "host_reduce_no_lhs"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    from jax.experimental.compute_on import compute_on
    from jax.sharding import NamedSharding, PartitionSpec as P
    from ulysses_jax import gpu_target, hlo
    from ulysses_jax.training import host_compute

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
    host = NamedSharding(mesh, P("x"), memory_kind="pinned_host")
    on_host = lambda f: compute_on(f, compute_type="device_host",  # noqa: E731
                                   out_memory_spaces=jax.memory.Space.Host)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=host)
    if case == "forward":
        f, out = on_host(lambda x, y: (x * 2, y)), (host, host)
    elif case == "forward_outside":
        f, out = host_compute.computed_on_host(lambda x, y: (x * 2, y)), (host, host)
    elif case in ("host_reduce", "host_reduce_no_lhs"):
        f, out = on_host(lambda x, y: x - y / jnp.sqrt(jnp.sum(y * y))), host
    else:
        def f(x, y):
            norm = host_compute.global_norm(y, host, mesh)
            norm = jax.device_put(norm, NamedSharding(mesh, P(), memory_kind="pinned_host"))
            return host_compute.by_shard(lambda x, y, n: x - y / n, mesh,
                                         (P("x"), P("x"), P()), P("x"))(x, y, norm)
        out = host
    jitted = jax.jit(f, out_shardings=out,
                     compiler_options=gpu_target.step_options(lhs))
    compiled = gpu_target.compile(jitted, (x, x), gpu_target.load("h100"))
    text = compiled.as_text()
    print(json.dumps({"case": case, "host_collectives": sum(hlo.host_collectives(text).values()),
                      "host_executes": text.count('custom_call_target="HostExecute"')}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "host_compute_repro.json"))
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, this process
    args = p.parse_args(argv)
    if args.case:
        run_case(args.case)
        return 0
    import jax
    rows = []
    print(f"jax {jax.__version__}, XLA's GPU compiler for 2 x H100 (deviceless)")
    print(f"{'case':<20} {'exit':<8} {'host collectives':>16}  XLA says")
    for case in CASES:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case],
                           capture_output=True, text=True)
        exit_ = "ok" if r.returncode == 0 else (
            signal.Signals(-r.returncode).name if r.returncode < 0 else
            signal.Signals(r.returncode - 128).name if r.returncode > 128 else str(r.returncode))
        said = next((line.split("] ", 1)[-1] for line in r.stderr.splitlines()
                     if "Check failed" in line), "")
        result = next((json.loads(line) for line in r.stdout.splitlines()
                       if line.startswith("{")), {})
        rows.append({"case": case, "exit": exit_, "returncode": r.returncode,
                     "xla_message": said, **result})
        print(f"{case:<20} {exit_:<8} {str(result.get('host_collectives', '-')):>16}  "
              f"{said[:90]}")
    with open(args.out, "w") as f:
        json.dump({"jax": jax.__version__, "target": "h100", "cases": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
