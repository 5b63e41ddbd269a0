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
``ref_logps`` (each row's reference log-probability, recorded before step 1 by
``reference.py``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ...config import Config, DPOConfig, dpo_reference
from ...models import lora
from .sft import next_token_loss, run_model, with_router_loss

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


def sequence_logps(graphdef, params, batch: dict, mesh: Mesh):
    """Each row's summed log-probability of its masked targets, its count of them, and the
    model's MoE statistics (None for a dense model).

    Returns:
      (logps [2B], counts [2B], stats): fp32, sharded over "data".
    """
    model, hidden, head, stats = run_model(graphdef, params, batch)
    nll, counts = next_token_loss(model, hidden, head, batch, mesh, per_row=True)
    return -nll, counts, stats


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
    """The reference's per-row log-probabilities [2B] (no gradient): the batch's
    ``ref_logps`` (precompute), or the model with the LoRA adapters zeroed (base)."""
    if dpo_reference(cfg) == "precompute":
        return batch["ref_logps"]
    base = without_adapters(params)
    logps, _, _ = sequence_logps(graphdef, jax.lax.stop_gradient(base), batch, mesh)
    return jax.lax.stop_gradient(logps)


def without_adapters(params: dict, _path: tuple = ()) -> dict:
    """``params`` with every LoRA matrix zeroed: the base model's function."""
    return {k: (without_adapters(v, _path + (k,)) if isinstance(v, dict) else
                jnp.zeros_like(v) if lora.is_adapter(_path + (k,)) else v)
            for k, v in params.items()}


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
    logps, counts, stats = sequence_logps(graphdef, params, batch, mesh)
    losses, terms = pair_losses(logps, ref, counts, cfg.dpo)
    metrics = {"tokens": jnp.sum(counts), **{k: jnp.mean(v) for k, v in terms.items()}}
    return with_router_loss(cfg.model, jnp.mean(losses), metrics, stats, weights)


def eval_sums(cfg: Config, graphdef, params, batch: dict, mesh: Mesh):
    """Held-out sums over a batch's real pairs (padding pairs, with no completion token, are
    left out): (summed loss, pairs the chosen reward wins, pairs, summed margin)."""
    ref = reference_logps(cfg, graphdef, params, batch, mesh)
    logps, counts, _ = sequence_logps(graphdef, params, batch, mesh)
    losses, terms = pair_losses(logps, ref, counts, cfg.dpo)
    real = (counts.reshape(-1, 2)[:, 0] > 0).astype(jnp.float32)
    return (jnp.sum(losses * real), jnp.sum(terms["rewards/accuracies"] * real),
            jnp.sum(real), jnp.sum(terms["rewards/margins"] * real))
