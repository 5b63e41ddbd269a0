"""What one train step costs to build on CPU devices: the CPU seconds of the state's init
(its program included), of tracing and lowering the step, of XLA's compile, of 5 steps run,
and the size of the compiled HLO; the persistent compilation cache off.

    python benchmarks/program_cost.py [--config configs/tiny.yaml] [OVERRIDES ...]

With the test suite's XLA flags (tests/utils/devices.py: 8 fake devices, LLVM optimisations off,
the older loop emitters where jaxlib still has them (0.10), one codegen module) and its
locations without Python tracebacks, so the figures are what a test pays per program. CPU
seconds of this process (time.process_time), which the machine's other jobs disturb less
than wall time; still compare figures of one sitting only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import importlib.metadata

# jaxlib 0.10 has the older loop emitters as the suite uses them; 0.11 removed the choice
_LOOP_EMITTERS = tuple(
    int(v) for v in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                           "device_count=8 --xla_backend_optimization_level=0 "
                           "--xla_cpu_parallel_codegen_split_count=1"
                           + (" --xla_cpu_use_fusion_emitters=false" if _LOOP_EMITTERS else "")
                           ).strip()
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")  # as tests/utils/devices.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = p.parse_args(argv)
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    from ulysses_jax.config import load_config
    from ulysses_jax.data import run_data, text as data_lib
    from ulysses_jax.training.train_step import init_state, make_train_step
    from ulysses_jax.training.trainer import build_mesh, token_order

    cfg = load_config(args.config, args.overrides)
    mesh = build_mesh(cfg)
    rows, _ = run_data.load_data(cfg)
    batch = data_lib.BatchIterator(rows, cfg.batch_size, cfg.seed).next_global(
        mesh, token_order(cfg))
    t0 = time.process_time()
    graphdef, state, shardings, tx = init_state(cfg, mesh)
    t1 = time.process_time()
    lowered = make_train_step(cfg, mesh, graphdef, tx, shardings).lower(state, batch)
    t2 = time.process_time()
    compiled = lowered.compile()
    t3 = time.process_time()
    for _ in range(5):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    t4 = time.process_time()
    result = {"config": os.path.relpath(args.config, ROOT), "overrides": args.overrides,
              "init_s": round(t1 - t0, 2), "trace_and_lower_s": round(t2 - t1, 2),
              "compile_s": round(t3 - t2, 2), "five_steps_s": round(t4 - t3, 2),
              "hlo_chars": len(compiled.as_text())}
    print(f"init {result['init_s']:.2f} s | trace + lower {result['trace_and_lower_s']:.2f} s "
          f"| compile {result['compile_s']:.2f} s | 5 steps {result['five_steps_s']:.2f} s "
          f"| compiled HLO {result['hlo_chars']:,} chars  (CPU seconds)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
