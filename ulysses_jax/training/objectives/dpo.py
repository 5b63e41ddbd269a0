"""Direct preference optimisation (``objective: dpo``), the loss of TRL's DPOTrainer.

A batch of 2B rows holds B pairs, rows 2i and 2i + 1 the chosen and rejected sequences of
pair i (``data/preference.py``). Each sequence's log-probability is the sum of its completion
tokens' log-probabilities: the chunked next-token loss of the SFT objective summed per row
(``loss.chunked_cross_entropy(per_row=True)``, or the vocabulary-parallel one), over each
device's tokens and then over the sequence devices, so no [B, S, V] logits exist and no token
crosses a device. With pi the policy's and r the reference's log-probabilities, c chosen and
l rejected, and d = (pi_c - r_c) - (pi_l - r_l), the per-pair losses are TRL's:

- ``sigmoid``: -log sigmoid(beta d), and with ``label_smoothing`` e (TRL's conservative DPO):
  -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d);
- ``hinge``: relu(1 - beta d);
- ``ipo``: (d' - 1 / (2 beta))^2, with d' = (pi_c - r_c) / n_c - (pi_l - r_l) / n_l, n the
  completions' token counts (TRL's length-normalised IPO).

The loss is their mean over the batch's pairs. Metrics (TRL's names): ``rewards/chosen`` and
``rewards/rejected`` (means of beta (pi - r)), ``rewards/accuracies`` (the fraction of pairs
whose chosen reward is the larger), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``.

The reference: ``base`` runs the same model with the LoRA adapters set to zero (exactly the
base: every adapter's delta is 0), without gradient; ``precompute`` reads the batch's
``ref_logps`` (each sequence's reference log-probability, recorded before step 1 by
``reference.py``).

With ``dpo.packing`` (the default) the step's sequences are packed into rows of seq_len, each
its own segment, first fit within each micro-batch (``data/row_packing.py``), and the batch
brings each token's sequence (``SEQUENCE_IDS``): a sequence's log-probability is then the sum
of its tokens' (``per_token``) over its segment, reduced over every device. The per-sequence
values (``ref_logps``, the losses) keep the unpacked order, so the loss, the metrics and the
gradients are the unpacked ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ...config import Config, ConfigError, DPOConfig, dpo_reference, rows_per_batch
from ...data import run_data, text as data_lib
from ...data.row_packing import SEQUENCE_IDS, pack_rows
from ...data.run_data import log
from ...mesh import DATA
from ...models import lora
from ..train_step import batch_shardings, params_for_compute, scalar, token_order
from . import reference
from .base import SEQUENCE, TOKEN, Field, Objective
from .sft import (RowBatches, RowSource, data_line, is_preference, next_token_loss, run_model,
                  with_router_loss)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def micro_sequences(cfg: Config) -> int:
    """The sequences of a micro-batch: of the train step's, the held-out program's and the
    reference pass's batches alike."""
    return rows_per_batch(cfg) // cfg.grad_accum_steps


def sequence_logps(graphdef, params, batch: dict, mesh: Mesh, sequences: int = 0):
    """Each sequence's summed log-probability of its masked targets, its count of them, and
    the model's MoE statistics (None for a dense model): a row's each, or of a packed batch
    (one with ``SEQUENCE_IDS``) its ``sequences`` sequences'.

    Returns:
      (logps [2B], counts [2B], stats): fp32 (a row's each: sharded over "data").
    """
    model, hidden, head, stats = run_model(graphdef, params, batch)
    if SEQUENCE_IDS not in batch:
        nll, counts = next_token_loss(model, hidden, head, batch, mesh, per_row=True)
        return -nll, counts, stats
    nll = next_token_loss(model, hidden, head, batch, mesh, per_token=True)  # [R, S]
    ids, mask = batch[SEQUENCE_IDS], batch["loss_mask"].astype(jnp.float32)
    return (-segment_sums(nll, ids, sequences), segment_sums(mask, ids, sequences), stats)


def segment_sums(values, ids, n: int):
    """[n]: the sums of ``values`` [R, S] over each sequence's tokens (``ids`` [R, S]: 1 ...
    n, 0 on padding), over every device. A compare and a sum, not a matmul: exact in fp32
    on any backend."""
    mine = ids[..., None] == jnp.arange(1, n + 1)                            # [R, S, n]
    return jnp.sum(jnp.where(mine, values[..., None], 0.0), axis=(0, 1))


def pair_losses(logps, ref_logps, counts, d: DPOConfig):
    """Per-pair losses and the metrics' per-pair terms from per-row values [2B] (chosen and
    rejected rows interleaved).

    Returns:
      (losses [B], terms): terms maps each of ``METRICS`` to its per-pair values [B].
    """
    pi, ref, n = (x.reshape(-1, 2) for x in (logps, ref_logps, counts))
    ratio = pi - ref                                                     # [B, 2]
    delta = ratio[:, 0] - ratio[:, 1]
    if d.loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(d.beta * delta)
        if d.label_smoothing:
            losses = ((1 - d.label_smoothing) * losses
                      - d.label_smoothing * jax.nn.log_sigmoid(-d.beta * delta))
    elif d.loss_type == "hinge":
        losses = jax.nn.relu(1 - d.beta * delta)
    elif d.loss_type == "ipo":
        per_token = ratio / jnp.maximum(n, 1.0)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * d.beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type {d.loss_type!r}")
    rewards = d.beta * jax.lax.stop_gradient(ratio)
    terms = {"rewards/chosen": rewards[:, 0], "rewards/rejected": rewards[:, 1],
             "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
             "rewards/margins": rewards[:, 0] - rewards[:, 1],
             "logps/chosen": jax.lax.stop_gradient(pi[:, 0]),
             "logps/rejected": jax.lax.stop_gradient(pi[:, 1])}
    return losses, terms


def reference_logps(cfg: Config, graphdef, params, batch: dict, mesh: Mesh):
    """The reference's per-sequence log-probabilities [2B] (no gradient): the batch's
    ``ref_logps`` (precompute), or the model with the LoRA adapters zeroed (base)."""
    if dpo_reference(cfg) == "precompute":
        return batch["ref_logps"]
    base = lora.without_adapters(params)
    logps, _, _ = sequence_logps(graphdef, jax.lax.stop_gradient(base), batch, mesh,
                                 micro_sequences(cfg))
    return jax.lax.stop_gradient(logps)


def objective(cfg: Config, graphdef, params, batch: dict, mesh: Mesh,
              weights: tuple | None = None):
    """``sft.objective``'s contract for DPO: (objective, (DPO loss, metrics)).

    Args:
      weights: (w_loss, w_aux) of a micro-batch of an accumulated step (accumulate.py).

    The objective is the mean pair loss plus, for an MoE model, ``router_aux_loss_coef`` x the
    policy's load-balancing loss (as in SFT). metrics: ``tokens`` (completion tokens), the
    ``METRICS`` (means over the pairs) and MoE's ``moe_*``.
    """
    ref = reference_logps(cfg, graphdef, params, batch, mesh)
    logps, counts, stats = sequence_logps(graphdef, params, batch, mesh, micro_sequences(cfg))
    losses, terms = pair_losses(logps, ref, counts, cfg.dpo)
    metrics = {"tokens": jnp.sum(counts), **{k: jnp.mean(v) for k, v in terms.items()}}
    return with_router_loss(cfg.model, jnp.mean(losses), metrics, stats, weights)


def eval_sums(cfg: Config, graphdef, params, batch: dict, mesh: Mesh):
    """Held-out sums over a batch's real pairs (padding pairs, with no completion token, are
    left out): (summed loss, pairs the chosen reward wins, pairs, summed margin)."""
    ref = reference_logps(cfg, graphdef, params, batch, mesh)
    logps, counts, _ = sequence_logps(graphdef, params, batch, mesh, micro_sequences(cfg))
    losses, terms = pair_losses(logps, ref, counts, cfg.dpo)
    real = (counts.reshape(-1, 2)[:, 0] > 0).astype(jnp.float32)
    return (jnp.sum(losses * real), jnp.sum(terms["rewards/accuracies"] * real),
            jnp.sum(real), jnp.sum(terms["rewards/margins"] * real))


def shard_pairs(cfg: Config, mesh: Mesh, rows: dict, micro: int = 1) -> dict:
    """A batch of pairs' rows (numpy FIELDS [2b, S], rows 2i and 2i + 1 pair i's chosen and
    rejected, and ``ref_logps`` [2b] where recorded) as a step reads it: with
    ``dpo.packing`` the sequences packed (each of ``micro`` micro-batches apart) with their
    ``SEQUENCE_IDS``; sharded, the tokens in the model's order, ``ref_logps`` per sequence
    over "data"."""
    order = token_order(cfg)
    if not cfg.dpo.packing:
        return data_lib.shard_batch(rows, mesh, order=order,
                                    row_fields=[f for f in ("ref_logps",) if f in rows])
    packed = pack_rows({f: rows[f] for f in data_lib.FIELDS}, mesh.shape[DATA], micro,
                       sequence_ids=True)
    out = data_lib.shard_batch(packed, mesh, order=order, token_fields=(SEQUENCE_IDS,))
    if "ref_logps" in rows:
        ref = rows["ref_logps"]
        out["ref_logps"] = jax.make_array_from_callback(
            ref.shape, batch_shardings(mesh, cfg)["ref_logps"], lambda i: ref[i])
    return out


class DPOBatches(RowBatches):

    def next(self, step: int, params) -> dict:
        """The next batch of pairs, packed with ``dpo.packing`` (each micro-batch apart)."""
        if not self.cfg.dpo.packing:
            return super().next(step, params)
        return shard_pairs(self.cfg, self.mesh, next(self.source.iterator),
                           self.cfg.grad_accum_steps)

    def record(self, step: int, times: dict) -> dict:
        """The step's own times: ``batch_s`` (reading and packing its batch) and ``train_s``
        (its update; a logged step_time also holds the compile of a new row count)."""
        return {"batch_s": times["batch_s"], "train_s": times["train_s"]}

    def evaluate(self, params) -> dict:
        """Held-out DPO loss, reward accuracy and margin over ``cfg.eval_batches`` batches
        of pairs (a micro-batch at a time), as means over the pairs: ``eval_loss``,
        ``eval_rewards/accuracies``, ``eval_rewards/margins``, ``eval_pairs``."""
        cfg, held = self.cfg, self.source.held
        if held is None or cfg.eval_batches < 1:
            return {"eval_loss": None}
        k = cfg.grad_accum_steps
        sums = np.zeros(4)
        for batch in data_lib.eval_batches(held, 2 * cfg.batch_size // k,
                                           cfg.eval_batches * k):
            sharded = shard_pairs(cfg, self.mesh, batch)
            sums += [scalar(x) for x in self.eval_step(params, sharded)]
        loss, won, pairs, margin = sums
        if not pairs:
            return {"eval_loss": None}
        return {"eval_loss": loss / pairs, "eval_rewards/accuracies": won / pairs,
                "eval_rewards/margins": margin / pairs, "eval_pairs": int(pairs)}


class DPO(Objective):
    """``objective: dpo``: the preference loss of a preference store's pairs, two rows each
    (chosen, rejected), packed with ``dpo.packing``; with ``dpo.reference=precompute`` each
    sequence's reference log-probability recorded before step 1 (``reference.py``)."""

    name = "dpo"
    weighting = "equal"  # a mean over pairs: each micro-batch 1/k

    def fields(self):
        out = ()
        if dpo_reference(self.cfg) == "precompute":
            out += (Field("ref_logps", SEQUENCE),)
        if self.cfg.dpo.packing:
            out += (Field(SEQUENCE_IDS, TOKEN, np.int32),)
        return out

    def metrics(self):
        return METRICS

    def loss(self, graphdef, params, batch, mesh, weights=None):
        return objective(self.cfg, graphdef, params, batch, mesh, weights)

    def eval_sums(self, graphdef, params, batch, mesh):
        return eval_sums(self.cfg, graphdef, params, batch, mesh)

    def flops_factor(self) -> float:
        """Two sequences per pair are the rows; with ``dpo.reference=base`` each step also
        runs the reference's forward pass, a third of a training pass (forward 1 : backward
        2)."""
        return 4 / 3 if dpo_reference(self.cfg) == "base" else 1.0

    def batch_line(self) -> str:
        cfg = self.cfg
        k, s, b = cfg.grad_accum_steps, cfg.seq_len, cfg.batch_size
        pairs = lambda n: f"{n} pair{'s' * (n != 1)} ({2 * n} sequences)"  # noqa: E731
        micro = "" if k == 1 else (f" in grad_accum_steps={k} micro-batches of "
                                   f"{pairs(b // k)}")
        tokens = (f"packed into the rows of {s} tokens they fill (at most {2 * b * s:,} "
                  f"tokens)" if cfg.dpo.packing else f"= {2 * b * s:,} tokens")
        return (f"batch: {pairs(b)} {tokens} per optimizer step{micro}; "
                f"{pairs(b // k // cfg.mesh.data)} per data replica at a time")

    def line(self, record: dict) -> str:
        out = ""
        if "rewards/accuracies" in record:
            out += (f", reward accuracy {record['rewards/accuracies']:.2f}, margin "
                    f"{record['rewards/margins']:.3f}")
        out += super().line(record)
        if "eval_rewards/accuracies" in record:
            out += f" (reward accuracy {record['eval_rewards/accuracies']:.2f})"
        return out

    def open(self, mesh, workdir: str):
        cfg = self.cfg
        train_rows, held_rows = run_data.load_data(cfg)
        if not is_preference(train_rows):
            store = getattr(train_rows, "store", None)
            what = (f"a {store.manifest['kind']} store" if store is not None else
                    "text files, tokenized on the fly")
            raise ConfigError(f"objective=dpo trains on preference pairs, but data.source "
                              f"{cfg.data.source!r} is {what}; prepare one with python -m "
                              f"ulysses_jax.data prepare SRC --preference --out STORE")
        if cfg.dpo.packing:  # the attention's segment bound counts the packed rows'
            k, rows = cfg.grad_accum_steps, rows_per_batch(cfg)
            train_rows.packed = (rows, mesh.shape[DATA], k)
            if held_rows is not None:
                held_rows.packed = (rows // k, mesh.shape[DATA], 1)
        cfg = run_data.with_segment_bound(cfg, train_rows, held_rows)
        iterator = data_lib.BatchIterator(train_rows, rows_per_batch(cfg), cfg.seed)
        log(data_line(cfg, mesh, train_rows, held_rows))
        return cfg, RowSource(iterator, train_rows, held_rows)

    def batches(self, source, mesh, layout, state, start, workdir, progress):
        if dpo_reference(self.cfg) == "precompute" and start < self.cfg.steps:
            self._precompute(source, mesh, layout, state, start, workdir, progress)
        return DPOBatches(self, source, mesh, layout)

    def _precompute(self, source, mesh, layout, state, start, workdir, progress) -> None:
        """The reference log-probabilities of every pair (``reference.py``), attached to the
        rows the batches read."""
        cfg, (graphdef, shardings) = self.cfg, layout
        prepare = params_for_compute(cfg, shardings)
        fields = {k: v for k, v in batch_shardings(mesh, cfg).items() if k != "ref_logps"}
        program = jax.jit(lambda p, b: sequence_logps(graphdef, prepare(p), b, mesh,
                                                      micro_sequences(cfg))[0],
                          in_shardings=(shardings["params"], fields))
        logps = lambda p, rows: program(p, shard_pairs(cfg, mesh, rows))  # noqa: E731
        rows = [r for r in (source.train, source.held) if r is not None]
        try:
            ref = reference.load_or_compute(cfg, logps, state["params"], rows, workdir,
                                            start, progress)
        except reference.ReferenceError as e:
            raise ConfigError(str(e)) from None
        for r in rows:
            r.attach_reference(ref)


OBJECTIVE = DPO
