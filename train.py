"""Train a sequence-parallel decoder: python train.py --config configs/tiny.yaml [key=value ...]

Thin CLI over ``ulysses_jax.training.trainer.train``. On a machine with no accelerator it provides as
many fake CPU devices as the mesh needs (set before JAX starts). Multi-host: pass
--coordinator/--num-processes/--process-id, or launch under SLURM / Open MPI, and every process
runs this same command.

Exit codes: 0 done, or stopped by SIGTERM/SIGINT (during training after saving a checkpoint,
before it with nothing to save); 2 a bad input or a fault (config, data, paths, workdir in
use, damaged checkpoints, disk full), with a one-paragraph ``error: ...`` and no traceback;
3 the loss became NaN or infinite.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML preset (configs/*.yaml)")
    p.add_argument("--workdir", help="run directory (default: runs/<preset name>)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the train step only and print memory/FLOPs/collectives as JSON")
    p.add_argument("--target", choices=_target_names(),
                   help="with --dry-run: compile with XLA's GPU compiler for GPUs of this kind "
                        "(no GPU needed; jax's CUDA plugin must be installed)")
    p.add_argument("--devices", type=int,
                   help="with --target: GPUs in the compiled topology (default: the mesh's "
                        "data x ring x seq)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
    p.add_argument("--num-processes", type=int, help="number of processes (multi-process runs)")
    p.add_argument("--process-id", type=int, help="index of this process (multi-process runs)")
    p.add_argument("overrides", nargs="*",
                   help="key=value config overrides, e.g. mesh.seq=4 (before or after options)")
    return p.parse_intermixed_args(argv)


def _target_names() -> list[str]:
    from ulysses_jax.gpu_target import names
    return names()


def _target_args_error(args) -> str | None:
    """What is wrong with --target/--devices, or None."""
    if args.target and not args.dry_run:
        return "--target compiles without running: it needs --dry-run"
    if args.devices is not None and not args.target:
        return "--devices sizes a --target topology: it needs --target"
    if args.devices is not None and args.devices < 1:
        return f"--devices must be positive, got {args.devices}"
    return None


def _process_args_error(args) -> str | None:
    """What is wrong with --coordinator/--num-processes/--process-id, or None."""
    given = [f"--{k.replace('_', '-')}" for k in ("num_processes", "process_id")
             if getattr(args, k) is not None]
    if not args.coordinator:
        return (f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --coordinator "
                f"HOST:PORT (the address of process 0); a multi-process run needs all three"
                if given else None)
    if len(given) < 2:
        return "--coordinator needs --num-processes and --process-id"
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        return f"--coordinator must be HOST:PORT, got {args.coordinator!r}"
    if args.num_processes < 1:
        return f"--num-processes must be positive, got {args.num_processes}"
    if not 0 <= args.process_id < args.num_processes:
        return (f"--process-id must be in [0, --num-processes) = [0, {args.num_processes}), "
                f"got {args.process_id}")
    return None


def _stop_now(signum, frame):
    """SIGTERM/SIGINT before the training loop (which saves first, then exits 0): end the
    process at once. Safe at any moment: the workdir's files are written so that even kill -9
    loses nothing (atomic renames, an flock the kernel releases), and nothing is lost yet."""
    sys.stdout.flush()
    print(f"stopped by {signal.Signals(signum).name} before training started (during start-up "
          f"or compilation); nothing new was saved. Run the same command again to start, or "
          f"to resume from the latest checkpoint", file=sys.stderr, flush=True)
    os._exit(0)  # not an exception: raised inside an import or a C call it gets mangled


def _quiet_library_logs() -> dict:
    """Orbax logs every failed write with a traceback before we report it in one paragraph;
    asyncio logs the futures such a failure leaves behind. Returns the old levels."""
    loggers = {name: logging.getLogger(name) for name in ("absl", "asyncio")}
    old = {name: logger.level for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.setLevel(logging.CRITICAL)
    return old


def _launched_by_scheduler() -> bool:
    return any(int(os.environ.get(k, "1")) > 1
               for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _process_args_error(args) or _target_args_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    old_levels = _quiet_library_logs()
    try:
        return _main(args)
    finally:
        for name, level in old_levels.items():
            logging.getLogger(name).setLevel(level)


def _main(args) -> int:
    from ulysses_jax import gpu_target
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
    # (a --target compile lowers on as many CPU devices as it compiles for: gpu_target.compile)
    request_cpu_devices(max(1, -(-cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq // nproc),
                            args.devices or 0))
    gpu_target.prepare_plugin()  # a CUDA plugin installed on a machine without a GPU
    dump, flags_before = None, os.environ.get("XLA_FLAGS")
    if args.dry_run and not args.target:  # XLA's buffer live ranges: memory by category, the
        # offload options' host column (a GPU compile reports host bytes itself)
        from ulysses_jax.memory import dump_flags  # (read by XLA only if JAX starts below)
        dump = tempfile.mkdtemp(prefix="ulysses_dry_run_")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump)}"
    import jax
    cache_before = jax.config.jax_enable_compilation_cache
    if dump:  # a program read from a compilation cache is not compiled, so XLA dumps nothing
        jax.config.update("jax_enable_compilation_cache", False)
    from ulysses_jax.compile_cache import fence
    fence()  # CPU programs the persistent cache cannot read back safely stay out of it
    if args.coordinator or _launched_by_scheduler():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if args.coordinator:
            jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id)
        else:
            jax.distributed.initialize()  # SLURM / Open MPI: read from the environment

    from ulysses_jax.training.dry_run import dry_run
    from ulysses_jax.training.run_dir import RunError
    from ulysses_jax.training.trainer import TrainingDiverged, train
    try:
        if args.dry_run:
            try:
                print(json.dumps(dry_run(cfg, target=args.target, devices=args.devices)))
            except gpu_target.TargetUnavailable as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            finally:
                shutil.rmtree(dump, ignore_errors=True)
                jax.config.update("jax_enable_compilation_cache", cache_before)
                if flags_before is None:  # main() called from Python: leave no flags behind
                    os.environ.pop("XLA_FLAGS", None)
                else:
                    os.environ["XLA_FLAGS"] = flags_before
            return 0
        name = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
        train(cfg, args.workdir or os.path.join("runs", name), progress=not args.no_progress)
    except (ConfigError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    # The process's own handlers until the training loop installs its saving ones (and
    # after it ends); main() called from Python leaves its caller's handlers alone.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_now)
    # For the whole process, not only main(): asyncio logs a failed write's leftover futures
    # when they are garbage collected, which can be after main() has returned (the
    # leftover exceptions themselves: checkpoint.quiet_checkpoint_leftovers).
    _quiet_library_logs()
    sys.exit(main())
