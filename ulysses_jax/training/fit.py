"""Fit or say so: before the first step the trainer compiles its train step from abstract
shapes (nothing allocated), compares the compiled program's memory with the memory the run
has, and refuses a run that cannot fit; ``model.remat: auto`` is resolved here to the least
recomputation that fits.

What a run needs, per device (``Need``):

  - the compiled train step: XLA's memory analysis of the very program the loop runs
    (arguments + outputs + temporaries - aliased: the state, the batch, the activations the
    backward pass keeps, gradients, the optimizer's temporaries), device and host memory
    apart (the host part: ``model.offload_checkpoints``, ``optimizer.offload``);
  - what the objective holds beside the step across steps (``Objective.resident_bytes``:
    GRPO's sampler weights, KV cache and frozen reference);
  - a checkpoint save's copy: Orbax copies one replica of the state to host memory and
    writes it while the next steps run (when checkpoints are saved during the run).

What the run has (``Budget``): on CPU devices the host's available memory
(``host_memory.available_bytes``: MemAvailable, lowered to a cgroup limit's headroom), shared
by the process's devices, whose arrays all live there; on GPUs each device's memory limit as
jax reports it (``memory_stats()["bytes_limit"]``), and the host's for the offloaded parts.
``ULYSSES_MEMORY_BUDGET`` (bytes, or a number with KB/MB/GB/KiB/MiB/GiB) replaces what is
read: the host's memory on CPU devices, each device's on GPUs; the tests use it to make a
small budget. ``ULYSSES_SKIP_HOST_MEMORY_CHECK=1`` turns the guard off (``auto`` then picks
``none``).

A run fits when what it needs is at most ``HEADROOM`` of what it has. Programs compiled
after their inputs exist (generation's prefill and decode, evaluation's loss program) are
checked by ``check_program``: what each allocates against the memory left.

Not compiled here: the evaluation program and DPO's reference precomputation (a pass before
step 1; ``dpo.reference=base`` is part of the step). Both are forward passes over the same
state, which keep no activations for a backward pass.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax

from ..config import Config, ConfigError, validate
from ..data.run_data import log
from . import host_memory
from .host_memory import BUDGET_ENV
from .loop import agreed
from .objectives.base import Objective
from .train_step import abstract_batch, make_train_step, state_layout

GiB = 2**30
# model.remat=auto's candidates, least recomputation first: (remat, offload_checkpoints).
# The offloaded checkpoints only help where host memory is not the devices' own (not CPUs);
# save_attention differs from full only where cuDNN's fused attention runs (not CPUs).
AUTO_ORDER = (("none", False), ("save_dots", False), ("save_attention", False),
              ("full", False), ("full", True))


def auto_order(platform: str) -> list[tuple[str, bool]]:
    """``AUTO_ORDER`` without the candidates that change nothing on this platform."""
    if platform != "cpu":
        return list(AUTO_ORDER)
    return [(r, o) for r, o in AUTO_ORDER if not o and r != "save_attention"]


# The share of the memory a run's buffers may take: the rest is left to what XLA's analysis
# does not see (the runtime and its allocator, the data pipeline, a checkpoint's writer). A
# LoRA DPO run of SmolLM2-135M on 3 CPU devices whose step needed 22.46 GiB of 22.82
# available was killed by the OS at a resident size of 23.1 GiB.
HEADROOM = 0.9


def gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory a run has: ``device`` bytes per device (None on CPU devices, whose memory
    is the host's), ``host`` bytes of host memory for this process (None if unknown)."""
    device: int | None
    host: int | None
    source: str
    cpu: bool
    devices: int  # this process's devices in the mesh


def budget(mesh) -> Budget | None:
    """What this process's devices of ``mesh`` have (module docstring); None when unknown
    or the guard is off."""
    if os.environ.get(host_memory.SKIP_ENV, "0") not in ("", "0"):
        return None
    local = list(mesh.local_devices)
    cpu = local[0].platform == "cpu"
    override = os.environ.get(BUDGET_ENV, "").strip()
    given = host_memory.budget_override()
    host = host_memory.available_bytes()
    if cpu:
        if override:
            return Budget(None, given, f"{BUDGET_ENV}={override}", True, len(local))
        if host is None:
            return None
        return Budget(None, host[0], host[1], True, len(local))
    if override:
        return Budget(given, host and host[0], f"{BUDGET_ENV}={override}", False, len(local))
    stats = local[0].memory_stats() or {}
    if not stats.get("bytes_limit"):
        return None
    return Budget(int(stats["bytes_limit"]), host and host[0],
                  f"{local[0].device_kind}'s memory limit as jax reports it", False, len(local))


@dataclasses.dataclass(frozen=True)
class Need:
    """Bytes a run holds: ``step_device`` / ``step_host`` the compiled step's per device,
    ``beside`` the objective's residents per device, ``save`` the checkpoint copy in this
    process's host memory."""
    step_device: int
    step_host: int
    beside: dict
    save: int

    def device_total(self) -> int:
        return self.step_device + sum(self.beside.values())

    def host_total(self, devices: int) -> int:
        return self.step_host * devices + self.save

    def fits(self, b: Budget) -> bool:
        if b.cpu:  # every device's arrays, device or "host" memory, in the one RAM
            return self.total(b) <= b.host * HEADROOM
        return (self.device_total() <= b.device * HEADROOM
                and (b.host is None or self.host_total(b.devices) <= b.host * HEADROOM))

    def total(self, b: Budget) -> int:
        """The figure compared with the budget: the process's in all on CPU devices, one
        device's on GPUs."""
        if b.cpu:
            return self.device_total() * b.devices + self.host_total(b.devices)
        return self.device_total()

    def parts(self, b: Budget) -> str:
        n = b.devices
        per = f" x {n} devices" if b.cpu and n > 1 else ""
        items = [f"the train step {gib(self.step_device)} per device{per}"]
        if self.step_host:
            items.append(f"its offloaded buffers {gib(self.step_host)} per device in host "
                         f"memory")
        items += [f"{k} {gib(v)} per device{per}" for k, v in self.beside.items() if v]
        if self.save:
            items.append(f"a checkpoint save's copy {gib(self.save)} in host memory")
        return ", ".join(items)


@dataclasses.dataclass
class Compiled:
    """The train step the loop runs: the jitted function (for other row counts) and its
    executable for the config's rows, compiled from ``layout``."""
    cfg: Config
    layout: tuple  # (graphdef, abstract state, shardings, optimizer): state_layout's
    jitted: object
    executable: object
    seconds: float
    record: dict = dataclasses.field(default_factory=dict)  # for metrics.jsonl's first line


def compile_train_step(cfg: Config, mesh) -> Compiled:
    """The train step of ``cfg`` on ``mesh`` compiled from abstract shapes."""
    t0 = time.time()
    layout = state_layout(cfg, mesh)
    graphdef, abstract, shardings, tx = layout
    jitted = make_train_step(cfg, mesh, graphdef, tx, shardings)
    executable = jitted.lower(abstract, abstract_batch(cfg, mesh)).compile()
    return Compiled(cfg, layout, jitted, executable, time.time() - t0)


def measure(compiled: Compiled, objective: Objective, mesh) -> Need:
    """What the run of ``compiled.cfg`` holds (module docstring)."""
    cfg, abstract = compiled.cfg, compiled.layout[1]
    mem = compiled.executable.memory_analysis()
    device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
              - mem.alias_size_in_bytes)
    host = (getattr(mem, "host_argument_size_in_bytes", 0)
            + getattr(mem, "host_output_size_in_bytes", 0)
            + getattr(mem, "host_temp_size_in_bytes", 0)
            - getattr(mem, "host_alias_size_in_bytes", 0))
    save = 0
    if 0 < cfg.checkpoint_every < cfg.steps:  # the write of one overlaps the next steps
        fraction = len(mesh.local_devices) / mesh.devices.size
        save = int(host_memory.global_bytes([abstract["params"], abstract["opt_state"]])
                   * fraction)
    return Need(int(device), int(max(host, 0)), objective.resident_bytes(mesh, abstract),
                save)


def remat_label(cfg: Config) -> str:
    m = cfg.model
    return "full with offloaded checkpoints" if m.offload_checkpoints else m.remat


def with_remat(cfg: Config, remat: str, offload: bool) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, remat=remat, offload_checkpoints=offload))


def fit(cfg: Config, mesh, objective_of) -> tuple[Config, Compiled, str]:
    """The run's config with ``model.remat`` resolved, its compiled train step, and a line
    saying what it needs against what it has.

    Args:
      objective_of: config -> its Objective (``objectives.get``).
    Raises:
      ConfigError: the run cannot fit (under ``auto``: not with any policy); the message
        gives the numbers, by part, and the settings that would fit, each compiled.
    """
    b = budget(mesh)
    auto = cfg.model.remat == "auto"
    if auto:
        order = auto_order(mesh.local_devices[0].platform)
        if not agreed(b is not None):  # nothing to compare with: the least recomputation
            order = order[:1]
    else:
        order = [(cfg.model.remat, cfg.model.offload_checkpoints)]
    tried = []
    for remat, offload in order:
        candidate = with_remat(cfg, remat, offload) if auto else cfg
        log(f"compiling the train step (model.remat={remat_label(candidate)})")
        compiled = compile_train_step(candidate, mesh)
        log(f"compiled the train step in {compiled.seconds:.1f} s")
        compiled.record = {"remat": candidate.model.remat,
                           "offload_checkpoints": candidate.model.offload_checkpoints}
        need = measure(compiled, objective_of(candidate), mesh)
        # Every process compiles the same program: a candidate fits if it fits on all.
        if agreed(b is not None and not need.fits(b)):
            tried.append((candidate, need))
            continue
        if b is None:
            return candidate, compiled, _line(candidate, None, None, auto)
        compiled.record.update(peak_bytes_per_device=need.step_device,
                               memory_needed_bytes=need.total(b),
                               memory_budget_bytes=b.host if b.cpu else b.device)
        if auto:  # the candidates before it, and what each needed
            compiled.record["remat_tried"] = {remat_label(c): n.total(b) for c, n in tried}
        return candidate, compiled, _line(candidate, need, b, auto, tried)
    last, need = tried[-1]
    if b is None:  # this process knows no budget; another's was too small
        raise ConfigError(f"not enough memory on another process of this run with "
                          f"model.remat={remat_label(last)} (its message has the numbers)")
    raise ConfigError(_refusal(last, need, b, mesh, objective_of, auto, tried))


def _line(cfg: Config, need: Need | None, b: Budget | None, auto: bool, tried=()) -> str:
    chosen = f"model.remat={remat_label(cfg)}" + (" (auto" + (
        ": " + ", ".join(f"{remat_label(c)} needs {gib(n.total(b))}" for c, n in tried)
        if tried else "") + ")" if auto else "")
    if need is None:
        return f"{chosen}; memory not checked (no budget known, or the check is off)"
    where = (f"on this process's {b.devices} CPU devices" if b.cpu else "per device")
    return (f"{chosen}: needs {gib(need.total(b))} {where} ({need.parts(b)}) of "
            f"{gib(b.host if b.cpu else b.device)} ({b.source}; at most {HEADROOM:.0%} of it "
            f"for the run's buffers)")


def _alternatives(cfg: Config, mesh):
    """(label, config) of the settings that cut a step's memory, for the refusal."""
    m, out = cfg.model, []
    if m.remat in ("none", "save_dots", "save_attention"):
        out.append(("model.remat=full", with_remat(cfg, "full", False)))
    if mesh.local_devices[0].platform != "cpu" and not m.offload_checkpoints:
        out.append(("model.remat=full model.offload_checkpoints=true",
                    with_remat(cfg, "full", True)))
    if cfg.param_sharding == "replicated" and mesh.devices.size > 1:
        out.append(("param_sharding=zero3", dataclasses.replace(cfg, param_sharding="zero3")))
    local = cfg.seq_len // (cfg.mesh.seq * cfg.mesh.ring)
    if m.mlp_chunk == 0 and local >= 512:
        out.append(("model.mlp_chunk=256", dataclasses.replace(
            cfg, model=dataclasses.replace(m, mlp_chunk=256))))
    if m.loss_chunk > 256 and local > 256:
        out.append(("model.loss_chunk=256", dataclasses.replace(
            cfg, model=dataclasses.replace(m, loss_chunk=256))))
    half = cfg.seq_len // 2
    if half % (2 * cfg.mesh.seq * cfg.mesh.ring) == 0 and half >= 64:
        out.append((f"seq_len={half}", dataclasses.replace(cfg, seq_len=half)))
    return out


def _refusal(cfg: Config, need: Need, b: Budget, mesh, objective_of, auto: bool,
             tried) -> str:
    where = (f"on this process's {b.devices} CPU devices (whose arrays all live in this "
             f"machine's RAM)" if b.cpu else "on each GPU")
    have = b.host if b.cpu else b.device
    if auto:
        head = ("model.remat=auto tried " + ", ".join(
            f"{remat_label(c)} ({gib(n.total(b))})" for c, n in tried) + "; with the last")
    else:
        head = f"with model.remat={remat_label(cfg)}"
    lines = []
    for label, other in _alternatives(cfg, mesh):
        try:
            validate(other, num_devices=mesh.devices.size)
            other_need = measure(compile_train_step(other, mesh), objective_of(other), mesh)
        except (ConfigError, ValueError) as e:  # a setting this run cannot take
            lines.append(f"{label}: not possible here ({e})")
            continue
        total = other_need.total(b)
        lines.append(f"{label}: {gib(total)} "
                     f"({'fits' if other_need.fits(b) else 'still over'})")
    devices = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    if not b.cpu:
        lines.append(f"more seq devices (mesh.seq={cfg.mesh.seq} of {devices} now): each then "
                     f"holds a smaller share of every sequence")
    helps = ("What the step would need instead, each compiled: " + "; ".join(lines)
             if lines else "Nothing in the config cuts this: use more memory or a smaller "
                           "model")
    return (f"not enough memory: {head}, the run needs {gib(need.total(b))} {where} "
            f"({need.parts(b)}), but {gib(have)} is available ({b.source}), of which a run "
            f"may take {HEADROOM:.0%} ({gib(int(have * HEADROOM))}). {helps}. "
            f"docs/MEMORY.md says what is counted; to start anyway, set "
            f"{host_memory.SKIP_ENV}=1")


def _in_use(mesh) -> int:
    """Bytes of the live jax arrays on this process's devices of ``mesh``."""
    local = set(mesh.local_devices)
    return sum(s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards
               if s.device in local)


def check_program(executable, mesh, what: str, advice: str) -> None:
    """ConfigError when running the compiled ``executable`` would need more memory than is
    free: what it allocates (outputs + temporaries - aliased, per device, XLA's analysis)
    against the budget less what is in use. For programs compiled after their inputs exist
    (generation's prefill and decode, evaluation's); ``advice``: the settings that cut it.
    """
    b = budget(mesh)
    if b is None:
        return
    mem = executable.memory_analysis()
    adds = max(mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes, 0)
    if b.cpu:  # MemAvailable already leaves out what is allocated; a set budget does not
        need = adds * b.devices
        free = b.host - (_in_use(mesh) if os.environ.get(BUDGET_ENV, "").strip() else 0)
        where = f"on this process's {b.devices} CPU devices"
    else:
        stats = mesh.local_devices[0].memory_stats() or {}
        need, free = adds, b.device - int(stats.get("bytes_in_use", 0))
        where = "per device"
    if need > free * HEADROOM:
        raise ConfigError(
            f"not enough memory for {what}: running it allocates {gib(need)} {where} "
            f"(XLA's analysis of the compiled program: outputs and temporaries), but "
            f"{gib(max(free, 0))} is free ({b.source}, less what is in use; a run may take "
            f"{HEADROOM:.0%} of it). {advice}. To "
            f"start anyway, set {host_memory.SKIP_ENV}=1")
