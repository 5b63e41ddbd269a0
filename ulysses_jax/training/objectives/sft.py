"""``objective: sft`` (the default): the mean next-token loss over the supervised tokens,
plus an MoE model's router loss; the pieces DPO and GRPO build on (``run_model``,
``next_token_loss``, ``with_router_loss``), and the batches of a run over ``data.source``'s
rows (``RowSource``, ``RowBatches``), which DPO shares."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ...config import Config, ConfigError, rows_per_batch
from ...data import run_data, text as data_lib, vision_batches
from ...data.run_data import log
from ...families import family
from ...models import vocab
from ...models.loss import chunked_cross_entropy
from ...models.moe import aux_loss
from ..position_loss import bucket_bounds, bucket_sums, token_losses
from ..train_step import host, make_eval_step, params_for_compute, scalar, token_order
from .base import Objective


def objective(graphdef, params, batch, mesh: Mesh, weights: tuple | None = None):
    """What training minimises, with the loss and metrics it reports.

    Args:
      weights: (w_ce, w_aux), for a micro-batch of an accumulated step (accumulate.py): the
        objective is then w_ce x the mean next-token loss + w_aux x the router term.

    Returns:
      (objective, (cross-entropy, metrics)): the objective is the mean next-token loss plus,
      for an MoE model, ``router_aux_loss_coef`` x the load-balancing loss (moe.aux_loss, as
      transformers' Qwen3MoeForCausalLM adds it). metrics: ``tokens`` (counted tokens) and,
      for MoE, ``moe_aux_loss``, ``moe_load`` [E] (fraction of assignments per expert,
      pooled over MoE layers) and ``moe_dropped`` (fraction of assignments dropped).
    """
    model, hidden, head, stats = run_model(graphdef, params, batch)
    loss, count = next_token_loss(model, hidden, head, batch, mesh)
    return with_router_loss(model.cfg, loss, {"tokens": count}, stats, weights)


def run_model(graphdef, params, batch):
    """(model, final hidden states [B, S, D], the head [D, V] to apply, MoE statistics or
    None) of ``batch``."""
    model = nnx.merge(graphdef, params)
    hidden, stats = model.hidden_and_stats(batch["tokens"], batch["positions"],
                                           batch["segment_ids"], batch.get("vision"))
    return model, hidden, model.head_weight(), stats


def next_token_loss(model, hidden, head, batch, mesh: Mesh, per_row: bool = False,
                    per_token: bool = False, entropy: bool = False):
    """The chunked next-token loss of ``batch``'s masked targets (vocabulary-parallel when
    the model is): (mean, count) fp32 scalars, or with ``per_row`` each row's (sum, count),
    [B] each, or with ``per_token`` every token's loss [B, S] (and with ``entropy`` every
    token's entropy, [B, S]) (``loss.chunked_cross_entropy``)."""
    args = (batch["targets"], batch["loss_mask"])
    with jax.named_scope("loss"):
        if model.vocab_parallel:
            return vocab.cross_entropy(hidden, head, *args, mesh=mesh,
                                       chunk=model.cfg.loss_chunk,
                                       softcap=model.cfg.final_softcap, per_row=per_row,
                                       per_token=per_token, entropy=entropy)
        return chunked_cross_entropy(hidden, head.astype(model.dtype), *args, mesh=mesh,
                                     chunk=model.cfg.loss_chunk,
                                     softcap=model.cfg.final_softcap, per_row=per_row,
                                     per_token=per_token, entropy=entropy)


def with_router_loss(cfg, loss, metrics: dict, stats, weights: tuple | None):
    """(objective, (loss, metrics)): ``loss`` (weighted by ``weights[0]`` in an accumulated
    step) plus, for an MoE model (``stats``), ``router_aux_loss_coef`` x its load-balancing
    loss (weighted by ``weights[1]``), with the ``moe_*`` metrics added."""
    if stats is None:
        return (loss if weights is None else weights[0] * loss), (loss, metrics)
    aux = aux_loss(stats, cfg.num_experts)
    assignments = jnp.maximum(stats["tokens"] * cfg.num_experts_per_tok, 1.0)
    metrics.update(moe_aux_loss=aux, moe_load=stats["load"] / assignments,
                   moe_dropped=stats["dropped"] / assignments)
    if weights is None:
        return loss + cfg.router_aux_loss_coef * aux, (loss, metrics)
    return weights[0] * loss + weights[1] * cfg.router_aux_loss_coef * aux, (loss, metrics)


def loss_fn(graphdef, params, batch, mesh: Mesh):
    """Mean next-token loss of ``batch`` (dict of [B, S] arrays) and its token count.

    Vocabulary-parallel (vocab.py) when the model is: each device holds V/P columns of the
    head, in fp32. Otherwise the head enters the loss replicated, in the compute dtype (with
    bf16 compute the copy each device holds of the [D, V] head is then half the size).
    The cross-entropy only: the objective of an MoE model adds the router loss
    (``objective``)."""
    _, (loss, metrics) = objective(graphdef, params, batch, mesh)
    return loss, metrics["tokens"]


def is_preference(rows) -> bool:
    """Whether ``rows`` come from a preference store (prompt, chosen, rejected pairs)."""
    store = getattr(rows, "store", None)
    return store is not None and store.preference


def data_line(cfg: Config, mesh: Mesh, train_rows, held_rows) -> str:
    """The start-up line of a run over ``data.source``'s rows: the rows and the mesh."""
    return (f"data: {train_rows.num_rows} train rows of {cfg.seq_len} tokens"
            f"{'' if held_rows is None else f', {held_rows.num_rows} held-out rows'}; "
            f"mesh data={cfg.mesh.data} x ring={cfg.mesh.ring} x seq={cfg.mesh.seq} on "
            f"{mesh.devices.size} {mesh.devices.flat[0].platform} devices")


@dataclasses.dataclass
class RowSource:
    """The rows of a run that reads ``data.source``: the train rows' iterator (its position
    is the checkpoint's data state) and the held-out rows (or None)."""
    iterator: Any
    train: Any
    held: Any

    def get_state(self) -> dict:
        return self.iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.iterator.set_state(state)


class RowBatches:
    """The step batches of a run over ``data.source``'s rows: the iterator's next batch, in
    the model's token order, and the held-out program (``Objective.eval_sums``)."""

    def __init__(self, objective: Objective, source: RowSource, mesh: Mesh, layout: tuple):
        graphdef, shardings = layout
        self.cfg, self.source, self.mesh = objective.cfg, source, mesh
        self.order = token_order(self.cfg)
        self.eval_step = make_eval_step(mesh, graphdef, shardings, objective)
        self.layout = layout

    def next(self, step: int, params) -> dict:
        return self.source.iterator.next_global(self.mesh, self.order)

    def record(self, step: int, times: dict) -> dict:
        return {}

    def evaluate(self, params) -> dict:
        raise NotImplementedError


class SFTBatches(RowBatches):

    def __init__(self, objective, source, mesh, layout):
        super().__init__(objective, source, mesh, layout)
        graphdef, shardings = layout
        self.position_step = token_losses(mesh, graphdef, self.cfg.model.loss_chunk,
                                          prepare=params_for_compute(self.cfg, shardings))

    def evaluate(self, params) -> dict:
        """``eval_loss``: the held-out loss over ``cfg.eval_batches`` batches (a micro-batch
        at a time), and ``heldout_loss_by_position``: the loss by position in the document,
        log-spaced buckets [0, 1), [1, 2), [2, 4), ... up to seq_len (``bucket_bounds``), with
        token counts (a bucket without tokens has loss None)."""
        cfg, held, mesh = self.cfg, self.source.held, self.mesh
        if held is None or cfg.eval_batches < 1:
            return {"eval_loss": None}
        bounds = bucket_bounds(cfg.seq_len)
        sums, counts = np.zeros(len(bounds) - 1), np.zeros(len(bounds) - 1)
        total, count = 0.0, 0.0
        if family(cfg.model.family).vision:
            batches = vision_batches.media_eval_batches(held, cfg, run_data.pixel_options(held),
                                                        mesh)
        else:  # the same rows, one micro-batch at a time (grad_accum_steps)
            k = cfg.grad_accum_steps
            batches = (data_lib.shard_batch(batch, mesh, order=self.order)
                       for batch in data_lib.eval_batches(held, cfg.batch_size // k,
                                                          cfg.eval_batches * k))
        for sharded in batches:
            loss, n = self.eval_step(params, sharded)
            total += scalar(loss) * scalar(n)
            count += scalar(n)
            losses, _ = self.position_step(params, sharded)
            positions = host(sharded["positions"])
            if positions.ndim == 3:  # M-RoPE: the loss by token index in the document
                positions = vision_batches.token_index(host(sharded["segment_ids"]))
            s, c = bucket_sums(host(losses), positions, host(sharded["loss_mask"]), bounds)
            sums, counts = sums + s, counts + c
        by_position = {"bounds": bounds, "tokens": counts.astype(int).tolist(),
                       "loss": [float(a / b) if b else None for a, b in zip(sums, counts)]}
        return {"eval_loss": total / count if count else None,
                "heldout_loss_by_position": by_position}


class SFT(Objective):
    """``objective: sft``: the mean next-token loss of ``data.source``'s packed rows."""

    name = "sft"

    def loss(self, graphdef, params, batch, mesh, weights=None):
        return objective(graphdef, params, batch, mesh, weights)

    def eval_sums(self, graphdef, params, batch, mesh):
        return loss_fn(graphdef, params, batch, mesh)

    def open(self, mesh, workdir: str):
        cfg = self.cfg
        train_rows, held_rows = run_data.load_data(cfg)
        if is_preference(train_rows):
            raise ConfigError(f"data.source {cfg.data.source!r} is a preference store "
                              f"(prompt, chosen, rejected pairs); train it with objective=dpo, "
                              f"got objective={cfg.objective}")
        cfg = run_data.with_segment_bound(cfg, train_rows, held_rows)
        if family(cfg.model.family).vision:
            iterator = vision_batches.MediaBatchIterator(train_rows, cfg.batch_size, cfg,
                                                         run_data.pixel_options(train_rows))
        else:
            iterator = data_lib.BatchIterator(train_rows, rows_per_batch(cfg), cfg.seed)
        log(data_line(cfg, mesh, train_rows, held_rows))
        return cfg, RowSource(iterator, train_rows, held_rows)

    def batches(self, source, mesh, layout, state, start, workdir, progress):
        return SFTBatches(self, source, mesh, layout)


OBJECTIVE = SFT
