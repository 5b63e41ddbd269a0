"""Vocabulary-parallel embedding lookup and cross-entropy over the sequence axes.

Letters as in models/decoder.py: B batch, S sequence, D model dim, V vocabulary; P the number of
sequence shards (ring x seq devices), L = S/P the tokens per device, C a chunk of L, Vl the
vocabulary rows per device.

Why. With the embedding table or output head replicated where it is used, every device holds
the whole [V, D] weight in the compute dtype and, in the backward pass, its whole fp32 gradient
before the gradient is summed over devices. For a Llama 3 vocabulary (V = 128256, D = 2048)
that is 0.5 GiB + 1 GiB per copy, on every device, however many devices share the sequence:
at 8 devices it was most of the 1B preset's peak (benchmarks/results/HISTORY.md, section 1).
Here each of the P devices that share a sequence owns V/P rows of the table, in fp32, and only
ever builds gradients for those rows.

Both functions run inside one shard_map and walk over the device's tokens C at a time (a
``lax.map``), so their transient buffers are per chunk:

Embedding. For a chunk, the P devices all-gather their token ids ([B, P*C] ints), each looks up
the rows it owns (zeros elsewhere) and a reduce-scatter over the sequence axes sums the P
partial [B, P*C, D] arrays and hands each device back its own [B, C, D]: exactly one device
contributes each row, so the sum is exact in any dtype. Traffic per device: one [B, S, D]
reduce-scatter forward, one all-gather backward, in the compute dtype.

Loss. For a chunk, the P devices all-gather their final hidden states ([B, P*C, D]) and target
ids, each computes the fp32 logits of all P*C tokens for its own V/P columns, and the softmax
statistics are combined across devices: max (pmax), sum of exponentials (psum), the target's
logit (psum; one device owns it). Every device then has the loss of all P*C tokens and keeps
its own C (the same token split as everywhere else), so the usual psum over all devices counts
each token once. Logits per chunk are [B, P*C, V/P], the size of [B, C, V] before; the head's
gradient per device is [D, V/P] fp32. Traffic per device: one [B, S, D] all-gather forward and
its reduce-scatter backward (the chunk is recomputed in the backward pass, so the all-gather
runs twice), plus small [B, S] ints and scalars.

A vocabulary that P does not divide is padded with zero rows up to a multiple of P; padded
columns are left out of the softmax sums, and no token id points at a padded row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from .loss import largest_divisor_at_most, row_sums
from ..mesh import DATA, RING, SEQ, act_spec, axis_size, seq_axes

_F32 = jnp.float32


def shards(mesh: Mesh) -> int:
    """P: how many devices share one sequence (and split the vocabulary)."""
    return axis_size(mesh, RING) * axis_size(mesh, SEQ)


def padded_vocab(vocab: int, mesh: Mesh) -> int:
    """The vocabulary rounded up to a multiple of P."""
    p = shards(mesh)
    return -(-vocab // p) * p


def _pad_rows(w, rows: int):
    """Pads axis 0 of ``w`` with zeros up to ``rows``."""
    extra = rows - w.shape[0]
    return w if extra == 0 else jnp.pad(w, [(0, extra)] + [(0, 0)] * (w.ndim - 1))


def _chunks(x, c: int):
    """[B, L, ...] -> [L/C, B, C, ...] (a leading axis for lax.map)."""
    b, n = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, n // c, c, *x.shape[2:]), 1, 0)


def _unchunk(x):
    """[L/C, B, C, ...] -> [B, L, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _owned(ids, rows: int, axes):
    """(local row index clipped into range, does this device own the id) for int ``ids``."""
    local = ids - lax.axis_index(axes) * rows
    own = (local >= 0) & (local < rows)
    return jnp.where(own, local, 0), own


def _own_rows(w, ids, axes):
    """Rows of ``w`` [Vl, D] for the ids this device owns, zeros for the others: [..., D].

    Ids owned elsewhere become the out-of-range row Vl, which the gather fills with zeros;
    so the backward pass keeps only the int ids, not a [..., D] mask (a where on the rows
    would keep one per chunk, growing with the sequence)."""
    rows = w.shape[0]
    local, own = _owned(ids, rows, axes)
    return jnp.take(w, jnp.where(own, local, rows), axis=0, mode="fill", fill_value=0)


def embed(table, tokens, *, mesh: Mesh, dtype, chunk: int = 1024):
    """Token embeddings, each device looking up only the vocabulary rows it owns.

    Args:
      table: [V, D] embedding (fp32 parameters; stored in any sharding).
      tokens: [B, S] int ids in [0, V), sharded like the activations.
      mesh: the training mesh; the vocabulary is split over its ring and seq axes.
      dtype: compute dtype of the result (rows are cast after the lookup, so the table's
        gradient stays fp32).
      chunk: tokens per device per step of the loop.

    Returns:
      [B, S, D] in ``dtype``, sharded P("data", seq axes, None).
    """
    axes = seq_axes(mesh)
    table = _pad_rows(table, padded_vocab(table.shape[0], mesh))

    def body(w, t):
        # w: [Vl, D] fp32; t: [B/D, L] ints

        def one(tc):                                                       # tc: [B, C]
            ids = lax.all_gather(tc, axes, axis=1, tiled=True)                # [B, C*P]
            x = _own_rows(w, ids, axes).astype(dtype)                          # [B, C*P, D]
            return lax.psum_scatter(x, axes, scatter_dimension=1, tiled=True)   # [B, C, D]

        c = largest_divisor_at_most(t.shape[1], chunk)
        return _unchunk(lax.map(one, _chunks(t, c)))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes, None), act_spec(mesh)),
                       out_specs=act_spec(mesh, 1))
    return fn(table, tokens)


def cross_entropy(hidden, w_head, targets, loss_mask, *, mesh: Mesh, chunk: int = 1024,
                  softcap: float = 0.0, per_row: bool = False, per_token: bool = False,
                  entropy: bool = False):
    """Mean next-token loss with the output head split over the vocabulary.

    Same contract as ``loss.chunked_cross_entropy``: hidden [B, S, D] (sharded like the
    activations), w_head [D, V] (fp32 parameters, any sharding; cast to hidden's dtype per
    chunk), targets [B, S] ints, loss_mask [B, S] weights, softcap (final logit cap, 0 =
    none). Returns (mean loss over the counted tokens, number of counted tokens), fp32
    scalars; with ``per_row``, each row's summed loss and count, [B] each, sharded over
    "data"; with ``per_token``, every token's loss, [B, S] sharded like ``targets``, and with
    ``entropy`` also every token's entropy (a metric), [B, S].
    """
    axes = seq_axes(mesh)
    all_axes = tuple(a for a in (DATA, RING, SEQ) if a in mesh.axis_names)
    vocab, vp = w_head.shape[1], padded_vocab(w_head.shape[1], mesh)
    padded = vp != vocab
    w_head = _pad_rows(w_head.T, vp).T                                    # [D, Vp]

    def body(h, w, t, m):
        # h: [B/D, L, D]; w: [D, Vl] fp32; t, m: [B/D, L]
        cols = w.shape[1]
        me = lax.axis_index(axes)
        real = (me * cols + jnp.arange(cols)) < vocab                     # padded columns

        @jax.checkpoint  # keep only the chunk's inputs; recompute its logits in the backward
        def chunk_loss(args):
            hc, tc, mc = args                                             # hc: [B, C, D]
            c = hc.shape[1]
            h_all = lax.all_gather(hc, axes, axis=1, tiled=True)          # [B, P*C, D]
            ids, own = _owned(lax.all_gather(tc, axes, axis=1, tiled=True), cols, axes)
            logits = jnp.einsum("BTD,DV->BTV", h_all, w.astype(hc.dtype),
                                preferred_element_type=_F32)              # [B, P*C, Vl]
            if softcap:
                logits = softcap * jnp.tanh(logits / softcap)
            # Padded columns are masked inside the reductions (fused; a masked copy of the
            # logits would be one more [B, P*C, Vl] fp32 buffer).
            row_max = jnp.where(real, logits, -jnp.inf).max(-1) if padded else logits.max(-1)
            top = lax.pmax(lax.stop_gradient(row_max), axes)              # [B, P*C]
            e = jnp.exp(logits - top[..., None])
            e = jnp.where(real, e, 0.0) if padded else e
            total = lax.psum(e.sum(-1), axes)
            lse = jnp.log(total) + top
            picked = jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
            picked = lax.psum(jnp.where(own, picked, 0.0), axes)          # [B, P*C]
            mine = lax.dynamic_slice_in_dim(lse - picked, me * c, c, axis=1)   # [B, C]
            if per_token and entropy:  # H = lse - sum_v p_v z_v, p_v = e_v / total
                mean_z = lax.psum((e * jnp.where(real, logits, 0.0) if padded else
                                   e * logits).sum(-1), axes) / total
                h_mine = lax.dynamic_slice_in_dim(lse - mean_z, me * c, c, axis=1)
                return mine * mc, h_mine * mc
            if per_token:
                return mine * mc                                          # [B, C]
            return jnp.sum(mine * mc, axis=1 if per_row else None)

        c = largest_divisor_at_most(h.shape[1], chunk)
        sums = lax.map(chunk_loss, (_chunks(h, c), _chunks(t, c), _chunks(m, c)))
        if per_token:
            return jax.tree.map(_unchunk, sums)
        if per_row:
            return row_sums(sums, m, all_axes)
        # One all-reduce for the loss and the count.
        total, count = lax.psum(jnp.stack([jnp.sum(sums), jnp.sum(m)]), all_axes)
        return total / jnp.maximum(count, 1.0), count

    act, tok = act_spec(mesh, 1), act_spec(mesh)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(act, P(None, axes), tok, tok),
                       out_specs=((tok, tok) if entropy else tok) if per_token else
                       (P(tok[0]),) * 2 if per_row else (P(), P()))
    return fn(hidden, w_head, targets, loss_mask.astype(_F32))
