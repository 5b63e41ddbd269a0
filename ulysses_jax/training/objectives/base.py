"""What the training loop needs from an objective, and the batch fields it declares.

An ``Objective`` is built from the run's config and answers everything that differs between
objectives: the batch fields beside the token fields (``fields``), the loss the train step
differentiates (``loss``), how micro-batches of an accumulated step weigh (``weighting``),
the held-out program (``eval_sums``), the FLOPs factor, what it holds beside the
step (``resident_bytes``), the start-up lines, and the run's
batch source (``open`` before the train state exists, ``batches`` once it does). The loop
(``loop.py``) and the train step read only this interface.

A batch source (what ``open`` returns) keeps the data position a checkpoint saves
(``get_state``, ``set_state``). The step batches (what ``batches`` returns) give each step's
sharded batch, the step's extra record fields and the held-out metrics (``StepBatches``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

from ...config import Config

SEQUENCE, TOKEN = "sequence", "token"


@dataclasses.dataclass(frozen=True)
class Field:
    """A batch field beside the token fields (data.text.FIELDS): one value per sequence of
    the step (``config.rows_per_batch`` of them, a row each unpacked, however many rows
    they are packed into; sharded over "data") or per token ([B, S], laid out like the
    tokens)."""
    name: str
    per: str = TOKEN
    dtype: Any = np.float32


class StepBatches(Protocol):
    """The loop's view of a run's data once the train state exists."""

    def next(self, step: int, params) -> dict:
        """Step ``step``'s global batch, sharded (``params``: the state's, for sampling)."""

    def record(self, step: int, times: dict) -> dict:
        """Fields the step's metrics record adds (``times``: ``batch_s``, ``train_s``)."""

    def evaluate(self, params) -> dict:
        """Held-out metrics, flat, each named ``eval_*`` (or ``heldout_*``); {} for none."""


class Objective:
    """The base of every objective; ``cfg`` is the run's resolved config."""

    name = ""
    weighting = "tokens"  # accumulate.py: "tokens", "equal" (1/k each) or "sum" (1 each)
    heldout = "eval_loss"  # the held-out metric the run's summary reports

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # -- the batch and the step --------------------------------------------------------

    def fields(self) -> tuple[Field, ...]:
        """The fields the objective's batches bring beside the token fields."""
        return ()

    def metrics(self) -> tuple[str, ...]:
        """The train step's metrics, beside the loop's own, that a step's record logs."""
        return ()

    def loss(self, graphdef, params, batch: dict, mesh, weights: tuple | None = None):
        """``(objective, (reported loss, metrics))`` of ``batch``: what the train step
        differentiates; ``weights`` (w_loss, w_aux) for a micro-batch of an accumulated step
        (accumulate.py). metrics hold ``tokens`` (the counted tokens) at least."""
        raise NotImplementedError

    def reported_loss(self, step: int, metrics: dict):
        """The step's loss as the run reports it (a device scalar of ``metrics``)."""
        return metrics["loss"]

    def eval_sums(self, graphdef, params, batch: dict, mesh):
        """The held-out program's outputs for one batch (the step batches reduce them)."""
        raise NotImplementedError

    def flops_factor(self) -> float:
        """Model FLOPs of a step relative to one training pass over its rows."""
        return 1.0

    def resident_bytes(self, mesh, abstract_state: dict) -> dict[str, int]:
        """Bytes per device the objective keeps on the devices beside the train step across
        steps, by part (``fit.py`` adds them to the compiled step's): {} for none."""
        return {}

    # -- lines of the log --------------------------------------------------------------

    def batch_line(self) -> str:
        """The start-up line on the batch: per optimizer step, per micro-batch and per data
        replica at a time."""
        cfg = self.cfg
        k, s, b = cfg.grad_accum_steps, cfg.seq_len, cfg.batch_size
        seqs = lambda n: f"{n} sequence{'s' * (n != 1)}"  # noqa: E731
        micro = "" if k == 1 else (f" in grad_accum_steps={k} micro-batches of "
                                   f"{seqs(b // k)} = {b // k * s:,} tokens")
        return (f"batch: {seqs(b)} = {b * s:,} tokens per optimizer step{micro}; "
                f"{seqs(b // k // cfg.mesh.data)} per data replica at a time")

    def line(self, record: dict) -> str:
        """What a step's log line adds to the loop's (loss, tokens/s, lr, MFU)."""
        if record.get("eval_loss") is not None:
            return f", held-out loss {record['eval_loss']:.4f}"
        return ""

    def done_line(self, summary: dict) -> str:
        return (f"done: step {summary['step']}, loss {summary['loss']}, held-out loss "
                f"{summary.get('eval_loss')}")

    # -- the data ----------------------------------------------------------------------

    def open(self, mesh, workdir: str) -> tuple[Config, Any]:
        """The run's batch source (checked, before anything is compiled) and the config it
        implies (the data can bound the packed attention's segments): ``(cfg, source)``."""
        raise NotImplementedError

    def batches(self, source, mesh, layout: tuple, state: dict, start: int,
                workdir: str, progress: bool) -> StepBatches:
        """The step batches over ``source``, once the train state exists (``layout``:
        graphdef, shardings)."""
        raise NotImplementedError
