"""TensorBoard event files in the run directory, beside metrics.jsonl (``log_tensorboard``).

Written with tensorboardX (a maintained event writer that needs neither TensorFlow nor the
tensorboard server). Every numeric scalar of a metrics record becomes a scalar series under
its key (``train/loss``, ``train/eval_loss``, ...); lists (an MoE's per-expert load) are
skipped. A resumed run passes its start step as ``purge_step``: events of the steps it runs
again are hidden, so each step shows once, as in metrics.jsonl.
"""
from __future__ import annotations

import numbers


class TensorBoardLog:
    """Appends metrics records to event files in ``workdir``; disabled: every call a no-op.

    Args:
      workdir: the run directory (``tensorboard --logdir WORKDIR``).
      start: the step this run starts after (0 for a fresh run).
    """

    def __init__(self, workdir: str, start: int, enabled: bool = True):
        self.writer = None
        if enabled:
            try:
                # optional: a run with log_tensorboard=false needs no tensorboardX
                from tensorboardX import SummaryWriter
            except ImportError as e:
                raise ImportError("log_tensorboard needs tensorboardX: pip install "
                                  "tensorboardX, or set log_tensorboard=false") from e
            self.writer = SummaryWriter(logdir=workdir, purge_step=start + 1 if start else None,
                                        flush_secs=30)

    def append(self, record: dict) -> None:
        if self.writer is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, numbers.Real) and value is not None:
                self.writer.add_scalar(f"train/{key}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Tee:
    """Sends each record to several logs (metrics.jsonl first, then TensorBoard)."""

    def __init__(self, *logs):
        self.logs = logs

    def append(self, record: dict) -> None:
        for log in self.logs:
            log.append(record)
