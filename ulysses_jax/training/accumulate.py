"""Gradient accumulation inside the compiled step: the global batch of an optimizer step in k
micro-batches, one at a time, with the memory of one micro-batch plus a float32 gradient
accumulator laid out like the parameters (``grad_accum_steps``).

The objective stays the one of the whole global batch. The cross-entropy is the mean over
every counted token of the global batch, however those tokens fall over micro-batches, data
replicas and sequence shards: micro-batch i's mean loss (its own sum over its own count c_i,
both summed over every device) enters with the weight c_i / C, C the count of the global
batch, taken from the loss masks before the first micro-batch runs. So
sum_i (c_i / C) (s_i / c_i) = (sum_i s_i) / C, the plain step's loss, and its gradient is the
plain step's gradient up to float rounding; a mean of per-micro-batch means would weigh a
token of a micro-batch with few supervised tokens more than one of a full micro-batch.

MoE's load-balancing loss is not a sum over tokens (it multiplies pooled expert loads by
pooled router probabilities), so it cannot be split exactly. Here it is the mean over the k
micro-batches of each micro-batch's own aux loss (pooled over its data replicas and layers):
what k forward passes of transformers' Qwen3MoeForCausalLM give, each computing
load_balancing_loss_func over its own batch, averaged. With k = 1 it is the global batch's.

Micro-batch i takes, from each data replica's rows of the global batch, its i-th block of
B / (k D) rows, so no row crosses a device to form it, and all k micro-batches split evenly
over the D replicas.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..mesh import DATA, axis_size
from . import host_compute

SCOPE = "grad_accum"  # the accumulator's named scope (memory.py's "gradient accumulator")


def micro_batches(batch: dict, k: int, mesh: Mesh, shardings: dict) -> dict:
    """[B, ...] fields -> [k, B/k, ...]: micro-batch i holds the i-th block of B/(k D) rows of
    each of the D data replicas' rows (rows stay on their devices).

    Args:
      batch: field -> [B, ...] arrays sharded as ``shardings`` (batch dim over "data").
      k: micro-batches; B divisible by k x D.
      shardings: field -> NamedSharding of the [B, ...] field.
    """
    d = axis_size(mesh, DATA)

    def split(x, sharding):
        b, rest = x.shape[0], x.shape[1:]
        rows = b // (k * d)
        x = x.reshape(d, k, rows, *rest)                     # [D, k, B/(kD), ...]
        x = jnp.swapaxes(x, 0, 1).reshape(k, d * rows, *rest)  # [k, B/k, ...]
        spec = P(None, *sharding.spec)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return {name: split(x, shardings[name]) for name, x in batch.items()}


# Metrics that are means over a micro-batch's loss-mask tokens (GRPO's): combined weighted
# by those counts, they are the global batch's means, whatever rows share a micro-batch.
TOKEN_MEANS = ("nll", "entropy", "clip_ratio", "kl")


def accumulated_grads(loss_and_grad: Callable, params, batch: dict, k: int, mesh: Mesh,
                      batch_shardings: dict, grad_shardings, on_host: bool = False,
                      weighting: str = "tokens"):
    """Gradient and metrics of the global batch's objective, over k micro-batches in a scan.

    Args:
      loss_and_grad: ``f(params, micro_batch, ce_weight, aux_weight) -> ((cross-entropy,
        metrics), grads)``: the gradient of ``ce_weight`` x the micro-batch's mean loss plus
        ``aux_weight`` x its other terms (MoE's router loss); metrics as
        ``objectives.sft.objective``'s (``tokens``, MoE's ``moe_*``).
      params: what ``loss_and_grad`` differentiates (closed over by the scan).
      batch: the global batch, field -> [B, ...].
      k: micro-batches (``grad_accum_steps``).
      mesh, batch_shardings: the mesh and the batch fields' layouts (``micro_batches``).
      grad_shardings: pytree of NamedSharding like ``params``: the accumulator's layout
        (ZeRO-3 sharded where the parameters are).
      on_host: the accumulator lives in host memory and is added to there
        (``optimizer.offload``: ``grad_shardings`` are pinned_host).
      weighting: "tokens": micro-batch i weighs c_i / C; "equal": 1/k (an objective that is
        a mean over pairs, DPO: each micro-batch holds the same number of pairs); "sum": 1
        (GRPO: the batch's token weights make each micro-batch's loss its share already).

    Returns:
      (cross-entropy of the global batch, metrics, float32 gradients laid out as
      ``grad_shardings``): ``tokens`` summed over micro-batches, the ``TOKEN_MEANS``
      (GRPO's means over a micro-batch's loss-mask tokens) weighted by those tokens (the
      global batch's means), the others (``moe_*``) their mean over micro-batches.
    """
    stacked = micro_batches(batch, k, mesh, batch_shardings)
    # Every micro-batch's count c_i, reduced over the devices once, before the loop.
    counts = jnp.sum(stacked["loss_mask"].astype(jnp.float32),
                     axis=tuple(range(1, stacked["loss_mask"].ndim)))              # [k]
    weights = counts / jnp.maximum(jnp.sum(counts), 1.0)                          # c_i / C
    if weighting != "tokens":
        weights = jnp.full((k,), 1.0 / k if weighting == "equal" else 1.0, jnp.float32)

    def add(acc, grads):
        with jax.named_scope(SCOPE):
            if not on_host:
                return jax.tree.map(lambda a, g, s: jax.lax.with_sharding_constraint(
                    a + g.astype(jnp.float32), s), acc, grads, grad_shardings)
            grads = jax.device_put(grads, grad_shardings)
            grad_specs = host_compute.specs(grad_shardings)
            return host_compute.by_shard(lambda a, g: jax.tree.map(
                lambda x, y: x + y.astype(jnp.float32), a, g), mesh,
                (grad_specs, grad_specs), grad_specs)(acc, grads)

    def body(acc, xs):
        micro, weight = xs
        (ce, metrics), grads = loss_and_grad(params, micro, weight, 1.0 / k)
        return add(acc, grads), (weight * ce, metrics)

    with jax.named_scope(SCOPE):
        zeros = jax.tree.map(lambda p, s: jax.device_put(jnp.zeros(p.shape, jnp.float32), s),
                             params, grad_shardings)
    grads, (ces, metrics) = jax.lax.scan(body, zeros, (stacked, weights))
    share = counts / jnp.maximum(jnp.sum(counts), 1.0)                            # c_i / C
    metrics = {name: jnp.sum(v, axis=0) if name == "tokens" else
               jnp.tensordot(share, v, axes=1) if name in TOKEN_MEANS else jnp.mean(v, axis=0)
               for name, v in metrics.items()}
    return jnp.sum(ces), metrics, grads
