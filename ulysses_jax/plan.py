"""Longest sequence that fits a per-device memory budget, for each Ulysses degree P.

    python -m ulysses_jax.plan --config configs/llama-1b-32k.yaml --memory-gb 80 --p 1,2,4,8 \
        [--granularity 1024] [--max-seq-len 1048576] [--target h100] [key=value ...]

For each P the planner compiles the full train step abstractly (``trainer.dry_run``: nothing is
allocated, no step runs) and reads XLA's per-device peak. It doubles the length from one
``unit`` (the least common multiple of the granularity and P, so every probe is a legal
``seq_len``) until a probe no longer fits, then bisects between the last fit and the first
miss. That needs about 2·log2(L / unit) compiles per P, each taking seconds, so a progress line
is printed per probe.

Assumption: peak memory does not decrease as the sequence grows (true for this model: every
activation is [B, S/P, ...] or [B, S, N/P, ...]). The answer is XLA's estimate of the program's
own buffers; the runtime needs some room on top (allocator fragmentation, cuDNN workspaces, and
on GPU JAX preallocates only 75% of memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
otherwise), so plan with a budget below the physical size.

With ``--target h100`` (or h200, a100) every probe is compiled by XLA's GPU compiler for P
compile-only GPUs of that kind (``gpu_target``; no GPU needed, jax's CUDA plugin must be
installed), and the bytes are its memory analysis, device and host apart; the table adds
each answer's modeled tokens/s per GPU and MFU (``time_model``: a model, not a measurement)
and names the P that trains its longest length fastest by it. Without it the
probes are XLA:CPU compiles on fake CPU devices, whose buffers differ from a GPU's
(docs/PERF.md compares the two per preset).

GB here means GiB (2**30 bytes), as ``nvidia-smi`` and JAX's ``memory_stats`` count.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

from . import gpu_target, memory
from .config import Config, ConfigError, load_config, validate
from .mesh import request_cpu_devices
from .families import traits

GIB = 2 ** 30
DEFAULT_P = (1, 2, 4, 8)
DEFAULT_MAX_SEQ_LEN = 1 << 20  # 1M tokens: past this the search stops and says so


def peak_bytes(cfg: Config, target: str | None = None) -> tuple[int, int]:
    """(device, host) peak bytes per device of one compiled train step (``dry_run``), for
    GPUs of ``target`` when one is named (XLA's GPU compiler)."""
    from .training.dry_run import dry_run  # imported here: the CLI sets XLA_FLAGS before JAX starts
    result = dry_run(cfg, target=target)
    return result["peak_bytes_per_device"], result["host_bytes_per_device"]


def _both(measured) -> tuple[int, int]:
    """A measure's answer as (device, host): a plain number is device bytes alone."""
    return tuple(measured) if isinstance(measured, (tuple, list)) else (measured, 0)


def search_unit(seq: int, granularity: int, ring: int = 1) -> int:
    """Step of the search: the smallest length that is a multiple of the granularity and of
    what the mesh needs (P, or 2 x ring x seq zigzag chunks on a ring mesh)."""
    return math.lcm(seq if ring == 1 else 2 * ring * seq, granularity)


def longest_fitting_seq_len(cfg: Config, memory_bytes: int, *, granularity: int = 1024,
                            max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                            measure: Callable[[Config], object] | None = None,
                            progress: Callable[[str], None] | None = None,
                            host_bytes: int | None = None) -> int | None:
    """Longest ``seq_len`` whose compiled train step fits ``memory_bytes`` per device (and,
    if given, ``host_bytes`` of host memory per device).

    Only ``cfg.seq_len`` changes between probes; the mesh, batch, model and remat policy are
    taken from ``cfg`` as they are.

    Args:
      cfg: the run configuration (``cfg.mesh.seq`` is P).
      memory_bytes: per-device budget in bytes.
      granularity: candidate lengths are multiples of lcm(granularity, P).
      max_seq_len: longest length considered; if it still fits, it (rounded down to the
        unit) is the answer.
      measure: cfg -> per-device peak bytes, or (device, host) bytes; default
        ``peak_bytes`` (an abstract compile).
      host_bytes: host-memory budget per device for what the offload options keep there;
        None = unlimited.
      progress: called with one line per probe (e.g. ``print``); None = silent.

    Returns:
      The length, or None when even one unit does not fit.

    Raises:
      ValueError: a non-positive budget, granularity or maximum, a maximum below one unit.
      ConfigError: a config that cannot run at these lengths (heads vs P, devices, ...).
    """
    if memory_bytes <= 0:
        raise ValueError(f"memory budget must be positive, got {memory_bytes} bytes")
    if granularity < 1:
        raise ValueError(f"granularity must be a positive integer, got {granularity}")
    p = cfg.mesh.seq
    unit = search_unit(p, granularity, cfg.mesh.ring)
    if max_seq_len < unit:
        raise ValueError(f"max_seq_len {max_seq_len} is below the search unit {unit} "
                         f"(lcm of granularity {granularity} and mesh.seq {p})")
    measure = measure or peak_bytes
    say = progress or (lambda _msg: None)
    at = lambda k: dataclasses.replace(cfg, seq_len=k * unit)
    validate(at(1))  # fail on heads/P/batch rules before the first (slow) compile

    def fits(k: int) -> bool:
        t0 = time.perf_counter()
        peak, host = _both(measure(at(k)))
        ok = peak <= memory_bytes and (host_bytes is None or host <= host_bytes)
        say(f"  P={p} seq_len={k * unit:>8}: {peak / GIB:8.3f} GiB device, {host / GIB:8.3f} "
            f"GiB host {'fits' if ok else 'over'} ({time.perf_counter() - t0:.1f} s)")
        return ok

    # Counted in units: lo always fits, hi never does (or lies past max_seq_len).
    k_max = max_seq_len // unit
    lo, k = 0, 1
    while k <= k_max and fits(k):
        lo, k = k, 2 * k
    if lo == 0:
        return None
    hi = min(k, k_max + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * unit


# ----------------------------------------------------------------------------- CLI

def _parse_ps(text: str) -> list[int]:
    try:
        ps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--p must be comma-separated positive integers, got {text!r}") from None
    if not ps or any(p < 1 for p in ps):
        raise ValueError(f"--p must be comma-separated positive integers, got {text!r}")
    return sorted(set(ps))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ulysses_jax.plan",
        description="Longest sequence whose compiled train step fits a per-device memory "
                    "budget, for each Ulysses degree P (abstract compiles; nothing runs).")
    p.add_argument("--config", required=True, help="YAML preset (configs/*.yaml)")
    p.add_argument("--memory-gb", type=float, required=True,
                   help="per-device budget in GiB (2**30 bytes); leave headroom for the runtime")
    p.add_argument("--host-memory-gb", type=float,
                   help="host memory per device in GiB for what the offload options keep there "
                        "(model.offload_checkpoints, optimizer.offload); default unlimited")
    p.add_argument("--p", default=",".join(map(str, DEFAULT_P)),
                   help="Ulysses degrees to plan for, comma-separated (default 1,2,4,8)")
    p.add_argument("--granularity", type=int, default=1024,
                   help="lengths are multiples of lcm(granularity, P) (default 1024)")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN,
                   help=f"stop searching here (default {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--target", choices=gpu_target.names(),
                   help="compile each probe with XLA's GPU compiler for P GPUs of this kind "
                        "(no GPU needed; jax's CUDA plugin must be installed)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. batch_size=1")
    return p


def _plan_configs(args) -> tuple[Config, dict[int, Config]]:
    """The base config and one config per P, all validated before JAX starts."""
    if not (args.memory_gb > 0 and math.isfinite(args.memory_gb)):
        raise ValueError(f"--memory-gb must be a positive number, got {args.memory_gb}")
    if args.host_memory_gb is not None and not (args.host_memory_gb >= 0 and
                                                math.isfinite(args.host_memory_gb)):
        raise ValueError(f"--host-memory-gb must be a non-negative number, got "
                         f"{args.host_memory_gb}")
    if args.granularity < 1:
        raise ValueError(f"--granularity must be a positive integer, got {args.granularity}")
    cfg = load_config(args.config, args.overrides)
    if cfg.model.remat == "auto":  # planned with the least memory short of offloading; a run
        # picks the least recomputation that fits its memory (training/fit.py)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full"))
    per_p = {}
    for p in _parse_ps(args.p):
        c = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, seq=p))
        unit = search_unit(p, args.granularity)
        if args.max_seq_len < unit:
            raise ValueError(f"--max-seq-len {args.max_seq_len} is below the search unit {unit} "
                             f"for P={p} (lcm of --granularity {args.granularity} and P)")
        try:
            validate(dataclasses.replace(c, seq_len=unit))
        except ConfigError as e:
            raise ConfigError(f"P={p}: {e}") from None
        per_p[p] = c
    return cfg, per_p


def _accum_note(cfg) -> str:
    """The header's micro-batching: each probe compiles the accumulated step (its float32
    gradient accumulator included)."""
    k = cfg.grad_accum_steps
    return "" if k == 1 else f" (grad_accum_steps={k}: micro-batches of {cfg.batch_size // k})"


def _moe_note(m) -> str:
    """The MoE shape for the header: experts are split over all P x data devices, so each P
    also changes the experts per device (and must divide them; checked per P)."""
    if not m.num_experts:
        return ""
    cf = m.moe_capacity_factor
    return (f" experts={m.num_experts} top-{m.num_experts_per_tok} moe_ffn_dim={m.moe_ffn_dim}"
            f" capacity_factor={cf if cf else 'none (no dropping)'}")


def _mixer_note(m) -> str:
    """Qwen3-Next's token mixers for the header (DeltaNet layers need linear value heads
    divisible by each P; checked per P)."""
    if "D" not in m.layer_mixers():
        return ""
    return (f" mixers={m.mixer_pattern} deltanet_heads={m.linear_key_heads}/"
            f"{m.linear_value_heads}x{m.linear_value_dim}")


def _vision_note(cfg) -> str:
    """The vision tower of a multimodal family for the header: it is compiled with its patch
    slots (data.vision_patches; by default 4 x batch x seq_len over the devices plus a
    frame, so they grow with each length tried)."""
    m = cfg.model
    if not traits(m.family).vision:
        return ""
    v = m.vision
    slots = cfg.data.vision_patches or "4 x tokens / devices + a frame"
    return (f" vision: depth={v.depth} width={v.hidden_size} split={v.split} "
            f"patch_slots/device={slots}")


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg, per_p = _plan_configs(args)
    except ValueError as e:  # ConfigError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Enough fake CPU devices for the largest mesh; only the CPU platform reads the flag, and
    # only if JAX has not started yet (true when run as a module).
    need = max(c.mesh.data * c.mesh.ring * c.mesh.seq for c in per_p.values())
    request_cpu_devices(max(8, need))
    if args.target:
        if not gpu_target.cuda_plugin_installed():
            print(f"error: --target {args.target} needs jax's CUDA plugin, which is not "
                  f"installed: {gpu_target.install_hint()} (no GPU needed)", file=sys.stderr)
            return 2
        gpu_target.prepare_plugin()
    dump, flags_before = None, os.environ.get("XLA_FLAGS")
    if (cfg.model.offload_checkpoints or cfg.optimizer.offload) and not args.target:  # the host column needs them
        dump = tempfile.mkdtemp(prefix="ulysses_plan_")  # (read by XLA if JAX starts below)
        os.environ["XLA_FLAGS"] = f"{flags_before or ''} {memory.dump_flags(dump)}".strip()
    import jax
    cache_before = jax.config.jax_enable_compilation_cache
    if dump:  # a program read from a compilation cache is not compiled, so XLA dumps nothing
        jax.config.update("jax_enable_compilation_cache", False)

    m = cfg.model
    budget = int(args.memory_gb * GIB)
    host_budget = None if args.host_memory_gb is None else int(args.host_memory_gb * GIB)
    print(f"plan: {args.config}  d_model={m.d_model} layers={m.n_layers} heads={m.n_heads}/"
          f"{m.n_kv_heads} dtype={m.dtype} remat={m.remat} param_sharding={cfg.param_sharding} "
          f"batch_size={cfg.batch_size}{_accum_note(cfg)} mesh.data={cfg.mesh.data}{_moe_note(m)}{_mixer_note(m)}{_vision_note(cfg)} offload: checkpoints="
          f"{m.offload_checkpoints} optimizer={cfg.optimizer.offload}; budget "
          f"{args.memory_gb:g} GiB per device"
          f"{'' if host_budget is None else f', {args.host_memory_gb:g} GiB host per device'}; "
          + (f"XLA's GPU compiler for P x {gpu_target.load(args.target).device_kind} "
             f"(compile-only)" if args.target else
             f"{jax.device_count()} {jax.devices()[0].platform} devices"), flush=True)
    results, peaks, models = {}, {}, {}

    def measure(c):
        from .training.dry_run import dry_run
        r = dry_run(c, target=args.target)
        peaks[c.mesh.seq, c.seq_len] = r["peak_bytes_per_device"], r["host_bytes_per_device"]
        if "step_seconds_model" in r:  # a target's program: its modeled time (time_model.py)
            models[c.mesh.seq, c.seq_len] = r
        return peaks[c.mesh.seq, c.seq_len]

    try:
        for p, c in per_p.items():
            print(f"P={p}: searching multiples of {search_unit(p, args.granularity)}", flush=True)
            try:
                results[p] = longest_fitting_seq_len(
                    c, budget, granularity=args.granularity, max_seq_len=args.max_seq_len,
                    progress=lambda line: print(line, flush=True), measure=measure,
                    host_bytes=host_budget)
            except (ValueError, gpu_target.TargetUnavailable) as e:  # e.g. more devices
                print(f"error: P={p}: {e}", file=sys.stderr)              # than this machine has
                return 2
    finally:
        if dump:
            shutil.rmtree(dump, ignore_errors=True)
            jax.config.update("jax_enable_compilation_cache", cache_before)
            os.environ["XLA_FLAGS"] = flags_before or ""  # main() called from Python
    timed = bool(models)
    print(f"\n{'P':>3}  {'longest seq_len':>16}  {'device GiB':>10}  {'host GiB':>9}  "
          + (f"{'tokens/s/GPU*':>13}  {'MFU*':>6}  " if timed else "") + "note")
    for p, length in results.items():
        unit = search_unit(p, args.granularity)
        note = ("even one unit does not fit" if length is None else
                f"reached --max-seq-len {args.max_seq_len}; longer may fit"
                if length + unit > args.max_seq_len else "")
        dev, host = peaks.get((p, length), (None, None))
        cols = ("-", "-") if dev is None else (f"{dev / GIB:.2f}", f"{host / GIB:.2f}")
        model = models.get((p, length), {})
        rate = model.get("tokens_per_second_per_gpu_model")
        mfu = model.get("mfu_model")
        print(f"{p:>3}  {'-' if length is None else length:>16}  {cols[0]:>10}  {cols[1]:>9}  "
              + (f"{'-' if rate is None else f'{rate:,.0f}':>13}  "
                 f"{'-' if mfu is None else f'{mfu:.1%}':>6}  " if timed else "") + note)
    if timed:
        ranked = sorted(((m["tokens_per_second_per_gpu_model"], p) for (p, length), m in
                         models.items() if results.get(p) == length), reverse=True)
        print("* modeled, not measured: ulysses_jax/time_model.py over each answer's GPU "
              f"program with the rates of targets/{args.target}.txtpb"
              + (f"; most tokens/s per GPU at its longest length: P={ranked[0][1]}"
                 if ranked else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
