"""Compile the train step without running it: memory per device (device and host), FLOPs,
collectives. What ``train.py --dry-run`` prints and the planner searches with.

Two things make a CPU compile a poor picture of a GPU's memory, and this module corrects
both, saying so in its result:

- bfloat16. XLA's CPU compiler has no bf16 arithmetic: it rewrites bf16 ops to f32, and the
  buffers between them (the layer loop's stacked checkpoints, for one) become f32, twice the
  bytes a GPU keeps. It handles float16 natively, so a bf16 model is compiled with float16
  as a stand-in (same bytes per element) unless ``standin=False``. benchmarks/results/HISTORY.md
  (section 6) compares both with a GPU compile of the same step.
- memory kinds. The CPU compiler ignores host placement (``pinned_host``): offloaded
  buffers stay in its device numbers. With an offload option on, the peak is recomputed
  from XLA's buffer live ranges (``memory.py``) with the offloaded buffers moved to a host
  column: the state arguments kept in host memory, the optimizer update computed there, the
  layer checkpoints. That needs the process to dump its compiles (``memory.dump_flags``).
  On a GPU, XLA's own analysis separates host and device.

With a ``target`` (``gpu_target``: h100, h200, a100) the step is compiled by XLA's GPU
compiler for that many compile-only GPUs, on any machine with jax's CUDA plugin: no stand-in,
no live-range model, XLA's device and host bytes as it would allocate them, and the
attention kernels it chose (``hlo.attention_kernels``).
"""
from __future__ import annotations

import dataclasses
import time

import jax

from .. import gpu_target, memory, time_model
from . import fit
from ..config import Config, ConfigError, rows_per_batch, validate
from ..hlo import attention_kernels, collective_counts
from ..mesh import make_mesh
from .loop import peak_flops, xla_flops_of
from .train_step import (abstract_batch, make_train_step, param_count, state_layout,
                         trainable_count)
from .resume import initial_adapters, resolve_init_from
from .trainer import build_mesh, check_kernel, chunk_notes, model_flops_per_device


def compile_step(cfg: Config, mesh=None, target: gpu_target.Target | None = None):
    """The train step compiled for ``cfg``'s mesh from abstract shapes (nothing allocated);
    with a ``target``, by XLA's GPU compiler for that many of its GPUs (``mesh`` then holds
    this process's CPU devices: ``target_mesh``).

    Returns:
      (the compiled step, the abstract train state it takes).
    """
    mesh = mesh or build_mesh(cfg)
    graphdef, abstract, shardings, tx = state_layout(cfg, mesh)
    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    batch = abstract_batch(cfg, mesh)
    if target is not None:
        return gpu_target.compile(step, (abstract, batch), target), abstract
    return step.lower(abstract, batch).compile(), abstract


def target_mesh(cfg: Config, target: gpu_target.Target, devices: int | None = None):
    """The config's mesh for a compile for ``devices`` (default: as many as the mesh needs)
    GPUs of ``target``, on as many of this process's CPU devices (``gpu_target.compile``
    lowers there); ConfigError when the mesh needs more, or the process has too few."""
    need = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    n = need if devices is None else devices
    if n < need:
        raise ConfigError(f"--devices {n} is fewer than the mesh needs: mesh.data "
                          f"{cfg.mesh.data} x mesh.ring {cfg.mesh.ring} x mesh.seq "
                          f"{cfg.mesh.seq} = {need}")
    validate(cfg, num_devices=n)
    check_kernel(cfg, "gpu")
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise ConfigError(f"compiling for {n} x {target.device_kind} lowers on as many CPU "
                          f"devices, and this process has {len(cpus)} (XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={n} before JAX starts)")
    return make_mesh(seq=cfg.mesh.seq, data=cfg.mesh.data, ring=cfg.mesh.ring,
                     devices=cpus[:n])


def device_and_host_bytes(compiled) -> tuple[int, int]:
    """(device, host) bytes per device of a GPU compile: XLA's arguments + outputs +
    temporaries - aliased, each memory apart (its single peak figure adds the two)."""
    mem = compiled.memory_analysis()
    device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
              - mem.alias_size_in_bytes)
    host = (mem.host_argument_size_in_bytes + mem.host_output_size_in_bytes
            + mem.host_temp_size_in_bytes - mem.host_alias_size_in_bytes)
    return int(device), int(host)


def peak_bytes_per_device(compiled) -> int:
    """XLA's per-device peak of a compiled program: its reported peak, or live buffers
    (arguments + outputs + temporaries - aliased) where that is larger or not reported."""
    mem = compiled.memory_analysis()
    live = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    return int(max(getattr(mem, "peak_memory_in_bytes", 0) or 0, live))


def host_categories(cfg: Config) -> set[str]:
    """The ``memory.CATEGORIES`` that the config's offload options keep in host memory."""
    out = set()
    if cfg.model.offload_checkpoints:
        out.add("layer checkpoints")
    if cfg.optimizer.offload:  # the layers' weights stream in, their gradients out
        out |= {"parameters", "optimizer state", "optimizer update", "layer gradients"}
        if cfg.grad_accum_steps > 1:  # added to on the host (training/accumulate.py)
            out.add("gradient accumulator")
    return out


def _compile(cfg: Config, mesh, gpu, standin: bool):
    """(the compiled config, the compiled step, its abstract state, device bytes, host
    bytes) per device: XLA's analysis (``dry_run``)."""
    compiled_cfg = cfg
    if standin and cfg.model.dtype == "bfloat16":
        # LoRA's frozen weights stored in bf16 (model.lora.base_dtype) likewise as fp16.
        lo = cfg.model.lora
        lo = dataclasses.replace(lo, base_dtype="float16") if lo.base_dtype == "bfloat16" else lo
        compiled_cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, dtype="float16", lora=lo))
    if gpu:
        compiled, abstract = compile_step(compiled_cfg, mesh, gpu)
        peak, host = device_and_host_bytes(compiled)
    else:
        compiled, abstract = compile_step(compiled_cfg, mesh)
        mem = compiled.memory_analysis()
        peak = peak_bytes_per_device(compiled)
        host = int(sum(getattr(mem, f"host_{k}_size_in_bytes", 0) for k in
                       ("argument", "temp", "output"))
                   - getattr(mem, "host_alias_size_in_bytes", 0))
    return compiled_cfg, compiled, abstract, peak, host


def dry_run(cfg: Config, *, standin: bool | None = None, target: str | None = None,
            devices: int | None = None) -> dict:
    """Compiles the train step for the configured mesh without allocating or training.

    Args:
      cfg: the run's config.
      standin: compile a bfloat16 model as float16 on a CPU (module docstring); default yes
        there, no elsewhere.
      target: compile with XLA's GPU compiler for GPUs of this kind (``gpu_target.names()``)
        instead of this process's devices; ``gpu_target.TargetUnavailable`` without jax's
        CUDA plugin.
      devices: with a target, how many GPUs the topology has (default: the mesh's count).

    Returns:
      A dict with ``peak_bytes_per_device`` (device memory: XLA's analysis, or on a CPU
      with offload options the live-range model), ``host_bytes_per_device`` (what the
      offload options keep in host memory), ``memory_by_category`` (GiB per category at the
      device peak, when the compile was dumped), ``compiled_dtype``, ``flops_per_device``
      (model FLOPs per step and device, ``flops.py``), ``xla_flops_per_device`` (XLA's cost
      analysis: loop bodies counted once, custom calls not at all, so not a FLOP count),
      ``collectives`` (op -> count in the compiled HLO), ``attention_kernels`` (fused
      attention calls by kind in the HLO), ``compiler`` (the target's device, or the
      platform compiled for) and the parts of XLA's estimate. With a target also the
      step's modeled time (``time_model.report``: ``step_seconds_model``,
      ``tokens_per_second_model``, ``mfu_model``, ``time_by_kind``, ...), labelled a model.
    """
    init_notes = []  # a checkpoint not downloaded yet is planned from the config's model
    cfg = resolve_init_from(cfg, init_notes, missing_ok=True)
    t0 = time.time()
    gpu = gpu_target.load(target) if target else None
    mesh = target_mesh(cfg, gpu, devices) if gpu else build_mesh(cfg)
    platform = "gpu" if gpu else mesh.devices.flat[0].platform
    if standin is None:
        standin = platform == "cpu"
    if cfg.init_adapter:  # the adapter is checked as the run would (ConfigError if it does
        # not fit model.lora), before the compile
        _, layout, _, _ = state_layout(cfg, mesh)
        init_notes += initial_adapters(cfg, layout["params"])[1]
    auto = {}
    if cfg.model.remat == "auto":  # the least recomputation whose step fits (fit.py)
        b = None if gpu else fit.budget(mesh)
        order = fit.auto_order("gpu" if gpu else platform)
        for remat, offload in order:
            candidate = fit.with_remat(cfg, remat, offload)
            compiled_cfg, compiled, abstract, peak, host = _compile(candidate, mesh, gpu,
                                                                   standin)
            label = fit.remat_label(candidate)
            auto[label] = peak + host
            if gpu:
                fits = peak <= gpu.memory_bytes * fit.HEADROOM
            elif b is None:
                fits = True
            else:
                fits = ((peak + host) * b.devices <= b.host * fit.HEADROOM if b.cpu
                        else peak <= b.device * fit.HEADROOM)
            if fits:
                break
        cfg = candidate
        if gpu:
            against = f"against {fit.gib(gpu.memory_bytes)} per {gpu.device_kind}"
        elif b is None:
            against = "(no budget known: the least recomputation)"
        elif b.cpu:
            against = f"against {fit.gib(b.host)} for {b.devices} CPU devices ({b.source})"
        else:
            against = f"against {fit.gib(b.device)} per device ({b.source})"
        tried = ", ".join(f"{k} {fit.gib(v)}" for k, v in auto.items())
        init_notes.append(f"model.remat=auto chose {fit.remat_label(cfg)}"
                          f"{'' if fits else ' (the last candidate: none fits)'}; tried "
                          f"{tried} per device {against}")
    else:
        compiled_cfg, compiled, abstract, peak, host = _compile(cfg, mesh, gpu, standin)
    mem = compiled.memory_analysis()
    result = {"peak_bytes_per_device": peak, "host_bytes_per_device": host,
              "memory_model": "xla"}
    if gpu:
        result["device_memory_bytes"] = gpu.memory_bytes
    result["remat"] = fit.remat_label(cfg)
    if auto:  # each candidate's device + host bytes per device, in the order tried
        result["remat_auto"] = auto
    offloaded = host_categories(cfg)
    dump = memory.dump_dir()
    try:  # (the live-range reading is checked against XLA:CPU's programs only)
        texts = memory.latest_dump(dump) if dump and not gpu else None
    except FileNotFoundError:  # flags set after JAX started (dry_run called in-process)
        texts = None
    if texts is None and offloaded and platform == "cpu":
        result["memory_model"] = ("XLA's (the CPU compiler keeps offloaded buffers on the "
                                  "device; run train.py --dry-run for the host column)")
    if texts:
        buffers = memory.assign_categories(memory.parse(*texts)[0], cfg.model.n_layers)
        xla_peak = peak
        device_peak, at = memory.usage(buffers, exclude=lambda b: b.category in offloaded)
        result["memory_by_category"] = {
            k: round(v / 2 ** 30, 3) for k, v in memory.breakdown(buffers, at).items() if v}
        # The live-range sum with nothing moved, next to XLA's own peak: they should agree.
        result["live_range_peak_bytes"] = memory.usage(buffers)[0]
        if offloaded and platform == "cpu":
            result.update(
                peak_bytes_per_device=device_peak,
                host_bytes_per_device=memory.usage(
                    buffers, only=lambda b: b.category in offloaded)[0],
                memory_model=f"CPU compile's live ranges, {', '.join(sorted(offloaded))} "
                             f"in host memory (XLA's own device peak: {xla_peak})")
    if dump:
        memory.clear_dump(dump)
    notes = init_notes + chunk_notes(cfg)
    if compiled_cfg is not cfg:
        notes.append("compiled with float16 as a stand-in for bfloat16 (same bytes; the CPU "
                     "compiler would keep bf16 intermediates as f32)")
    hlo_text = compiled.as_text()
    result.update({
        "compiler": gpu.device_kind if gpu else platform,
        "compiled_dtype": compiled_cfg.model.dtype,
        "flops_per_device": model_flops_per_device(cfg),
        "xla_flops_per_device": xla_flops_of(compiled),
        "collectives": collective_counts(hlo_text),
        "attention_kernels": attention_kernels(hlo_text),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "params": param_count(abstract["params"]),
        # What gets gradients and optimizer state: all of them, or LoRA's (model.lora).
        "trainable_params": trainable_count(cfg, abstract["params"]),
        "mesh": {"data": cfg.mesh.data, "ring": cfg.mesh.ring, "seq": cfg.mesh.seq},
        "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
        "compile_seconds": round(time.time() - t0, 2),
        "notes": notes,
    })
    if gpu:  # the step's time, modeled from this program (time_model.py), never measured
        result.update(time_model.report(  # (peak_flops reads the target's device_kind)
            hlo_text, gpu, compiled.num_devices, result["flops_per_device"],
            rows_per_batch(cfg) * cfg.seq_len, peak_flops(gpu)))
    return result
