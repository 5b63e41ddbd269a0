"""``objective: sft`` (the default): the mean next-token loss over the supervised tokens,
plus an MoE model's router loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ...models import vocab
from ...models.loss import chunked_cross_entropy
from ...models.moe import aux_loss


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
