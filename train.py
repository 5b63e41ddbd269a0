"""Train a sequence-parallel decoder: python train.py --config configs/tiny.yaml [key=value ...]

Thin CLI over ``ulysses_jax.training.trainer.train``. On a machine with no accelerator it provides as
many fake CPU devices as the mesh needs (set before JAX starts). Multi-host: pass
--coordinator/--num-processes/--process-id, or launch under SLURM / Open MPI, and every process
runs this same command.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    p.add_argument("--workdir", help="run directory (default: runs/<preset name>)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the train step only and print memory/FLOPs/collectives as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
    p.add_argument("--num-processes", type=int, help="number of processes (multi-process runs)")
    p.add_argument("--process-id", type=int, help="index of this process (multi-process runs)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. mesh.seq=4")
    return p.parse_args(argv)


# XLA flags for GPU runs: the latency-hiding scheduler orders independent work so that
# collectives (the Ulysses all-to-alls, ZeRO-3 weight gathers) run asynchronously under
# compute. Only added when a CUDA plugin is installed; XLA_FLAGS set by the user win.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)


def _has_cuda_plugin() -> bool:
    import importlib.util
    for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                 "jax_plugins.xla_cuda12"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package is absent
            continue
    return False


def _launched_by_scheduler() -> bool:
    return any(int(os.environ.get(k, "1")) > 1
               for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.coordinator and (args.num_processes is None or args.process_id is None):
        print("error: --coordinator needs --num-processes and --process-id", file=sys.stderr)
        return 2
    from ulysses_jax.config import ConfigError, load_config
    from ulysses_jax.mesh import request_cpu_devices
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    nproc = args.num_processes or int(os.environ.get("SLURM_NTASKS",
                                                     os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))
    # Both must be set before JAX initialises its backends.
    request_cpu_devices(max(1, -(-cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq // nproc)))
    if cfg.gpu_overlap and _has_cuda_plugin():
        flags = os.environ.get("XLA_FLAGS", "")
        flags += "".join(f" {f}" for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags)
        os.environ["XLA_FLAGS"] = flags.strip()
    import jax
    if args.coordinator or _launched_by_scheduler():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if args.coordinator:
            jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id)
        else:
            jax.distributed.initialize()  # SLURM / Open MPI: read from the environment

    from ulysses_jax.training.dry_run import dry_run
    from ulysses_jax.training.trainer import TrainingDiverged, train
    try:
        if args.dry_run:
            print(json.dumps(dry_run(cfg)))
            return 0
        name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
        train(cfg, args.workdir or os.path.join("runs", name), progress=not args.no_progress)
    except ConfigError as e:
        print(f"error: bad config: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
