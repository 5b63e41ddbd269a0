"""The training loop behind train.py: data, sharded state, checkpoints, metrics, dry runs.

``train(cfg, workdir)`` runs (or resumes) a run in ``workdir``: ``checkpoints/`` holds Orbax
checkpoints (train state + data-iterator position), ``metrics.jsonl`` one JSON object per
logged step, ``config.yaml`` the resolved config. A run resumes from its latest checkpoint,
also on a different mesh (the state is restored straight into the new layout). SIGTERM saves a
checkpoint and returns; a non-finite loss stops the run before anything is saved after it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time

import jax
import numpy as np

from . import data as data_lib
from .checkpoint import Checkpointer
from .flops import train_step_flops
from ..config import Config, ConfigError, to_dict, to_yaml, validate
from ..hlo import collective_counts
from ..models.loss import largest_divisor_at_most
from ..mesh import make_mesh
from .train_step import (batch_shardings, init_state, make_eval_step, make_train_step,
                         param_count, state_layout)

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def _is_main() -> bool:
    return jax.process_index() == 0


def _log(msg: str) -> None:
    if _is_main():
        print(msg, flush=True)


def _scalar(x) -> float:
    """A float from a replicated global array (works when it spans several processes)."""
    return float(np.asarray(x.addressable_data(0)))


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


_RUNTIME_FIELDS = ("dtype", "remat", "attn_impl", "loss_chunk", "vocab_parallel", "mlp_chunk",
                   "init_std", "moe_capacity_factor")


def _runtime_options(cfg: Config) -> dict:
    """The run's own model options, kept when the model's shape comes from a checkpoint."""
    return {k: getattr(cfg.model, k) for k in _RUNTIME_FIELDS} | {"max_seq_len": cfg.seq_len}


def resolve_init_from(cfg: Config) -> Config:
    """With ``init_from``, the model's shape comes from the checkpoint's config.json (the
    run's model options in ``_RUNTIME_FIELDS`` are kept) and its tokenizer.json is used unless
    ``data.tokenizer`` names another."""
    if not cfg.init_from:
        return cfg
    from ..hf import config_from_hf, read_config  # lazy: only fine-tuning needs it
    try:
        model = config_from_hf(read_config(cfg.init_from), **_runtime_options(cfg))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from {cfg.init_from!r}: {e}") from None
    data = cfg.data
    tokenizer_json = os.path.join(cfg.init_from, "tokenizer.json")
    if data.tokenizer is None and os.path.exists(tokenizer_json):
        data = dataclasses.replace(data, tokenizer=tokenizer_json)
    cfg = dataclasses.replace(cfg, model=model, data=data)
    validate(cfg)
    return cfg


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
    return make_mesh(seq=cfg.mesh.seq, data=cfg.mesh.data, ring=cfg.mesh.ring, devices=devices)


def token_order(cfg: Config) -> np.ndarray | None:
    """The order batches are loaded in: zigzag on a ring mesh (balanced causal work), else
    natural (None). The loss is a sum over tokens, so the order does not change it."""
    if cfg.mesh.ring == 1:
        return None
    from ..attention.ring import zigzag_permutation
    return zigzag_permutation(cfg.seq_len, cfg.mesh.ring)


def _abstract_batch(cfg: Config, mesh):
    shape = (cfg.batch_size, cfg.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, np.float32 if k == "loss_mask" else np.int32,
                                    sharding=s) for k, s in batch_shardings(mesh).items()}


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


def compile_step(cfg: Config):
    """The train step compiled for ``cfg``'s mesh from abstract shapes (nothing allocated).

    Returns:
      (the compiled step, the abstract train state it takes).
    """
    mesh = build_mesh(cfg)
    graphdef, abstract, shardings, tx = state_layout(cfg, mesh)
    step = make_train_step(cfg, mesh, graphdef, tx, shardings)
    return step.lower(abstract, _abstract_batch(cfg, mesh)).compile(), abstract


def peak_bytes_per_device(compiled) -> int:
    """XLA's per-device peak of a compiled program: its reported peak, or live buffers
    (arguments + outputs + temporaries - aliased) where that is larger or not reported."""
    mem = compiled.memory_analysis()
    live = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    return int(max(getattr(mem, "peak_memory_in_bytes", 0) or 0, live))


def dry_run(cfg: Config) -> dict:
    """Compiles the train step for the configured mesh without allocating or training.

    Returns:
      A dict with ``peak_bytes_per_device`` (XLA's memory analysis), ``flops_per_device``
      (the model's FLOPs per step and device, ``flops.py``), ``xla_flops_per_device`` (XLA's
      cost analysis of the partitioned step: loop bodies counted once, custom calls not at
      all, so not a FLOP count), ``collectives`` (op -> count in the compiled HLO) and the
      parts of the memory estimate.
    """
    cfg = resolve_init_from(cfg)
    t0 = time.time()
    compiled, abstract = compile_step(cfg)
    mem = compiled.memory_analysis()
    return {
        "peak_bytes_per_device": peak_bytes_per_device(compiled),
        "flops_per_device": model_flops_per_device(cfg),
        "xla_flops_per_device": _xla_flops(compiled) or 0.0,
        "collectives": collective_counts(compiled.as_text()),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "params": param_count(abstract["params"]),
        "mesh": {"data": cfg.mesh.data, "ring": cfg.mesh.ring, "seq": cfg.mesh.seq},
        "seq_len": cfg.seq_len, "batch_size": cfg.batch_size,
        "compile_seconds": round(time.time() - t0, 2),
        "notes": chunk_notes(cfg),
    }


def model_flops_per_device(cfg: Config) -> float:
    """Model FLOPs of one step on each device (``flops.train_step_flops`` / devices)."""
    devices = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    return train_step_flops(cfg.model, cfg.batch_size, cfg.seq_len) / devices


def _load_data(cfg: Config):
    """Train and held-out rows; a bad data.* setting is a ConfigError (clean CLI exit)."""
    try:
        tokenizer = data_lib.load_tokenizer(cfg.data.tokenizer)
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but "
                              f"model.vocab_size is {cfg.model.vocab_size}")
        return data_lib.build_rows(cfg.data.source, tokenizer, cfg.seq_len,
                                   cfg.data.heldout_fraction, cfg.seed)
    except ConfigError:
        raise
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.source {cfg.data.source!r} / data.tokenizer "
                          f"{cfg.data.tokenizer!r}: {e}") from None


def with_segment_bound(cfg: Config, train_rows, held_rows) -> Config:
    """``model.max_segments`` resolved: as given, or (0) from the data: 1.5 x the most
    documents any row of the first epoch holds (padding counts as one), rounded up to a
    multiple of 8. It sizes cuDNN's packed-layout arguments; rows with more still run
    exactly, through the fallback kernel (``attention/cudnn.py``)."""
    most = max(int(rows.segments_per_row(0, cfg.seed).max())
               for rows in (train_rows, held_rows) if rows is not None)
    bound = cfg.model.max_segments or 8 * math.ceil(1.5 * most / 8)
    _log(f"data: up to {most} documents per row in the first epoch; packed attention "
         f"bound model.max_segments={bound}"
         f"{'' if cfg.model.max_segments else ' (from the data)'}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_segments=bound))


def _evaluate(eval_step, params, held_rows, cfg: Config, mesh) -> float | None:
    if held_rows is None or cfg.eval_batches < 1:
        return None
    total, count = 0.0, 0.0
    for batch in data_lib.eval_batches(held_rows, cfg.batch_size, cfg.eval_batches):
        loss, n = eval_step(params, data_lib.shard_batch(batch, mesh, order=token_order(cfg)))
        total += _scalar(loss) * _scalar(n)
        count += _scalar(n)
    return total / count if count else None


class _Preemption:
    """Turns SIGTERM into a flag the loop checks after each step."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling
            self._old = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def train(cfg: Config, workdir: str, *, progress: bool = True) -> dict:
    """Trains (or resumes) up to ``cfg.steps`` optimizer steps in ``workdir``.

    Returns:
      A summary dict: ``status`` ("done", "preempted"), ``step``, ``loss``, ``eval_loss``.

    Raises:
      ConfigError: a config that cannot run on these devices.
      TrainingDiverged: the loss became NaN or infinite (the last checkpoint is left intact).
    """
    cfg = resolve_init_from(cfg)
    mesh = build_mesh(cfg)
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    _log(f"resolved config:\n{to_yaml(cfg)}")
    for note in chunk_notes(cfg):
        _log(f"note: {note}")
    if _is_main():
        with open(os.path.join(workdir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    train_rows, held_rows = _load_data(cfg)
    cfg = with_segment_bound(cfg, train_rows, held_rows)
    batches = data_lib.BatchIterator(train_rows, cfg.batch_size, cfg.seed)
    _log(f"data: {train_rows.num_rows} train rows of {cfg.seq_len} tokens"
         f"{'' if held_rows is None else f', {held_rows.num_rows} held-out rows'}; "
         f"mesh data={cfg.mesh.data} x ring={cfg.mesh.ring} x seq={cfg.mesh.seq} on "
         f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices")

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.keep_checkpoints,
                        save_every=cfg.checkpoint_every if cfg.checkpoint_every > 0 else None)
    start = ckpt.latest_step()
    if start is not None:
        graphdef, abstract, shardings, tx = state_layout(cfg, mesh)
        state, extra = ckpt.restore(abstract)
        try:
            batches.set_state(extra["data"])
        except ValueError as e:
            raise ConfigError(f"cannot resume {ckpt.directory}: {e}") from None
        _truncate_metrics(os.path.join(workdir, "metrics.jsonl"), start)
        _log(f"resumed from step {start} ({ckpt.directory})")
        if start >= cfg.steps:
            _log(f"this run already reached step {start} (steps={cfg.steps}); pass a larger "
                 f"steps=N to train further")
    else:
        params = _initial_params(cfg, mesh)
        graphdef, state, shardings, tx = init_state(cfg, mesh, params)
        start = 0
    _log(f"model: {param_count(state['params']) / 1e6:.2f}M parameters")

    if start >= cfg.steps:
        ckpt.close()
        return {"status": "done", "step": start, "loss": None, "eval_loss": None}

    step_fn = make_train_step(cfg, mesh, graphdef, tx, shardings)
    eval_fn = make_eval_step(mesh, graphdef, shardings)
    # Compile ahead of the loop: the loop runs this executable, timings exclude compilation,
    # and its cost analysis is per device (a lowered, unpartitioned program's is global).
    t0 = time.time()
    step_fn = step_fn.lower(_abstract(state), _abstract_batch(cfg, mesh)).compile()
    _log(f"compiled the train step in {time.time() - t0:.1f} s")
    flops = model_flops_per_device(cfg)
    xla_flops = _xla_flops(step_fn)
    device = mesh.local_devices[0]
    peak = peak_flops(device)
    _log(f"model FLOPs per step and device {flops:.3e} (XLA's cost analysis: "
         f"{xla_flops or 0:.3e}); "
         + (f"MFU against {peak / 1e12:.0f} TFLOP/s ({device.device_kind})" if peak else
            f"no MFU: peak FLOP/s of {getattr(device, 'device_kind', device.platform)!r} "
            f"unknown"))
    tokens_per_step = cfg.batch_size * cfg.seq_len
    order = token_order(cfg)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    summary = {"status": "done", "step": start, "loss": None, "eval_loss": None}

    def save(step, force=False):
        return ckpt.save(step, state, {"data": batches.get_state(), "config": to_dict(cfg)},
                         force=force)

    bar = _progress(cfg.steps, start, enabled=progress and _is_main())
    try:
        with _Preemption() as preempt:
            last_time, last_step = time.time(), start
            for step in range(start + 1, cfg.steps + 1):
                state, metrics = step_fn(state, batches.next_global(mesh, order))
                loss = _scalar(metrics["loss"])  # also waits for the step: honest timings
                if not math.isfinite(loss):
                    raise TrainingDiverged(
                        f"loss is {loss} at step {step}; stopping. The last good checkpoint "
                        f"(step {ckpt.latest_step()}) in {ckpt.directory} is intact: lower "
                        f"optimizer.lr or raise optimizer.warmup_steps and run again")
                summary.update(step=step, loss=loss)
                bar.update(1)
                final = step == cfg.steps
                evaluate = final or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
                if step % cfg.log_every == 0 or evaluate:
                    now = time.time()
                    dt = (now - last_time) / (step - last_step)
                    record = {"step": step, "loss": loss, "tokens_per_sec": tokens_per_step / dt,
                              "step_time": dt, "lr": _scalar(metrics["lr"]),
                              "grad_norm": _scalar(metrics["grad_norm"]),
                              "tokens": _scalar(metrics["tokens"])}
                    record["flops_per_device"] = flops
                    if xla_flops:
                        record["xla_flops_per_device"] = xla_flops
                    if peak:
                        record["mfu"] = flops / dt / peak
                    record.update(_moe_metrics(metrics))
                    record.update(_memory_in_use(device))
                    if evaluate:
                        record["eval_loss"] = _evaluate(eval_fn, state["params"], held_rows,
                                                        cfg, mesh)
                        summary["eval_loss"] = record["eval_loss"]
                    _write_metrics(metrics_path, record)
                    bar.set_postfix(loss=f"{loss:.4f}",
                                    tok_s=f"{record['tokens_per_sec']:.0f}",
                                    **({"mfu": f"{record['mfu']:.1%}"} if peak else {}))
                    last_time, last_step = time.time(), step
                if _agreed(preempt.requested):
                    save(step, force=True)
                    ckpt.wait()
                    _log(f"SIGTERM: saved step {step} to {ckpt.directory}; exiting")
                    summary["status"] = "preempted"
                    return summary
                if cfg.checkpoint_every > 0:
                    save(step)
            save(cfg.steps, force=True)
        _log(f"done: step {summary['step']}, loss {summary['loss']}, "
             f"held-out loss {summary['eval_loss']}")
        return summary
    finally:
        bar.close()
        ckpt.close()


def _agreed(flag: bool) -> bool:
    """True on every process if any process got SIGTERM, so all save the same step together
    (a save is collective; one process saving while another steps on would hang)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def _truncate_metrics(path: str, step: int) -> None:
    """Drops records past the checkpoint a run resumes from: those steps will be run again."""
    if not _is_main() or not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(kept)


def _initial_params(cfg: Config, mesh):
    if not cfg.init_from:
        return None
    from ..hf import load_params  # imported lazily: only fine-tuning needs it
    _, params = load_params(cfg.init_from, mesh, cfg.param_sharding, **_runtime_options(cfg))
    _log(f"initialised from Hugging Face checkpoint {cfg.init_from}")
    return params


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
    """An MoE model's router metrics (train_step.objective): ``moe_aux_loss``, ``moe_load``
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


def _write_metrics(path: str, record: dict) -> None:
    if _is_main():
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class _NoBar:
    def update(self, n): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)
