"""The training loop behind train.py: data, sharded state, checkpoints, metrics, dry runs.

``train(cfg, workdir)`` runs (or resumes) a run in ``workdir``: ``checkpoints/`` holds Orbax
checkpoints (train state + data-iterator position), ``metrics.jsonl`` one JSON object per
logged step (each step once; the same scalars as TensorBoard event files, ``tb_log.py``),
``config.yaml`` the resolved config, ``train.lock`` keeps a second run out (``run_dir.py``).
A run resumes from its newest checkpoint that restores, also on a different mesh (the state
is restored straight into the new layout; ``resume.py``). ``data.source`` may name a token
store (``store.py``), which is memory-mapped, not loaded. On CPU devices a run that cannot fit
in the host's RAM is refused before the state is built (``host_memory.py``).
SIGTERM or SIGINT during training saves a checkpoint and returns; a non-finite loss stops the
run before anything is saved after it.
"""
from __future__ import annotations

import math
import os
import signal
import time

import jax
import numpy as np

from ..data import text as data_lib, run_data, vision_batches
from ..data.run_data import is_main as _is_main, log as _log
from .checkpoint import Checkpointer, SaveFailed
from .objectives.rewards import RewardError
from . import host_memory
from .flops import train_step_flops
from .position_loss import bucket_bounds, bucket_sums, token_losses
from .tb_log import TensorBoardLog, Tee
from .resume import resolve_init_from, start_state
from .run_dir import CONFIG, MetricsLog, RunError, WorkdirLock, make_workdir, write_config
from ..config import (Config, ConfigError, dpo_reference, load_config, rows_per_batch,
                      to_dict, to_yaml, validate)
from ..families import family
from ..models.loss import largest_divisor_at_most
from ..mesh import make_mesh
from .train_step import (batch_shardings, make_eval_step, make_train_step, param_line,
                         params_for_compute)

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def _scalar(x) -> float:
    """A float from a replicated global array (works when it spans several processes)."""
    return float(np.asarray(x.addressable_data(0)))


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


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
    from ..attention.kernels import resolve_impl
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


def token_order(cfg: Config) -> np.ndarray | None:
    """The order batches are loaded in: zigzag on a ring mesh (balanced causal work), else
    natural (None). The loss is a sum over tokens, so the order does not change it."""
    if cfg.mesh.ring == 1:
        return None
    from ..attention.ring import zigzag_permutation
    return zigzag_permutation(cfg.seq_len, cfg.mesh.ring)


def _abstract_batch(cfg: Config, mesh, rows: int | None = None):
    """The batch the train step is compiled for: ``rows`` rows (default: the config's)."""
    rows = rows or rows_per_batch(cfg)
    shape = (rows, cfg.seq_len)
    out = {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_mask" else np.int32,
                                   sharding=s) for k, s in batch_shardings(mesh).items()}
    if family(cfg.model.family).vision:  # M-RoPE positions and the vision arrays
        out.update(vision_batches.abstract_vision(cfg, mesh))
    by_row = batch_shardings(mesh, cfg).get("ref_logps")
    if by_row is not None:  # DPO's precomputed reference, a value per row
        out["ref_logps"] = jax.ShapeDtypeStruct((rows,), np.float32, sharding=by_row)
    if cfg.objective == "grpo":  # advantages and token weights, a value per token
        from .objectives.grpo import token_fields
        sh = batch_shardings(mesh, cfg)
        out.update({k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sh[k])
                    for k in token_fields(cfg)})
    return out


def batch_line(cfg: Config) -> str:
    """The start-up line on the batch, in sequences and tokens: per optimizer step, per
    micro-batch (grad_accum_steps) and per data replica at a time."""
    k, s, b = cfg.grad_accum_steps, cfg.seq_len, cfg.batch_size
    if cfg.objective == "grpo":  # batch_size counts prompts, each num_generations sequences
        g = cfg.grpo
        micro = "" if k == 1 else f" in grad_accum_steps={k} micro-batches"
        return (f"batch: {b} prompt{'s' * (b != 1)} x {g.num_generations} completions = "
                f"{b * g.num_generations} sequences of up to {s} tokens (completions up to "
                f"{g.max_completion_length}) per generation batch, {g.num_iterations} "
                f"optimizer step{'s' * (g.num_iterations != 1)} each{micro}")
    if cfg.objective == "dpo":  # batch_size counts pairs, each two sequences
        pairs = lambda n: f"{n} pair{'s' * (n != 1)} ({2 * n} sequences)"  # noqa: E731
        micro = "" if k == 1 else (f" in grad_accum_steps={k} micro-batches of "
                                   f"{pairs(b // k)}")
        return (f"batch: {pairs(b)} = {2 * b * s:,} tokens per optimizer step{micro}; "
                f"{pairs(b // k // cfg.mesh.data)} per data replica at a time")
    seqs = lambda n: f"{n} sequence{'s' * (n != 1)}"  # noqa: E731
    micro = "" if k == 1 else (f" in grad_accum_steps={k} micro-batches of {seqs(b // k)} = "
                               f"{b // k * s:,} tokens")
    return (f"batch: {seqs(b)} = {b * s:,} tokens per optimizer step{micro}; "
            f"{seqs(b // k // cfg.mesh.data)} per data replica at a time")


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
    """Model FLOPs of one step on each device (``flops.train_step_flops`` / devices). DPO
    trains on two sequences per pair; with ``dpo.reference=base`` each step also runs the
    reference forward pass, counted as a third of a training pass (forward 1 : backward 2)."""
    devices = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    tower = {}
    if family(cfg.model.family).vision:
        tower = dict(vision_patches=vision_batches.vision_groups(cfg)
                     * vision_batches.vision_slots(cfg),
                     frame_patches=vision_batches.DEFAULT_FRAME_PATCHES)
    flops = train_step_flops(cfg.model, rows_per_batch(cfg), cfg.seq_len, **tower) / devices
    if cfg.objective == "dpo" and dpo_reference(cfg) == "base":
        flops *= 4 / 3
    return flops


def _evaluate(eval_step, params, held_rows, cfg: Config, mesh,
              position_step=None) -> tuple[float | None, dict | None]:
    """Held-out loss over ``cfg.eval_batches`` batches (a micro-batch at a time), and (with
    ``position_step``, ``position_loss.token_losses``) the loss by position in the document:
    log-spaced buckets [0, 1), [1, 2), [2, 4), ... up to seq_len (``bucket_bounds``), with
    token counts (a bucket without tokens has loss None)."""
    if held_rows is None or cfg.eval_batches < 1:
        return None, None
    if cfg.objective == "dpo":
        return _evaluate_dpo(eval_step, params, held_rows, cfg, mesh), None
    bounds = bucket_bounds(cfg.seq_len)
    sums, counts = np.zeros(len(bounds) - 1), np.zeros(len(bounds) - 1)
    total, count = 0.0, 0.0
    if family(cfg.model.family).vision:
        batches = vision_batches.media_eval_batches(held_rows, cfg, run_data.pixel_options(held_rows),
                                                    mesh)
    else:  # the same rows, one micro-batch at a time (grad_accum_steps)
        k = cfg.grad_accum_steps
        batches = (data_lib.shard_batch(batch, mesh, order=token_order(cfg))
                   for batch in data_lib.eval_batches(held_rows, cfg.batch_size // k,
                                                      cfg.eval_batches * k))
    for sharded in batches:
        loss, n = eval_step(params, sharded)
        total += _scalar(loss) * _scalar(n)
        count += _scalar(n)
        if position_step is not None:
            losses, _ = position_step(params, sharded)
            positions = _host(sharded["positions"])
            if positions.ndim == 3:  # M-RoPE: the loss by token index in the document
                positions = vision_batches.token_index(_host(sharded["segment_ids"]))
            s, c = bucket_sums(_host(losses), positions, _host(sharded["loss_mask"]), bounds)
            sums, counts = sums + s, counts + c
    by_position = None if position_step is None else {
        "bounds": bounds, "tokens": counts.astype(int).tolist(),
        "loss": [float(a / b) if b else None for a, b in zip(sums, counts)]}
    return (total / count if count else None), by_position


def _evaluate_dpo(eval_step, params, held_rows, cfg: Config, mesh) -> dict:
    """Held-out DPO loss, reward accuracy and margin over ``cfg.eval_batches`` batches of
    pairs (a micro-batch at a time), as means over the pairs."""
    k = cfg.grad_accum_steps
    sums = np.zeros(4)
    for batch in data_lib.eval_batches(held_rows, 2 * cfg.batch_size // k,
                                       cfg.eval_batches * k):
        sharded = data_lib.shard_batch(batch, mesh, order=token_order(cfg),
                                       row_fields=held_rows.row_fields)
        sums += [_scalar(x) for x in eval_step(params, sharded)]
    loss, won, pairs, margin = sums
    if not pairs:
        return {}
    return {"eval_loss": loss / pairs, "eval_rewards/accuracies": won / pairs,
            "eval_rewards/margins": margin / pairs, "eval_pairs": int(pairs)}


def _host(x) -> np.ndarray:
    """A global array on the host (all of it, also when it spans several processes)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


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
    """Everything after the lock: data, checkpoints, start state, config.yaml, the loop."""
    _log(f"resolved config:\n{to_yaml(cfg)}")
    for note in notes + chunk_notes(cfg) + schedule_notes(cfg, workdir):
        _log(f"note: {note}")
    if cfg.objective == "grpo":
        return _run_grpo(cfg, mesh, workdir, progress)
    train_rows, held_rows = run_data.load_data(cfg)
    run_data.check_objective(cfg, train_rows)
    cfg = run_data.with_segment_bound(cfg, train_rows, held_rows)
    if family(cfg.model.family).vision:
        batches = vision_batches.MediaBatchIterator(train_rows, cfg.batch_size, cfg,
                                                    run_data.pixel_options(train_rows))
    else:
        batches = data_lib.BatchIterator(train_rows, rows_per_batch(cfg), cfg.seed)
    _log(f"data: {train_rows.num_rows} train rows of {cfg.seq_len} tokens"
         f"{'' if held_rows is None else f', {held_rows.num_rows} held-out rows'}; "
         f"mesh data={cfg.mesh.data} x ring={cfg.mesh.ring} x seq={cfg.mesh.seq} on "
         f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices")
    _log(batch_line(cfg))

    return _train(cfg, mesh, workdir, progress, batches, held_rows)


def _run_grpo(cfg: Config, mesh, workdir: str, progress: bool) -> dict:
    """A GRPO run's prompts, reward functions and stop ids (all checked before anything is
    compiled), then the run."""
    from ..data.prompts import PromptOrder
    from ..generation.settings import model_settings
    from .grpo import GRPOBatches, check_prompts, reward_functions
    from .objectives.rewards import RewardError
    prompts, held, tokenizer, fingerprint = run_data.load_prompt_data(cfg)
    try:
        funcs = reward_functions(cfg)
        stop = model_settings(cfg.init_from, tokenizer.eos_id).eos_ids or (tokenizer.eos_id,)
        check_prompts(cfg, prompts)
    except (RewardError, ValueError) as e:
        raise ConfigError(str(e)) from None
    _log(f"data: {len(prompts)} prompts{'' if held is None else f', {len(held)} held out'}; "
         f"rewards {', '.join(name for name, _ in funcs)}; stop ids {sorted(stop)}; mesh "
         f"data={cfg.mesh.data} x seq={cfg.mesh.seq} on {mesh.devices.size} "
         f"{mesh.devices.flat[0].platform} devices")
    _log(batch_line(cfg))
    batches = GRPOBatches(cfg, prompts, held, tokenizer,
                          PromptOrder(len(prompts), cfg.seed, fingerprint), mesh, workdir,
                          stop, funcs)
    return _train(cfg, mesh, workdir, progress, batches, None)


def _train(cfg: Config, mesh, workdir: str, progress: bool, batches, held_rows) -> dict:
    """Checkpoints, the start state, config.yaml and the loop."""
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.keep_checkpoints,
                        save_every=cfg.checkpoint_every if cfg.checkpoint_every > 0 else None)
    try:
        host_memory.check(cfg, mesh, reads_init_from=bool(cfg.init_from)
                          and ckpt.latest_step() is None)
        start, (graphdef, state, shardings, tx), note = start_state(cfg, mesh, ckpt, batches)
        _log(note)
        if cfg.objective == "grpo":
            from .grpo import reference_params, truncate_completions
            batches.attach(graphdef, shardings,
                           reference_params(cfg, mesh, shardings, state["params"], start))
            truncate_completions(workdir, start)
        # Only now: a refused resume leaves the config that describes the checkpoints.
        if _is_main():
            write_config(workdir, to_yaml(cfg))
        log = MetricsLog(workdir, enabled=_is_main())
        if log.restart_at(start):
            _log(f"note: dropped the unfinished last line of {log.path} (a run stopped "
                 f"while writing it); step {start + 1} on is logged again")
        _log(param_line(cfg, state["params"]))
        if cfg.objective == "dpo" and dpo_reference(cfg) == "precompute" and \
                start < cfg.steps:
            _precompute_reference(cfg, mesh, (graphdef, state, shardings), start,
                                  [r for r in (batches.rows, held_rows) if r is not None],
                                  workdir, progress)
        if start >= cfg.steps:
            summary = {"status": "done", "step": start, "loss": None, "eval_loss": None}
        else:
            tb = TensorBoardLog(workdir, start, enabled=_is_main() and cfg.log_tensorboard)
            try:
                summary = _loop(cfg, mesh, (graphdef, state, shardings, tx), start, batches,
                                held_rows, ckpt, Tee(log, tb), progress)
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


def _precompute_reference(cfg: Config, mesh, layout: tuple, start: int, rows: list,
                          workdir: str, progress: bool) -> None:
    """DPO with ``dpo.reference=precompute``: the reference log-probabilities of every pair
    (``objectives/reference.py``), attached to the rows the batches read."""
    from .objectives import dpo, reference
    graphdef, state, shardings = layout
    prepare = params_for_compute(cfg, shardings)
    logps = jax.jit(lambda p, b: dpo.sequence_logps(graphdef, prepare(p), b, mesh)[0],
                    in_shardings=(shardings["params"], batch_shardings(mesh)))
    try:
        ref = reference.load_or_compute(cfg, mesh, logps, state["params"], rows, workdir,
                                        start, progress, token_order(cfg))
    except reference.ReferenceError as e:
        raise ConfigError(str(e)) from None
    for r in rows:
        r.attach_reference(ref)


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


def _loop(cfg: Config, mesh, layout: tuple, start: int, batches, held_rows,
          ckpt: Checkpointer, log: MetricsLog, progress: bool) -> dict:
    """Steps ``start + 1`` ... ``cfg.steps``: log, evaluate, checkpoint; stop on a signal."""
    graphdef, state, shardings, tx = layout
    step_fn = make_train_step(cfg, mesh, graphdef, tx, shardings)
    eval_fn = make_eval_step(mesh, graphdef, shardings, cfg)
    position_fn = None if cfg.objective in ("dpo", "grpo") else token_losses(
        mesh, graphdef, cfg.model.loss_chunk, prepare=params_for_compute(cfg, shardings))
    # Compile ahead of the loop: the loop runs this executable, timings exclude compilation,
    # and its cost analysis is per device (a lowered, unpartitioned program's is global).
    t0 = time.time()
    _log("compiling the train step")
    jitted, step_fn = step_fn, step_fn.lower(_abstract(state),
                                             _abstract_batch(cfg, mesh)).compile()
    _log(f"compiled the train step in {time.time() - t0:.1f} s")
    # GRPO's packed batches have fewer rows (a few sizes): a step compiled for each.
    steps_by_rows = {rows_per_batch(cfg): step_fn}
    flops = model_flops_per_device(cfg)
    xla_flops = _xla_flops(step_fn)
    device = mesh.local_devices[0]
    peak = peak_flops(device)
    _log(f"model FLOPs per step and device {flops:.3e} (XLA's cost analysis: "
         f"{xla_flops or 0:.3e}); "
         + (f"MFU against {peak / 1e12:.0f} TFLOP/s ({device.device_kind})" if peak else
            f"no MFU: peak FLOP/s of {getattr(device, 'device_kind', device.platform)!r} "
            f"unknown"))
    tokens_per_step = rows_per_batch(cfg) * cfg.seq_len
    objective_metrics, grpo = (), cfg.objective == "grpo"
    if cfg.objective == "dpo":
        from .objectives.dpo import METRICS
        objective_metrics = METRICS
    if grpo:
        from .objectives.grpo import METRICS
        objective_metrics = tuple(m for m in METRICS if m != "kl" or cfg.grpo.beta)
    order = token_order(cfg)
    summary = {"status": "done", "step": start, "loss": None, "eval_loss": None}
    last_eval_reward = None

    def save(step, force=False):
        return ckpt.save(step, state, {"data": batches.get_state(), "config": to_dict(cfg)},
                         force=force)

    bar = _progress(cfg.steps, start, enabled=progress and _is_main())
    # Signals set a flag from here on, through the final save: a stop never cuts a save.
    with _Preemption() as preempt:
        try:
            last_time, last_step = time.time(), start
            for step in range(start + 1, cfg.steps + 1):
                if grpo:  # sampled with the current parameters where a generation batch starts
                    t_sample = time.time()
                    batch = batches.next_global(mesh, order, params=state["params"],
                                                step=step)
                    sampled_in = time.time() - t_sample
                else:
                    batch = batches.next_global(mesh, order)
                rows = batch["tokens"].shape[0]
                if rows not in steps_by_rows:
                    t_compile = time.time()
                    steps_by_rows[rows] = jitted.lower(
                        _abstract(state), _abstract_batch(cfg, mesh, rows)).compile()
                    _log(f"compiled the train step for {rows} packed rows in "
                         f"{time.time() - t_compile:.1f} s")
                t_train = time.time()
                state, metrics = steps_by_rows[rows](state, batch)
                loss = _scalar(metrics["loss"])  # also waits for the step: honest timings
                train_s = time.time() - t_train
                warmup = grpo and batches.is_warmup(step)
                if warmup:  # the reported loss of a warm-up step is its next-token loss
                    loss = _scalar(metrics["nll"])
                if not math.isfinite(loss):
                    raise _diverged(loss, step, ckpt, cfg)
                summary.update(step=step, loss=loss)
                bar.update(1)
                final = step == cfg.steps
                evaluate = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
                if step % cfg.log_every == 0 or evaluate:
                    now = time.time()
                    dt = (now - last_time) / (step - last_step)
                    supervised = _scalar(metrics["tokens"])
                    step_tokens = rows * cfg.seq_len if grpo else tokens_per_step
                    record = {"step": step, "loss": loss, "tokens_per_sec": step_tokens / dt,
                              "step_time": dt, "lr": _scalar(metrics["lr"]),
                              "grad_norm": _scalar(metrics["grad_norm"]),
                              "tokens": supervised, "step_tokens": step_tokens,
                              "supervised_tokens": supervised}
                    share = step_tokens / tokens_per_step  # a packed GRPO batch's rows
                    record["flops_per_device"] = flops * share
                    if xla_flops:
                        record["xla_flops_per_device"] = xla_flops * share
                    if peak:
                        record["mfu"] = flops * share / dt / peak
                    record.update({k: _scalar(metrics[k]) for k in objective_metrics})
                    if grpo:
                        record.update(batches.last, phase="sft_warmup" if warmup else "grpo",
                                      batch_s=sampled_in, train_s=train_s)
                    record.update(_moe_metrics(metrics))
                    record.update(_memory_in_use(device))
                    if evaluate and grpo:
                        record.update(batches.evaluate(state["params"],
                                                       cfg.eval_batches * cfg.batch_size))
                        last_eval_reward = record.get("eval_reward")
                    elif evaluate:
                        record["eval_loss"], by_position = _evaluate(
                            eval_fn, state["params"], held_rows, cfg, mesh, position_fn)
                        if isinstance(record["eval_loss"], dict):  # DPO: loss and rewards
                            record.update({"eval_loss": None, **record["eval_loss"]})
                        if by_position is not None:
                            record["heldout_loss_by_position"] = by_position
                        summary["eval_loss"] = record["eval_loss"]
                    log.append(record)  # before the step's checkpoint: see run_dir.py
                    bar.set_postfix(loss=f"{loss:.4f}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}",
                                    **({"mfu": f"{record['mfu']:.1%}"} if peak else {}))
                    if not progress:  # no bar (logs of batch jobs): a line per logged step
                        _log(_step_line(record, cfg.steps))
                    last_time, last_step = time.time(), step
                if _agreed(preempt.received is not None):
                    save(step, force=True)
                    ckpt.wait()
                    by = preempt.received or "a signal to another process"
                    bar.close()  # the bar's line ends before the log's
                    _log(f"{by}: saved step {step} to {ckpt.directory}; exiting")
                    summary["status"] = "preempted"
                    return summary
                if cfg.checkpoint_every > 0:
                    save(step)
            save(cfg.steps, force=True)
            ckpt.wait()
        finally:
            bar.close()
    if grpo:
        summary["eval_reward"] = last_eval_reward
        _log(f"done: step {summary['step']}, loss {summary['loss']}, held-out reward "
             f"{summary['eval_reward']}")
    else:
        _log(f"done: step {summary['step']}, loss {summary['loss']}, "
             f"held-out loss {summary['eval_loss']}")
    return summary


def _diverged(loss: float, step: int, ckpt: Checkpointer, cfg: Config) -> TrainingDiverged:
    latest = ckpt.latest_step()
    kept = (f"The last good checkpoint (step {latest}) in {ckpt.directory} is intact and a "
            f"rerun resumes from it" if latest is not None else
            f"No checkpoint had been saved yet (checkpoint_every={cfg.checkpoint_every}), so "
            f"a rerun starts from step 0")
    return TrainingDiverged(f"loss is {loss} at step {step}; stopping. {kept}: lower "
                            f"optimizer.lr or raise optimizer.warmup_steps and run again")


def _agreed(flag: bool) -> bool:
    """True on every process if any process got SIGTERM, so all save the same step together
    (a save is collective; one process saving while another steps on would hang)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _xla_flops(compiled) -> float | None:
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


def _step_line(record: dict, steps: int) -> str:
    """The log line of a logged step when there is no progress bar."""
    line = (f"step {record['step']}/{steps}: loss {record['loss']:.4f}, "
            f"{record['tokens_per_sec']:.0f} tok/s, lr {record['lr']:.3g}")
    if "mfu" in record:
        line += f", MFU {record['mfu']:.1%}"
    if record.get("reward") is not None:  # GRPO
        line += (f", reward {record['reward']:.3f}, completion length "
                 f"{record['completions/mean_length']:.1f}")
    if record.get("eval_reward") is not None:
        line += f", held-out reward {record['eval_reward']:.3f}"
    if "rewards/accuracies" in record:  # DPO
        line += (f", reward accuracy {record['rewards/accuracies']:.2f}, margin "
                 f"{record['rewards/margins']:.3f}")
    if record.get("eval_loss") is not None:
        line += f", held-out loss {record['eval_loss']:.4f}"
    if "eval_rewards/accuracies" in record:
        line += f" (reward accuracy {record['eval_rewards/accuracies']:.2f})"
    return line


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm  # disabled: update, set_postfix and close do nothing
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                disable=not enabled)
