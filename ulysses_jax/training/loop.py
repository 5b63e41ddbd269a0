"""The training loop: steps, logs, evaluates, checkpoints and handles signals, for any
objective (``objectives/base.py``; it asks the objective, never which one it is).

``run(...)`` compiles the train step ahead of the loop (timings exclude compilation; a batch
with another row count, as a packed GRPO batch has, gets a step compiled for it), then runs
steps ``start + 1`` ... ``cfg.steps``: each step's record goes to metrics.jsonl (and
TensorBoard) every ``log_every`` steps and at evaluations, before that step's checkpoint;
SIGTERM or SIGINT saves a checkpoint and returns; a non-finite loss stops the run before
anything is saved after it.
"""
from __future__ import annotations

import math
import signal
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from ..config import Config, rows_per_batch, to_dict
from ..data.run_data import is_main, log
from .checkpoint import Checkpointer
from .objectives.base import Objective
from .run_dir import MetricsLog
from .train_step import abstract_batch, make_train_step, scalar

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


class _Preemption:
    """Turns SIGTERM and SIGINT into a flag (the signal's name) the loop checks after each
    step; the handlers in place before (train.py's stop during start-up) come back after."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._old = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run(cfg: Config, objective: Objective, mesh, layout: tuple, start: int, source, batches,
        ckpt: Checkpointer, metrics_log: MetricsLog, progress: bool, flops: float,
        compiled: tuple | None = None, first: dict | None = None) -> dict:
    """Steps ``start + 1`` ... ``cfg.steps``: log, evaluate, checkpoint; stop on a signal.

    Args:
      layout: (graphdef, state, state shardings, optimizer).
      source: the batch source whose position a checkpoint saves (``get_state``).
      batches: the step batches (``objectives.base.StepBatches``).
      flops: the model FLOPs of a step on each device (``trainer.model_flops_per_device``).
      compiled: (the jitted train step, its executable for the config's rows), compiled
        for this state's layout (``fit.compile_train_step``); default: compiled here.
      first: fields the first record this call logs adds (the memory check's).
    """
    graphdef, state, shardings, tx = layout
    # Compiled ahead of the loop: the loop runs this executable, timings exclude
    # compilation, and its cost analysis is per device (a lowered program's is global).
    if compiled is None:
        jitted = make_train_step(cfg, mesh, graphdef, tx, shardings)
        t0 = time.time()
        log("compiling the train step")
        step_fn = jitted.lower(_abstract(state), abstract_batch(cfg, mesh)).compile()
        log(f"compiled the train step in {time.time() - t0:.1f} s")
    else:
        jitted, step_fn = compiled
    first = dict(first or {})
    full_rows = rows_per_batch(cfg)
    steps_by_rows = {full_rows: step_fn}  # packed batches have fewer rows (a few sizes)
    xla_flops = xla_flops_of(step_fn)
    device = mesh.local_devices[0]
    peak = peak_flops(device)
    log(f"model FLOPs per step and device {flops:.3e} (XLA's cost analysis: "
        f"{xla_flops or 0:.3e}); "
        + (f"MFU against {peak / 1e12:.0f} TFLOP/s ({device.device_kind})" if peak else
           f"no MFU: peak FLOP/s of {getattr(device, 'device_kind', device.platform)!r} "
           f"unknown"))
    tokens_per_step = full_rows * cfg.seq_len
    step_metrics = objective.metrics()
    summary = {"status": "done", "step": start, "loss": None, "eval_loss": None,
               objective.heldout: None}

    def save(step, force=False):
        return ckpt.save(step, state, {"data": source.get_state(), "config": to_dict(cfg)},
                         force=force)

    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
               disable=not (progress and is_main()))
    # Signals set a flag from here on, through the final save: a stop never cuts a save.
    with _Preemption() as preempt:
        try:
            last_time, last_step = time.time(), start
            for step in range(start + 1, cfg.steps + 1):
                t_batch = time.time()
                batch = batches.next(step, state["params"])
                batch_s = time.time() - t_batch
                rows = batch["tokens"].shape[0]
                if rows not in steps_by_rows:
                    t_compile = time.time()
                    steps_by_rows[rows] = jitted.lower(
                        _abstract(state), abstract_batch(cfg, mesh, rows)).compile()
                    log(f"compiled the train step for {rows} packed rows in "
                        f"{time.time() - t_compile:.1f} s")
                t_train = time.time()
                state, metrics = steps_by_rows[rows](state, batch)
                scalar(metrics["loss"])  # waits for the step: honest timings
                train_s = time.time() - t_train
                loss = scalar(objective.reported_loss(step, metrics))
                if not math.isfinite(loss):
                    raise _diverged(loss, step, ckpt, cfg)
                summary.update(step=step, loss=loss)
                bar.update(1)
                final = step == cfg.steps
                evaluate = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
                if step % cfg.log_every == 0 or evaluate:
                    now = time.time()
                    dt = (now - last_time) / (step - last_step)
                    supervised = scalar(metrics["tokens"])
                    step_tokens = rows * cfg.seq_len
                    record = {"step": step, "loss": loss, "tokens_per_sec": step_tokens / dt,
                              "step_time": dt, "lr": scalar(metrics["lr"]),
                              "grad_norm": scalar(metrics["grad_norm"]),
                              "tokens": supervised, "step_tokens": step_tokens,
                              "supervised_tokens": supervised}
                    share = step_tokens / tokens_per_step  # a packed batch's rows
                    record["flops_per_device"] = flops * share
                    if xla_flops:
                        record["xla_flops_per_device"] = xla_flops * share
                    if peak:
                        record["mfu"] = flops * share / dt / peak
                    record.update({k: scalar(metrics[k]) for k in step_metrics})
                    record.update(batches.record(step, {"batch_s": batch_s,
                                                        "train_s": train_s}))
                    record.update(_moe_metrics(metrics))
                    record.update(_memory_in_use(device))
                    record.update(first)
                    first = {}
                    if evaluate:
                        record.update(batches.evaluate(state["params"]))
                        summary[objective.heldout] = record.get(objective.heldout)
                    metrics_log.append(record)  # before the step's checkpoint: see run_dir.py
                    bar.set_postfix(loss=f"{loss:.4f}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}",
                                    **({"mfu": f"{record['mfu']:.1%}"} if peak else {}))
                    if not progress:  # no bar (logs of batch jobs): a line per logged step
                        log(step_line(record, cfg.steps) + objective.line(record))
                    last_time, last_step = time.time(), step
                if agreed(preempt.received is not None):
                    save(step, force=True)
                    ckpt.wait()
                    by = preempt.received or "a signal to another process"
                    bar.close()  # the bar's line ends before the log's
                    log(f"{by}: saved step {step} to {ckpt.directory}; exiting")
                    summary["status"] = "preempted"
                    return summary
                if cfg.checkpoint_every > 0:
                    save(step)
            save(cfg.steps, force=True)
            ckpt.wait()
        finally:
            bar.close()
    log(objective.done_line(summary))
    return summary


def _diverged(loss: float, step: int, ckpt: Checkpointer, cfg: Config) -> TrainingDiverged:
    latest = ckpt.latest_step()
    kept = (f"The last good checkpoint (step {latest}) in {ckpt.directory} is intact and a "
            f"rerun resumes from it" if latest is not None else
            f"No checkpoint had been saved yet (checkpoint_every={cfg.checkpoint_every}), so "
            f"a rerun starts from step 0")
    return TrainingDiverged(f"loss is {loss} at step {step}; stopping. {kept}: lower "
                            f"optimizer.lr or raise optimizer.warmup_steps and run again")


def agreed(flag: bool) -> bool:
    """True on every process if any process got the flag, so all act together (a save is
    collective; one process saving while another steps on would hang)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def xla_flops_of(compiled) -> float | None:
    """XLA's cost-analysis FLOPs of one step per device (None if unavailable). Not the
    model's FLOPs (see flops.py): loop bodies count once, custom calls not at all."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0)) or None


def _moe_metrics(metrics: dict) -> dict:
    """An MoE model's router metrics (objectives/sft.py): ``moe_aux_loss``, ``moe_load``
    (list, per expert) and ``moe_dropped``; nothing for a dense model."""
    return {k: np.asarray(v.addressable_data(0)).tolist() for k, v in metrics.items()
            if k.startswith("moe_")}


def _memory_in_use(device) -> dict:
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return {}
    out = {"memory_bytes_in_use": int(stats["bytes_in_use"])}
    if "peak_bytes_in_use" in stats:
        out["memory_peak_bytes"] = int(stats["peak_bytes_in_use"])
    return out


def step_line(record: dict, steps: int) -> str:
    """The loop's part of a logged step's line when there is no progress bar (the
    objective adds its own: ``Objective.line``)."""
    line = (f"step {record['step']}/{steps}: loss {record['loss']:.4f}, "
            f"{record['tokens_per_sec']:.0f} tok/s, lr {record['lr']:.3g}")
    if "mfu" in record:
        line += f", MFU {record['mfu']:.1%}"
    return line
