"""GRPO's policy loss (issue 40, first part): TRL's GRPOTrainer loss on completions that are
given (sampling, rewards and the training loop come later).

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
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .sft import next_token_loss, run_model

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """The loss's options, named as TRL's GRPOConfig names them."""
    beta: float = 0.0               # the KL term's weight; 0: no reference is needed
    epsilon: float = 0.2            # the clip range below 1
    epsilon_high: float | None = None  # above 1 (DAPO's asymmetric clip); None: epsilon
    loss_type: str = "dapo"
    max_completion_length: int = 256  # dr_grpo's normaliser


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
    adv = advantages[:, None]
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
    summed = per_token * mask
    if g.loss_type == "grpo":
        loss = jnp.mean(jnp.sum(summed, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
    elif g.loss_type == "bnpo":
        loss = jnp.sum(summed) / tokens
    elif g.loss_type == "dr_grpo":
        loss = jnp.sum(summed) / (mask.shape[0] * g.max_completion_length)
    else:  # dapo
        loss = jnp.sum(summed) / (tokens if num_items is None else jnp.maximum(num_items, 1.0))
    low_clip = (ratio < 1 - g.epsilon) & (adv < 0)
    high_clip = (ratio > 1 + high) & (adv > 0)
    metrics["clip_ratio"] = jnp.sum((low_clip | high_clip) * mask) / tokens
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
