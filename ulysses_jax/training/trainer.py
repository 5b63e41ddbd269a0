"""The run behind train.py: the mesh, the workdir, the objective's data, the start state,
config.yaml, then the loop (``loop.py``).

``train(cfg, workdir)`` runs (or resumes) a run in ``workdir``: ``checkpoints/`` holds Orbax
checkpoints (train state + data-iterator position), ``metrics.jsonl`` one JSON object per
logged step (each step once; the same scalars as TensorBoard event files, ``tb_log.py``),
``config.yaml`` the resolved config, ``train.lock`` keeps a second run out (``run_dir.py``).
A run resumes from its newest checkpoint that restores, also on a different mesh (the state
is restored straight into the new layout; ``resume.py``). ``data.source`` may name a token
store (``store.py``), which is memory-mapped, not loaded. Before the state is built, a run
whose compiled train step cannot fit in the memory it has is refused, and ``model.remat=auto``
resolved (``fit.py``; on CPU devices a formula's lower bound comes first, ``host_memory.py``).
What differs between objectives (the data, the batch, the loss, the evaluation) is the
objective's (``objectives/base.py``); nothing here asks which objective runs.
"""
from __future__ import annotations

import os

import jax

from ..attention.kernels import resolve_impl
from ..data import vision_batches
from ..data.run_data import is_main as _is_main, log as _log
from .checkpoint import Checkpointer, SaveFailed
from .objectives.rewards import RewardError
from . import fit, host_memory, loop, objectives
from .flops import train_step_flops
from .loop import TrainingDiverged, agreed as _agreed, peak_flops  # noqa: F401 (public)
from .tb_log import TensorBoardLog, Tee
from .resume import resolve_init_from, start_state
from .run_dir import CONFIG, MetricsLog, RunError, WorkdirLock, make_workdir, write_config
from ..config import Config, ConfigError, load_config, rows_per_batch, to_yaml, validate
from ..families import family
from ..models.loss import largest_divisor_at_most
from ..mesh import make_mesh
from .train_step import param_line, token_order  # noqa: F401 (token_order: public here)


def training_devices() -> list:
    """The devices a run uses: those of the platform of JAX's default device when one is set
    (``jax_default_device``, e.g. the CPU test devices on a one-GPU host), else
    ``jax.devices()``."""
    default = jax.config.jax_default_device
    if default is not None:
        return jax.devices(default if isinstance(default, str) else default.platform)
    return jax.devices()


def build_mesh(cfg: Config):
    devices = training_devices()
    validate(cfg, num_devices=len(devices))
    check_kernel(cfg, devices[0].platform)
    return make_mesh(seq=cfg.mesh.seq, data=cfg.mesh.data, ring=cfg.mesh.ring, devices=devices)


def check_kernel(cfg: Config, platform: str) -> None:
    """ConfigError when an explicit ``model.attn_impl`` ("xla", "cudnn") cannot run the
    model's attention (its windows, softcap, dtype, head dim) on ``platform``: the kernel
    would refuse it while the step is traced, after the run had started. The packed-rows
    rules of cuDNN depend on the batch and are left to the kernel."""
    m = cfg.model
    if m.attn_impl in ("auto", "chunked"):
        return
    for local in sorted({kind == "L" for kind in m.layer_kinds()}):
        try:
            resolve_impl(m.attn_impl, m.dtype, m.head_dim, backend=platform,
                         window=m.sliding_window if local else None,
                         softcap=m.attn_softcap or None)
        except ValueError as e:
            raise ConfigError(f"model.attn_impl={m.attn_impl}: {e}") from None


def schedule_notes(cfg: Config, workdir: str) -> list[str]:
    """A line when the learning-rate schedule is not what the keys suggest: a warmup as long
    as the schedule (it is cut to one step less, and nothing decays), or a resume whose
    ``steps`` differ from the last run's while ``optimizer.schedule_steps`` is unset (the
    schedule is stretched to the new length from the step it resumes at)."""
    opt, notes = cfg.optimizer, []
    total = opt.schedule_steps or cfg.steps
    if opt.warmup_steps >= total:
        notes.append(f"optimizer.warmup_steps {opt.warmup_steps} >= the schedule's {total} "
                     f"steps: the warmup is cut to {max(total - 1, 0)} steps and the learning "
                     f"rate ends at its peak, with no decay")
    path = os.path.join(workdir, CONFIG)
    if opt.schedule_steps is None and os.path.exists(path):
        try:
            before = load_config(path)  # the last run's resolved config
        except ConfigError:  # one that no longer loads says nothing about the schedule
            before = None
        if (before is not None and before.steps != cfg.steps
                and before.optimizer.schedule_steps is None):
            notes.append(f"steps {cfg.steps} here, {before.steps} in the last run of this "
                         f"workdir, and optimizer.schedule_steps is unset: the learning-rate "
                         f"schedule is now {cfg.steps} steps long (set "
                         f"optimizer.schedule_steps={before.steps} to keep the old one)")
    return notes


def chunk_notes(cfg: Config) -> list[str]:
    """A line for each chunk size that does not divide the tokens per device: the loops then
    use the largest divisor below it (loss.largest_divisor_at_most), which can be much
    smaller, so say which."""
    local = cfg.seq_len // (cfg.mesh.seq * cfg.mesh.ring)
    notes = []
    for key, want in (("model.loss_chunk", cfg.model.loss_chunk),
                      ("model.mlp_chunk", cfg.model.mlp_chunk)):
        if want and local % min(want, local):
            notes.append(f"{key}={want} does not divide the {local} tokens per device; chunks "
                         f"of {largest_divisor_at_most(local, want)} tokens are used")
    return notes


def model_flops_per_device(cfg: Config) -> float:
    """Model FLOPs of one step on each device (``flops.train_step_flops`` / devices), times
    the objective's factor (``Objective.flops_factor``: DPO's reference pass)."""
    devices = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    tower = {}
    if family(cfg.model.family).vision:
        tower = dict(vision_patches=vision_batches.vision_groups(cfg)
                     * vision_batches.vision_slots(cfg),
                     frame_patches=vision_batches.DEFAULT_FRAME_PATCHES)
    flops = train_step_flops(cfg.model, rows_per_batch(cfg), cfg.seq_len, **tower) / devices
    return flops * objectives.get(cfg).flops_factor()


def train(cfg: Config, workdir: str, *, progress: bool = True) -> dict:
    """Trains (or resumes) up to ``cfg.steps`` optimizer steps in ``workdir``.

    Returns:
      A summary dict: ``status`` ("done", "preempted"), ``step``, ``loss``, ``eval_loss``.

    Raises:
      ConfigError: a config that cannot run on these devices (or, on CPU devices, in this
        machine's memory), or cannot resume this workdir's checkpoints (then nothing in the
        workdir is changed).
      RunError: the workdir is in use by another run, every checkpoint is damaged, or a
        write failed (disk full); the checkpoints before the failure are intact.
      TrainingDiverged: the loss became NaN or infinite (the last checkpoint is left intact).
    """
    init_notes = []  # the RoPE settings that replace the init_from checkpoint's
    cfg = resolve_init_from(cfg, init_notes)
    mesh = build_mesh(cfg)
    workdir = make_workdir(workdir)
    lock = _lock(workdir)
    try:
        return _run(cfg, mesh, workdir, progress, init_notes)
    finally:
        lock.release()


def _lock(workdir: str) -> WorkdirLock:
    """Process 0 locks the workdir; every process fails together if it cannot."""
    lock, error = WorkdirLock(workdir), None
    if _is_main():
        try:
            lock.acquire()
        except RunError as e:
            error = e
    if _agreed(error is not None):
        raise error or RunError(f"process 0 could not lock --workdir {workdir}")
    return lock


def _run(cfg: Config, mesh, workdir: str, progress: bool, notes: list[str]) -> dict:
    """Everything after the lock: the objective's data, checkpoints, the start state,
    config.yaml, the loop."""
    _log(f"resolved config:\n{to_yaml(cfg)}")
    for note in notes + chunk_notes(cfg) + schedule_notes(cfg, workdir):
        _log(f"note: {note}")
    cfg, source = objectives.get(cfg).open(mesh, workdir)
    objective = objectives.get(cfg)  # of the config the data implies
    _log(objective.batch_line())
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.keep_checkpoints,
                        save_every=cfg.checkpoint_every if cfg.checkpoint_every > 0 else None)
    try:
        host_memory.check(cfg, mesh, reads_init_from=bool(cfg.init_from)
                          and ckpt.latest_step() is None)
        # The train step compiled from shapes and held against the memory the run has,
        # model.remat=auto resolved, before any state exists (fit.py).
        cfg, compiled, fit_line = fit.fit(cfg, mesh, objectives.get)
        _log(f"memory: {fit_line}")
        objective = objectives.get(cfg)
        start, (graphdef, state, shardings, tx), note = start_state(cfg, mesh, ckpt, source)
        _log(note)
        # Only now: a refused resume leaves the config that describes the checkpoints.
        if _is_main():
            write_config(workdir, to_yaml(cfg))
        log = MetricsLog(workdir, enabled=_is_main())
        if log.restart_at(start):
            _log(f"note: dropped the unfinished last line of {log.path} (a run stopped "
                 f"while writing it); step {start + 1} on is logged again")
        _log(param_line(cfg, state["params"]))
        batches = objective.batches(source, mesh, (graphdef, shardings), state, start,
                                    workdir, progress)
        if start >= cfg.steps:
            summary = {"status": "done", "step": start, "loss": None, "eval_loss": None}
        else:
            tb = TensorBoardLog(workdir, start, enabled=_is_main() and cfg.log_tensorboard)
            try:
                summary = loop.run(cfg, objective, mesh, (graphdef, state, shardings, tx),
                                   start, source, batches, ckpt, Tee(log, tb), progress,
                                   model_flops_per_device(cfg),
                                   compiled=(compiled.jitted, compiled.executable),
                                   first=compiled.record)
            finally:
                tb.close()
        ckpt.close()
        return summary
    except SaveFailed as e:
        _close_after_error(ckpt)
        raise RunError(_save_failed_message(e, ckpt)) from None
    except RewardError as e:  # GRPO: a reward function failed on the completions of a step
        _close_after_error(ckpt)
        latest = ckpt.latest_step()
        kept = (f"the checkpoint of step {latest} is kept and a rerun resumes from it"
                if latest is not None else "no checkpoint had been saved yet")
        raise RunError(f"{e}. The run stopped; {kept}") from None
    except BaseException:
        _close_after_error(ckpt)  # the error in flight is the one to report
        raise


def _close_after_error(ckpt: Checkpointer) -> None:
    try:
        ckpt.close()
    except SaveFailed:
        pass


def _save_failed_message(error: SaveFailed, ckpt: Checkpointer) -> str:
    steps = ckpt.all_steps()
    kept = (f"the checkpoint of step {steps[0]} is intact" if len(steps) == 1 else
            f"the checkpoints of steps {', '.join(map(str, steps))} are intact" if steps else
            "there was no checkpoint before it")
    return (f"{error}. Nothing older was lost: {kept}, and metrics.jsonl keeps its records. "
            f"Free disk space (or fix the file system) and run the same command again to "
            f"resume from step {steps[-1] if steps else 0}")


