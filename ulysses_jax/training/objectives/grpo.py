"""GRPO's policy loss (``objective: grpo``): TRL's GRPOTrainer loss on sampled completions
(sampling, rewards and the batches: training/grpo.py).

Rows hold prompt + completion sequences; the loss mask marks the completion's targets. Every
completion token's log-probability comes from the chunked next-token loss per token
(``loss.chunked_cross_entropy(per_token=True)``, or the vocabulary-parallel one), sharded
like the tokens: nothing crosses a device until the sums of the aggregation, which XLA
reduces over the sequence devices. With p the policy's, o the old policy's (the one that
sampled) and r the reference's token log-probabilities, A the row's advantage, the ratio
c = exp(p - o), its clip c' = clip(c, 1 - epsilon, 1 + epsilon_high), per token:

    l = -min(c A, c' A) + beta (exp(r - p) - (r - p) - 1)        (k3 KL, only when beta > 0)

and the loss aggregates l over the completion tokens m as TRL's ``loss_type`` does:
``grpo`` the mean over rows of each row's token mean; ``bnpo`` sum / tokens of the batch;
``dr_grpo`` sum / (rows x ``max_completion_length``); ``dapo`` sum / the tokens of the whole
global batch (``num_items`` when a micro-batch is part of one; its own tokens otherwise).

In training (``objective``) the aggregation is a weighted sum, sum(w l) over every token of
the step, with weights w made on the host (``token_weights``) from the loss masks: the same
number as ``grpo_loss``'s (and TRL's) for every ``loss_type``, also over micro-batches of an
accumulated step (each then enters as TRL's 1 / gradient_accumulation_steps, or for dapo
over the whole step's tokens), and one that nothing about sequence shards can change. The
batch brings each completion token's advantage and weight as [B, S] fields
(``TOKEN_FIELDS``), with ``num_iterations`` > 1 the old policy's log-probabilities, and
in full fine-tuning with beta > 0 the reference's (a frozen copy of the initial weights,
``REF_LOGPS``); with LoRA the reference is the base, the adapters zeroed, run in the step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ...config import Config
from ...models.lora import without_adapters
from .sft import next_token_loss, run_model, with_router_loss

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TOKEN_FIELDS = ("advantages", "loss_weights")  # [B, S] fields of a GRPO batch
OLD_LOGPS = "old_logps"                        # [B, S], with num_iterations > 1
REF_LOGPS = "ref_token_logps"                  # [B, S], full fine-tuning with beta > 0
METRICS = ("clip_ratio", "kl", "nll", "entropy")


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """The loss's options, named as TRL's GRPOConfig names them."""
    beta: float = 0.0               # the KL term's weight; 0: no reference is needed
    epsilon: float = 0.2            # the clip range below 1
    epsilon_high: float | None = None  # above 1 (DAPO's asymmetric clip); None: epsilon
    loss_type: str = "dapo"
    max_completion_length: int = 256  # dr_grpo's normaliser


def settings(cfg: Config) -> GRPOLoss:
    """The loss's options of ``cfg.grpo``."""
    g = cfg.grpo
    return GRPOLoss(beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                    loss_type=g.loss_type, max_completion_length=g.max_completion_length)


def token_fields(cfg: Config) -> tuple[str, ...]:
    """The [B, S] fields a GRPO batch brings beside the token fields."""
    return (TOKEN_FIELDS + ((OLD_LOGPS,) if cfg.grpo.num_iterations > 1 else ())
            + ((REF_LOGPS,) if frozen_reference(cfg) else ()))


def frozen_reference(cfg: Config) -> bool:
    """Whether the KL term's reference is a frozen copy of the initial weights (full
    fine-tuning with beta > 0), whose log-probabilities the batch brings (``REF_LOGPS``);
    with LoRA it is the base with the adapters off, computed in the step."""
    return bool(cfg.grpo.beta) and not cfg.model.lora.rank


def token_weights(mask: np.ndarray, g: GRPOLoss, k: int = 1, d: int = 1) -> np.ndarray:
    """float32 [N, S] weights w of a step's N rows (completion tokens ``mask``) such that
    sum(w l) is TRL's loss of per-token terms l for ``g.loss_type`` when the rows are split as
    TRL splits them over ``d`` processes (data replicas: N / d consecutive rows each) and
    ``k`` accumulated micro-batches (each replica's rows in k consecutive blocks, as
    accumulate.py takes them): each process's micro-batch loss divided by k (gradient
    accumulation) and averaged over the d processes (DDP); dapo over the step's tokens. Only
    bnpo depends on the split (its denominator is a process's micro-batch's tokens)."""
    mask = np.asarray(mask, np.float64)
    rows = mask.shape[0]
    n = rows // (k * d)                                    # rows of one process's micro-batch
    group = np.arange(rows) // n                           # (replica, micro-batch) of a row
    if g.loss_type == "grpo":
        w = mask / np.maximum(mask.sum(1, keepdims=True), 1.0) / rows
    elif g.loss_type == "bnpo":
        tokens = np.bincount(group, weights=mask.sum(1), minlength=k * d)
        w = mask / np.maximum(tokens[group], 1.0)[:, None] / (k * d)
    elif g.loss_type == "dr_grpo":
        w = mask / (rows * g.max_completion_length)
    elif g.loss_type == "dapo":
        w = mask / max(mask.sum(), 1.0)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got "
                         f"{g.loss_type!r}")
    return w.astype(np.float32)


def token_logps(graphdef, params, batch: dict, mesh: Mesh):
    """Each token's log-probability of its target under the model, 0 where the loss mask
    is 0: [B, S] fp32, sharded like the batch, differentiable."""
    model, hidden, head, _ = run_model(graphdef, params, batch)
    return -next_token_loss(model, hidden, head, batch, mesh, per_token=True)


def grpo_loss(logps, old_logps, advantages, mask, g: GRPOLoss, ref_logps=None,
              num_items=None):
    """TRL's GRPO loss from token log-probabilities [B, S] (policy, old policy and, with
    ``g.beta`` > 0, reference), the rows' advantages [B] and the completion mask [B, S].

    Returns:
      (loss, metrics): ``clip_ratio`` (the share of completion tokens whose ratio was
      clipped, TRL's region mean), and with beta > 0 ``kl`` (the mean k3 estimate).
    """
    if g.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got "
                         f"{g.loss_type!r}")
    mask = mask.astype(jnp.float32)
    per_token, metrics = token_terms(logps, old_logps, advantages[:, None], mask, g, ref_logps)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    summed = per_token * mask
    if g.loss_type == "grpo":
        loss = jnp.mean(jnp.sum(summed, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
    elif g.loss_type == "bnpo":
        loss = jnp.sum(summed) / tokens
    elif g.loss_type == "dr_grpo":
        loss = jnp.sum(summed) / (mask.shape[0] * g.max_completion_length)
    else:  # dapo
        loss = jnp.sum(summed) / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
    return loss, metrics


def token_terms(logps, old_logps, adv, mask, g: GRPOLoss, ref_logps=None):
    """Each token's term l of the loss [B, S] (advantages ``adv`` broadcast to [B, S] or
    given per token) and the metrics, means over the ``mask``ed tokens: ``clip_ratio``
    (TRL's region mean: ratio below 1 - epsilon with a negative advantage, or above
    1 + epsilon_high with a positive one), and with beta > 0 ``kl`` (k3)."""
    ratio = jnp.exp(logps - old_logps)
    high = g.epsilon if g.epsilon_high is None else g.epsilon_high
    clipped = jnp.clip(ratio, 1 - g.epsilon, 1 + high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {}
    if g.beta:
        diff = ref_logps - logps
        kl = jnp.exp(diff) - diff - 1
        per_token = per_token + g.beta * kl
        metrics["kl"] = jnp.sum(kl * mask) / tokens
    low_clip = (ratio < 1 - g.epsilon) & (adv < 0)
    high_clip = (ratio > 1 + high) & (adv > 0)
    metrics["clip_ratio"] = jnp.sum((low_clip | high_clip) * mask) / tokens
    return per_token, jax.tree.map(jax.lax.stop_gradient, metrics)


def objective(cfg: Config, graphdef, params, batch: dict, mesh: Mesh,
              weights: tuple | None = None):
    """``sft.objective``'s contract for GRPO: (objective, (GRPO loss, metrics)).

    The loss is sum(w l) over the batch's tokens (``token_weights``: the step's loss, or a
    micro-batch's share of it, so accumulation adds micro-batches with weight 1); an MoE
    model adds ``router_aux_loss_coef`` x the load-balancing loss as in SFT. The old policy
    is the batch's ``old_logps`` (where not NaN), else the policy itself without gradient (one update per
    generation batch: the ratio is 1 and its gradient the policy gradient). metrics:
    ``tokens`` (completion tokens), ``clip_ratio``, ``nll`` (the mean negative
    log-probability of the completion tokens), ``entropy`` (TRL's: the mean entropy of the
    policy's distribution at the completion tokens), with beta > 0 ``kl``, MoE's ``moe_*``.
    """
    g = settings(cfg)
    model, hidden, head, stats = run_model(graphdef, params, batch)
    nll, entropies = next_token_loss(model, hidden, head, batch, mesh, per_token=True,
                                     entropy=True)
    logps = -nll
    old = jax.lax.stop_gradient(logps)
    if OLD_LOGPS in batch:  # NaN where the policy itself is the old one (warm-up rows)
        old = jnp.where(jnp.isnan(batch[OLD_LOGPS]), old, batch[OLD_LOGPS])
    ref = None
    if g.beta and REF_LOGPS in batch:  # the initial weights' (full fine-tuning)
        ref = batch[REF_LOGPS]
    elif g.beta:  # the LoRA base: the adapters off
        ref = jax.lax.stop_gradient(token_logps(
            graphdef, jax.lax.stop_gradient(without_adapters(params)), batch, mesh))
    mask = batch["loss_mask"].astype(jnp.float32)
    per_token, metrics = token_terms(logps, old, batch["advantages"], mask, g, ref)
    loss = jnp.sum(per_token * batch["loss_weights"])
    count = jnp.sum(mask)
    metrics.update(tokens=count, nll=jax.lax.stop_gradient(
        -jnp.sum(logps * mask) / jnp.maximum(count, 1.0)), entropy=jax.lax.stop_gradient(
        jnp.sum(entropies * mask) / jnp.maximum(count, 1.0)))
    return with_router_loss(model.cfg, loss, metrics, stats, weights)
