"""Each token's next-token loss and the loss by position in the document: what the trainer's
held-out evaluation and the evaluate CLI both report, so it lives below both.

``token_losses`` runs the model and gives every token's loss and greedy prediction without ever
holding [B, S, V] logits (chunks of each device's tokens); ``bucket_bounds`` and
``bucket_sums`` sum those losses into log-spaced position buckets [0, 1), [1, 2), [2, 4), ...
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ..mesh import act_spec
from ..models.loss import largest_divisor_at_most


def bucket_bounds(seq_len: int) -> list[int]:
    """[0, 1, 2, 4, ..., seq_len]: bucket i holds positions bounds[i] <= p < bounds[i + 1]."""
    bounds, b = [0, 1], 2
    while b < seq_len:
        bounds.append(b)
        b *= 2
    return bounds + [seq_len]


def bucket_sums(losses, positions, mask, bounds) -> tuple[np.ndarray, np.ndarray]:
    """Summed loss and token count per position bucket (any array order: bucketing is by
    the positions that travel with the tokens, so zigzag-ordered batches work as well).

    Args:
      losses, positions, mask: [B, S] (numpy or jax arrays); bounds: from ``bucket_bounds``.
    Returns:
      (sums, counts), float64 numpy [len(bounds) - 1].
    """
    positions = np.asarray(positions)
    mask = np.asarray(mask, np.float64)
    which = np.clip(np.searchsorted(np.asarray(bounds), positions, side="right") - 1,
                    0, len(bounds) - 2)
    n = len(bounds) - 1
    sums = np.bincount(which.ravel(), (np.asarray(losses, np.float64) * mask).ravel(), n)
    return sums, np.bincount(which.ravel(), mask.ravel(), n)


def token_losses(mesh, graphdef, chunk: int = 1024, prepare=None):
    """Jitted ``f(params, batch) -> (losses, predictions)``, both [B, S] sharded like the
    batch: each token's next-token loss (fp32) and the model's greedy prediction (argmax,
    int32), from [B, C, V] logits of chunks of C tokens per device.

    Args:
      mesh: the ("data", "seq") mesh; graphdef: the Decoder's ``nnx.graphdef``.
      chunk: tokens per device per chunk.
      prepare: applied to the parameters inside the program (the trainer's
        ``train_step.params_for_compute``: host-resident parameters with optimizer.offload).
    """
    def body(h, w, t, cap):
        # h: [B, S/P, D]; w: [D, V]; t: [B, S/P]
        b, s, d = h.shape
        c = largest_divisor_at_most(s, chunk)
        as_chunks = lambda x: jnp.moveaxis(x.reshape(b, s // c, c, *x.shape[2:]), 1, 0)  # noqa

        def one(args):
            hc, tc = args                                                     # [B, C, D], [B, C]
            logits = jnp.einsum("BCD,DV->BCV", hc, w.astype(hc.dtype),
                                preferred_element_type=jnp.float32)           # [B, C, V]
            if cap:
                logits = cap * jnp.tanh(logits / cap)
            lse = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
            return lse - picked, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        losses, preds = jax.lax.map(one, (as_chunks(h), as_chunks(t)))       # [S/P/C, B, C]
        unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, s)  # noqa: E731
        return unchunk(losses), unchunk(preds)

    def run(params, batch):
        model = nnx.merge(graphdef, params if prepare is None else prepare(params))
        hidden = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"],
                              batch.get("vision"))
        w = jax.lax.with_sharding_constraint(model.head_weight(), NamedSharding(mesh, P()))
        cap = model.cfg.final_softcap
        fn = jax.shard_map(lambda h, w, t: body(h, w, t, cap), mesh=mesh,
                           in_specs=(act_spec(mesh, 1), P(), act_spec(mesh)),
                           out_specs=(act_spec(mesh), act_spec(mesh)))
        return fn(hidden, w, batch["targets"])

    return jax.jit(run)
