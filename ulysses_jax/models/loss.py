"""Token-weighted cross-entropy over sequence shards, computed in chunks.

Targets arrive pre-shifted (each position carries its own next token), so nothing crosses a
shard edge. Each device computes the loss of its own tokens in chunks of ``chunk`` positions:
a chunk's fp32 logits [B, C, V] exist only while that chunk runs (and are recomputed in the
backward pass), so the [B, S, V] fp32 logits of a long sequence never exist. The mean is over
all real tokens of the global batch (sum of losses / number of tokens, both summed across
devices), not a mean of per-shard means.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ..mesh import DATA, RING, SEQ, act_spec


def largest_divisor_at_most(n: int, limit: int) -> int:
    """Chunk length for ``n`` local tokens: the largest divisor of n that is <= limit."""
    return max(c for c in range(1, min(n, limit) + 1) if n % c == 0)


def token_losses(logits, targets):
    """Per-token cross-entropy from fp32 logits [..., V] and int targets [...]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked


def token_entropies(logits):
    """Each position's entropy of softmax(logits), from fp32 logits [..., V]."""
    p = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(p * logits, axis=-1)


def plain_cross_entropy(logits, targets, loss_mask):
    """Reference: mean loss over masked tokens from full logits [B, S, V]."""
    losses = token_losses(logits.astype(jnp.float32), targets)
    return jnp.sum(losses * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)


def chunked_cross_entropy(hidden, w_head, targets, loss_mask, *, mesh: Mesh, chunk: int = 1024,
                          softcap: float = 0.0, per_row: bool = False,
                          per_token: bool = False, entropy: bool = False):
    """Mean next-token loss without materialising the logits.

    Args:
      hidden: [B, S, D] final hidden states, sharded P("data", "seq", None).
      w_head: [D, V] output projection (any dtype; logits are accumulated in fp32).
      targets: [B, S] int next-token ids; loss_mask: [B, S] float weights (0 = ignore).
      mesh: the ("data", "seq") mesh.
      chunk: positions per device per chunk.
      softcap: c > 0 caps the logits at c * tanh(logits / c) (Gemma 2); 0 = none.
      per_row: return each row's summed loss and count instead (sequence log-probabilities
        for preference objectives, ``training/objectives/dpo.py``).
      per_token: return every token's loss instead, [B, S] sharded like ``targets``
        (differentiable; token log-probabilities for ``training/objectives/grpo.py``).
      entropy: with ``per_token``, also every token's entropy of the predicted distribution
        (a metric: no gradient is meant to flow through it), [B, S], 0 where the mask is.

    Returns:
      (mean loss, number of counted tokens), both fp32 scalars; with ``per_row``
      (summed loss [B], counted tokens [B]), fp32, sharded over "data".
    """
    axes = tuple(a for a in (DATA, RING, SEQ) if a in mesh.axis_names)

    def body(h, w, t, m):
        # h: [B/D, S/P, D]; w: [D, V]; t, m: [B/D, S/P]
        b, s, d = h.shape
        c = largest_divisor_at_most(s, chunk)
        as_chunks = lambda x: jnp.moveaxis(x.reshape(b, s // c, c, *x.shape[2:]), 1, 0)

        @jax.checkpoint  # keep only the chunk's inputs; recompute its logits in the backward pass
        def chunk_loss(args):
            hc, tc, mc = args                                                 # hc: [B, C, D]
            logits = jnp.einsum("BCD,DV->BCV", hc, w.astype(hc.dtype),
                                preferred_element_type=jnp.float32)          # [B, C, V]
            if softcap:
                logits = softcap * jnp.tanh(logits / softcap)
            if per_token and entropy:
                return token_losses(logits, tc) * mc, token_entropies(logits) * mc
            if per_token:
                return token_losses(logits, tc) * mc                          # [B, C]
            return jnp.sum(token_losses(logits, tc) * mc, axis=1 if per_row else None)

        sums = jax.lax.map(chunk_loss, (as_chunks(h), as_chunks(t), as_chunks(m)))  # [S/P/C]
        if per_token:                                                    # [S/P/C, B, C]
            return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(b, s), sums)
        if per_row:
            return row_sums(sums, m, axes)
        # One all-reduce for the loss and the count.
        total, count = jax.lax.psum(jnp.stack([jnp.sum(sums), jnp.sum(m)]), axes)
        return total / jnp.maximum(count, 1.0), count

    act, tok = act_spec(mesh, 1), act_spec(mesh)
    out = ((tok, tok) if entropy else tok) if per_token else (
        (P(tok[0]),) * 2 if per_row else (P(), P()))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(act, P(), tok, tok), out_specs=out)
    return fn(hidden, w_head, targets, loss_mask.astype(jnp.float32))


def row_sums(chunk_sums, mask, axes):
    """Inside a loss's shard_map: (each row's summed loss, its counted tokens), [B/D] each,
    summed over the sequence devices (not over "data": rows stay where they are).

    Args:
      chunk_sums: [chunks, B/D] per-chunk sums of each row's token losses on this device.
      mask: [B/D, L] this device's loss weights.
      axes: all the mesh's axes (data among them is left out here).
    """
    seq = tuple(a for a in axes if a != DATA)
    total = jnp.stack([jnp.sum(chunk_sums, axis=0), jnp.sum(mask, axis=1)])     # [2, B/D]
    total = jax.lax.psum(total, seq) if seq else total
    return total[0], total[1]
