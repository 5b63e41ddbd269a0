"""Hybrid Ulysses x Ring attention (USP-style) on a ("data", "ring", "seq") mesh.

Letters as in models/decoder.py: B batch, T query positions, S key positions (and the
sequence), N query heads, K kv heads, G = N // K, H head dim; U the seq axis size, R the ring
axis size, L = S/(R*U) the tokens per device, C the chunk length, nc the chunks per ring rank
(1 or 2).

Layout. Tokens are split over ("ring", "seq"), ring major: device (r, u) holds shard r*U + u.
1. Ulysses inside each ring rank: one U-way all-to-all on "seq" (q, k, v packed in one message,
   kv heads replicated when U > K, as in ulysses.py). Device (r, u) then holds ring block r, all
   its S/R tokens, for heads block u. Heads need only divide by U, not by U*R.
2. Ring over "ring": the R devices with the same u form a ring. K/V (and the kv segment ids)
   move r -> r+1 by ppermute R-1 times; at step t device r holds the block of rank r-t. Each
   (q chunk, kv chunk) pair gives a partial output and its logsumexp, merged into a running fp32
   (output, logsumexp) pair by online softmax. The kv chunk index needs no message: it follows
   from r - t.
3. The reverse all-to-all restores the [B, L, N, H] sequence split.

Zigzag. Causal attention on contiguous blocks is unbalanced: ring rank r has r+1 kv blocks of
work (rank 0 one, rank R-1 all R), and every ring step waits for the busiest rank. Cut the
sequence into 2R chunks of C = S/(2R) and give ring rank i chunks i and 2R-1-i, one early and
one late: every rank then has 2R+1 unmasked (q chunk, kv chunk) pairs. "Zigzag order" is the
sequence permuted so that the ordinary ("ring", "seq") split hands each rank its two chunks:
``x[:, zigzag_permutation(S, R)]``. The data loader can emit batches (tokens, targets, positions,
segment ids) in that order, so the model never reorders; ``layout="natural"`` reorders here.

Masking works per (q chunk, kv chunk) pair with true global chunk indices: a pair whose kv
chunk comes after its q chunk is skipped by ``lax.switch`` (never computed), the diagonal pair
gets the triangular mask, earlier chunks only the segment mask. The contiguous layout uses one
chunk of S/R per rank, zigzag two of S/(2R). Within a pair the work is tiled by the chunked
kernel (chunked.block_forward / block_backward): one fp32 [B, N/U, block_q, block_k] score tile
at a time, causal tiles above the diagonal skipped, so no device ever holds a [C, C] (or larger)
score array however long the sequence.

Windows. With a sliding window W a query chunk d chunks after a key chunk holds a pair inside
the window only if -reach <= d <= reach (0 <= d causal), reach = ceil((W - 1) / C). Such
pairs run the windowed tile plan at their true offset d * C (``chunked.block_forward``);
others are skipped by ``lax.cond``. Ring offsets at which no rank has such a pair are not run
at all: ``ring_steps`` finds the needed ones and reaches them the shorter way round, so K/V
(and dK/dV) move ``reach`` steps on the contiguous layout, ``reach`` each way (r -> r+1 and
r -> r-1) on the zigzag one, instead of R - 1: a long sequence with a short window sends less.
The "natural" layout then runs contiguous blocks (no reorder); the model's zigzag batches
run as they come.

Backward: a custom VJP in FlashAttention-2 form, not autodiff through the loop (which would
save every step's K/V block and running output, O(S/U) per device). Residuals are the local q,
k, v, output and logsumexp, O(S/R) per device. A second ring pass recomputes each unskipped tile;
dK/dV accumulators (fp32) travel with their K/V block and reach their owner after one more
ppermute (R in all); dQ stays local. The backward is not itself differentiable.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from . import chunked

from . import kernels
from .heads import pad_heads, unpad_output
from ..mesh import DATA, RING, SEQ, axis_size, shard
from .ulysses import _pack_qkv, _unpack_qkv, heads_to_seq, seq_to_heads, validate, variant

_F32 = jnp.float32
LAYOUTS = ("zigzag", "contiguous", "natural")
_FLAT = (RING, SEQ)  # the sequence axes, flattened ring major


# ----------------------------------------------------------------------------- zigzag order

def zigzag_permutation(seq_len: int, ring: int) -> np.ndarray:
    """Natural -> zigzag order: ``x_zigzag = x[:, perm]``.

    Args:
      seq_len: S, a multiple of 2 * ring.
      ring: R, the ring axis size.

    Returns:
      int [S]: zigzag position j holds natural token perm[j]; chunks of S/(2R) tokens in the
      order 0, 2R-1, 1, 2R-2, ..., R-1, R.
    """
    if ring < 1 or seq_len % (2 * ring):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x ring = {2 * ring}")
    c = seq_len // (2 * ring)
    chunks = np.array([j for i in range(ring) for j in (i, 2 * ring - 1 - i)])
    return (chunks[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def inverse_zigzag_permutation(seq_len: int, ring: int) -> np.ndarray:
    """Zigzag -> natural order: ``x = x_zigzag[:, inv]``."""
    return np.argsort(zigzag_permutation(seq_len, ring))


def _half_shard_moves(num_shards: int, ring: int, to_zigzag: bool):
    """Static plan that reorders a sequence split over ``num_shards`` devices, in half shards.

    A half shard never straddles a zigzag chunk (chunk = U half shards), so the reorder is a
    permutation of half shards. Returns {(src half, dst half): [(src device, dst device)]}.
    """
    perm = zigzag_permutation(2 * num_shards, ring)  # zigzag unit z is natural unit perm[z]
    moves: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for z, e in enumerate(perm):
        src, dst = (int(e), z) if to_zigzag else (z, int(e))
        moves.setdefault((src % 2, dst % 2), []).append((src // 2, dst // 2))
    return moves


def _reorder(x, moves, num_shards: int):
    """Moves half shards inside shard_map: [B, L, ...] -> [B, L, ...] in the other order.

    One ppermute per (src half, dst half) kind, at most 4, each moving L/2 tokens per device,
    so about one shard of traffic in all (one ppermute of whole shards when U is even). A select
    (not a sum) joins the kinds: exact.
    """
    if set(moves) == {(0, 0), (1, 1)} and moves[(0, 0)] == moves[(1, 1)]:
        return lax.ppermute(x, _FLAT, moves[(0, 0)])  # U even: whole shards move together
    h = x.shape[1] // 2
    halves = (x[:, :h], x[:, h:])
    dev = lax.axis_index(_FLAT)
    out = []
    for jd in (0, 1):
        got, table = [], np.zeros(num_shards, np.int32)
        for js in (0, 1):
            pairs = moves.get((js, jd), [])
            if pairs:
                got.append(lax.ppermute(halves[js], _FLAT, pairs))
                table[[d for _, d in pairs]] = len(got) - 1
        out.append(got[0] if len(got) == 1 else jnp.where(jnp.asarray(table)[dev] == 0, *got))
    return jnp.concatenate(out, axis=1)


# ----------------------------------------------------------------------------- block math

@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static geometry of one ring pass (hashable: a custom_vjp static argument)."""
    r: int          # ring size R
    nc: int         # chunks per ring rank: 1 (contiguous) or 2 (zigzag)
    c: int          # chunk length C
    causal: bool
    scale: float
    block_q: int    # query / key tile sizes inside a pair (clamped to C)
    block_k: int
    window: int | None = None     # sliding window W (module docstring), None: none
    softcap: float | None = None  # tanh logit cap
    fwd: int = 0    # ring steps with K/V moving r -> r+1 (R-1 without a window)
    bwd: int = 0    # ring steps with K/V moving r -> r-1 (windows only)

    def chunk(self, rank, a: int):
        """Global chunk index of local chunk ``a`` of ring rank ``rank`` (may be traced)."""
        return rank if self.nc == 1 or a == 0 else 2 * self.r - 1 - rank

    def split(self, x):
        """[B, T, ...] -> nc arrays [B, C, ...] (static slices)."""
        return [x[:, a * self.c:(a + 1) * self.c] for a in range(self.nc)]

    def plan(self, diagonal: bool):
        """Tiling of one pair: a diagonal pair (same chunk) is causal inside, others are not.
        With a window every pair gets the windowed plan and its true offset (``_visit``)."""
        if self.window is not None:
            return chunked.block_plan(self.c, self.c, self.causal, self.block_q, self.block_k,
                                      window=self.window, softcap=self.softcap)
        return chunked.block_plan(self.c, self.c, self.causal and diagonal,
                                  self.block_q, self.block_k, softcap=self.softcap)

    @property
    def reach(self) -> int:
        """With a window: how many chunks apart a query and a key chunk can still meet."""
        return (self.window + self.c - 2) // self.c


def ring_steps(r: int, nc: int, c: int, causal: bool, window: int | None) -> tuple[int, int]:
    """(forward steps, backward steps) a ring pass needs: every ring offset t (rank r holds
    rank r - t's K/V) at which some pair of chunks can meet, reached by the shorter way round.

    Without a window every offset is needed: R - 1 forward steps, as always. With one, only
    offsets whose chunks lie within ``reach`` of each other: t = 1..reach on the contiguous
    layout; on the zigzag layout also R - reach..R - 1 (a rank's late chunk reads its
    neighbour's), which K/V reach in ``reach`` steps the other way round.
    """
    if window is None:
        return r - 1, 0
    g = _Ring(r, nc, c, causal, 1.0, 1, 1, window)
    needed = {t for rank in range(r) for t in range(1, r)
              for a in range(nc) for j in range(nc)
              if _meets(g, g.chunk(rank, a) - g.chunk((rank - t) % r, j))}
    splits = [(f + max([r - t for t in needed if t > f], default=0), -f) for f in range(r)]
    cost, neg_f = min(splits)
    return -neg_f, cost + neg_f


def _meets(g: _Ring, d):
    """Whether a query chunk d chunks after a key chunk holds a pair inside the window."""
    return (d <= g.reach) & ((d >= 0) if g.causal else (d >= -g.reach))


def _merge_block(g, diagonal, offset, q_a, k_b, v_b, seg_a, seg_b, o, lse):
    """Online softmax: folds one pair into the running (o [B, C, N, H], lse [B, C, N]), fp32."""
    o_b, lse_b = chunked.block_forward(q_a, k_b, v_b, seg_a, seg_b, g.plan(diagonal), g.scale,
                                       offset=offset)
    new = jnp.logaddexp(lse, lse_b)
    shift = jnp.where(jnp.isfinite(new), new, 0.0)     # rows no key has reached yet stay 0
    w_old, w_blk = jnp.exp(lse - shift), jnp.exp(lse_b - shift)
    return w_old[..., None] * o + w_blk[..., None] * o_b, new


def _grad_block(g, diagonal, offset, q_a, k_b, v_b, seg_a, seg_b, do_a, lse_a, delta_a, dq_a,
                dk_b, dv_b):
    """FlashAttention-2 backward of one pair; adds fp32 dq_a [B, C, N, H], dk_b, dv_b."""
    dq, dk, dv = chunked.block_backward(q_a, k_b, v_b, seg_a, seg_b, lse_a, delta_a, do_a,
                                        g.plan(diagonal), g.scale, offset=offset)
    return dq_a + dq, dk_b + dk, dv_b + dv


def _visit(g: _Ring, cq, ck, fn, state):
    """Runs ``fn(state, diagonal, offset)`` for a pair the skip rules keep.

    Without causal masking every pair is computed in full. With it, a pair whose kv chunk
    comes after its q chunk is skipped (costs one branch), the diagonal pair runs with the
    triangular mask and earlier chunks without it: a ``lax.switch`` on traced chunk ids.
    With a window, a pair runs only if its chunks meet inside it (``_meets``), with the
    offset of their true positions, (cq - ck) * C.
    """
    if g.window is not None:
        d = cq - ck
        return lax.cond(_meets(g, d), lambda st: fn(st, False, d * g.c), lambda st: st, state)
    if not g.causal:
        return fn(state, False, 0)
    branch = jnp.where(ck > cq, 0, jnp.where(ck == cq, 1, 2))
    return lax.switch(branch, [lambda st: st, lambda st: fn(st, True, 0),
                               lambda st: fn(st, False, 0)], state)


def _send(tree, r: int, shift: int = 1):
    """Passes every array of ``tree`` ``shift`` steps along the ring: rank i -> i + shift."""
    perm = [(i, (i + shift) % r) for i in range(r)]
    return jax.tree.map(lambda x: lax.ppermute(x, RING, perm), tree)


# ----------------------------------------------------------------------------- ring passes

def _ring_forward(q, k, v, seg, g: _Ring):
    """Forward ring pass inside shard_map.

    Args:
      q: [B, T, N', H] with T = S/R, the ring block of this rank for the local heads;
      k, v: [B, T, K', H]; seg: [B, T] ints or None.

    Returns:
      out [B, T, N', H] in q's dtype, lse (nc arrays [B, C, N'] fp32, -inf on rows that saw
      no key) and the number of pairs computed (int32 scalar).
    """
    rank = lax.axis_index(RING)
    qs = g.split(q)                                                          # [B, C, N, H]
    seg_q = g.split(seg) if seg is not None else [None] * g.nc
    # Initial state built from q, so inside shard_map it varies over the same axes as the
    # loop's outputs (a bare jnp.zeros would not, and fori_loop/cond need them to match).
    o = [jnp.zeros_like(x, _F32) for x in qs]                                # [B, C, N, H]
    lse = [jnp.full_like(x[..., 0], -jnp.inf, _F32) for x in qs]             # [B, C, N]
    count = jnp.zeros_like(q, jnp.int32, shape=())

    def step(t, acc, kv, sign=1):
        o, lse, count = list(acc[0]), list(acc[1]), acc[2]
        # Tie this step's layer-invariant inputs (segment ids, ring position) to the K/V it
        # received: otherwise JAX's scan partial evaluation splits their part out of the layer
        # loop and stacks the masks of every ring step, O(S^2/R) memory. An identity.
        kv, seg_q_t, t = lax.optimization_barrier((kv, seg_q, t))
        ks, vs = g.split(kv[0]), g.split(kv[1])
        seg_k = g.split(kv[2]) if seg is not None else [None] * g.nc
        src = (rank - t) % g.r if sign == 1 else (rank + t) % g.r
        for a in range(g.nc):
            for j in range(g.nc):
                cq, ck = g.chunk(rank, a), g.chunk(src, j)

                def pair(st, diagonal, offset, a=a, j=j):
                    o_a, lse_a, n_done = st
                    o_a, lse_a = _merge_block(g, diagonal, offset, qs[a], ks[j], vs[j],
                                              seg_q_t[a], seg_k[j], o_a, lse_a)
                    return o_a, lse_a, n_done + 1

                o[a], lse[a], count = _visit(g, cq, ck, pair, (o[a], lse[a], count))
        return o, lse, count

    def stream(sign):
        def body(t, st):
            acc, kv = st
            kv = _send(kv, g.r, sign)                 # now holds rank (r - sign t)'s block
            return step(t, acc, kv, sign), kv
        return body

    kv = (k, v, seg)
    acc = step(0, (o, lse, count), kv)
    for sign, steps in ((1, g.fwd), (-1, g.bwd)):   # without a window: R-1 steps forward
        if steps:
            acc, _ = lax.fori_loop(1, steps + 1, stream(sign), (acc, kv))
    o, lse, count = acc
    return jnp.concatenate(o, axis=1).astype(q.dtype), lse, count


def _ring_backward(q, k, v, seg, out, lse, d_out, g: _Ring):
    """Backward ring pass inside shard_map (shapes as in ``_ring_forward``).

    Returns:
      dq, dk, dv in the dtypes of q, k, v, and the number of pairs recomputed.
    """
    rank = lax.axis_index(RING)
    qs, dos = g.split(q), g.split(d_out)                                     # [B, C, N, H]
    seg_q = g.split(seg) if seg is not None else [None] * g.nc
    delta = [chunked._delta(o, do) for o, do in zip(g.split(out), dos)]       # [B, C, N]
    dq = [jnp.zeros_like(x, _F32) for x in qs]                                # [B, C, N, H]
    dkv = (jnp.zeros_like(k, _F32), jnp.zeros_like(v, _F32))                  # [B, T, K, H]
    count = jnp.zeros_like(q, jnp.int32, shape=())

    def step(t, acc, kv, dkv, sign=1):
        dq, count = list(acc[0]), acc[1]
        ks, vs = g.split(kv[0]), g.split(kv[1])
        seg_k = g.split(kv[2]) if seg is not None else [None] * g.nc
        dks, dvs = g.split(dkv[0]), g.split(dkv[1])
        src = (rank - t) % g.r if sign == 1 else (rank + t) % g.r
        for a in range(g.nc):
            for j in range(g.nc):
                cq, ck = g.chunk(rank, a), g.chunk(src, j)

                def pair(st, diagonal, offset, a=a, j=j):
                    dq_a, dk_j, dv_j, n_done = st
                    dq_a, dk_j, dv_j = _grad_block(g, diagonal, offset, qs[a], ks[j], vs[j],
                                                   seg_q[a], seg_k[j], dos[a], lse[a],
                                                   delta[a], dq_a, dk_j, dv_j)
                    return dq_a, dk_j, dv_j, n_done + 1

                dq[a], dks[j], dvs[j], count = _visit(g, cq, ck, pair,
                                                      (dq[a], dks[j], dvs[j], count))
        dkv = (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))
        return (dq, count), dkv

    kv = (k, v, seg)
    acc, dkv = step(0, (dq, count), kv, dkv)

    def stream(sign):
        def body(t, st):
            acc, kv, dkv = st
            kv, dkv = _send(kv, g.r, sign), _send(dkv, g.r, sign)  # dK/dV travel with K/V
            acc, dkv = step(t, acc, kv, dkv, sign)
            return acc, kv, dkv
        return body

    home = [] if g.fwd else [dkv]                     # no forward step: own dK/dV stay here
    for sign, steps in ((1, g.fwd), (-1, g.bwd)):
        if steps:
            start = dkv if sign == 1 else jax.tree.map(jnp.zeros_like, dkv)
            acc, _, moved = lax.fori_loop(1, steps + 1, stream(sign), (acc, kv, start))
            # Last hop, back to the owner (R-1 steps forward: rank r-1 -> r, one step on).
            home.append(_send(moved, g.r, -sign * steps))
    dq, count = acc
    dk, dv = home[0] if len(home) == 1 else jax.tree.map(jnp.add, *home)
    dq = jnp.concatenate(dq, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), count


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_attention(q, k, v, seg, g):
    return _ring_forward(q, k, v, seg, g)[0]


def _ring_attention_fwd(q, k, v, seg, g):
    out, lse, _ = _ring_forward(q, k, v, seg, g)
    return out, (q, k, v, seg, out, lse)


def _ring_attention_bwd(g, res, d_out):
    q, k, v, seg, out, lse = res
    dq, dk, dv, _ = _ring_backward(q, k, v, seg, out, lse, d_out, g)
    return dq, dk, dv, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# ----------------------------------------------------------------------------- public API

def hybrid_attention(q, k, v, *, mesh: Mesh, causal: bool = True, segment_ids=None,
                     impl: str = "auto", layout: str = "zigzag", block_q: int = 512,
                     block_k: int = 512, scale: float | None = None, window: int | None = None,
                     softcap: float | None = None):
    """Hybrid Ulysses x Ring attention over the mesh's ("ring", "seq") axes.

    Args:
      q: [B, S, N, H] queries, sharded P("data", ("ring", "seq")) or not sharded.
      k, v: [B, S, K, H] keys and values, same layout; N % K == 0 (heads that U does not
        divide are padded, ``heads.py``).
      mesh: a mesh with "ring" and "seq" axes, see ``make_mesh(seq=U, ring=R)``.
      causal: causal masking over true global positions; False attends both ways.
      segment_ids: optional [B, S] ints in the same token order as q; tokens attend only
        within their own segment.
      impl: validated like ``ulysses_attention``'s; every pair runs the chunked kernel
        (``chunked.block_forward``), whatever the value: the ring merge needs each pair's
        logsumexp, which the cuDNN and XLA paths do not return.
      layout: the token order of q, k, v, segment_ids and of the result:
        "zigzag": already in zigzag order, ``x[:, zigzag_permutation(S, R)]`` (S % (2UR) == 0);
          causal work is balanced and nothing is reordered. The model path.
        "contiguous": natural order, run as contiguous ring blocks; causal work unbalanced.
        "natural": natural order; for causal attention with S % (2UR) == 0 the shards are
          moved to zigzag order and back inside the shard_map (collective-permutes, 1 per array
          and direction when U is even, up to 4 of half shards when U is odd: about one extra
          shard of q/k/v traffic in and one of output out per device, no all-gather),
          otherwise (and always with a window, where contiguous blocks need the fewest ring
          steps and causal work is balanced anyway) as "contiguous".
      block_q, block_k: tile sizes inside each (q chunk, kv chunk) pair (clamped to the chunk):
        one fp32 [B, N/U, block_q, block_k] score tile lives at a time, never a chunk x chunk one.
      scale, softcap: as in ``ulysses_attention``.
      window: sliding window over true positions; ring steps that no pair needs are not run
        and their K/V not sent (``ring_steps``), pairs outside it are skipped.

    Returns:
      [B, S, N, H] in the order of ``layout``, sharded P("data", ("ring", "seq")).
    """
    return _hybrid(q, k, v, mesh, causal, segment_ids, impl, layout, (block_q, block_k),
                   counts=False, var=variant(q.shape[1], scale, window, softcap))


def block_counts(q, k, v, *, mesh: Mesh, causal: bool = True, segment_ids=None,
                 layout: str = "zigzag", block_q: int = 512, block_k: int = 512,
                 window: int | None = None) -> np.ndarray:
    """Debug: pairs (q chunk, kv chunk) each device computed, from the kernels' own counters.

    Runs the same forward and backward ring passes as ``hybrid_attention`` (backward with the
    output as cotangent) and returns int [D, R, U, 2]: forward and backward counts per device.
    It counts (q chunk, kv chunk) pairs, not the block_q x block_k tiles inside a pair.
    """
    var = variant(q.shape[1], None, window, None)
    fn = jax.jit(lambda q, k, v, seg: _hybrid(q, k, v, mesh, causal, seg, "auto", layout,
                                              (block_q, block_k), counts=True, var=var))
    return np.asarray(fn(q, k, v, segment_ids))


def _hybrid(q, k, v, mesh, causal, segment_ids, impl, layout, blocks, counts: bool, var: dict):
    """The one shard_map site: validation, exchange, ring, exchange back (or block counts)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown ring layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if RING not in mesh.axis_names:
        raise ValueError(f"mesh has no {RING!r} axis (axes: {mesh.axis_names}); build it with "
                         f"make_mesh(seq=U, ring=R)")
    lay = validate(q, k, v, segment_ids, mesh, chunks=2 if layout == "zigzag" else 1)
    kernels.resolve_impl(impl, q.dtype, q.shape[3],
                         backend=kernels.device_facts(mesh.devices.flat[0])[0])
    b, s, n, h = q.shape
    u, r = axis_size(mesh, SEQ), axis_size(mesh, RING)
    window = var["window"]
    reorder = layout == "natural" and causal and window is None and s % (2 * r * u) == 0
    zigzag = layout == "zigzag" or reorder
    nc = 2 if zigzag else 1
    if min(blocks) < 1:
        raise ValueError(f"block sizes must be positive, got block_q {blocks[0]}, "
                         f"block_k {blocks[1]}")
    c = s // (r * nc)
    fwd, bwd = ring_steps(r, nc, c, causal, window)
    scale = float(h ** -0.5) if var["scale"] is None else var["scale"]
    g = _Ring(r=r, nc=nc, c=c, causal=causal, scale=scale, block_q=blocks[0],
              block_k=blocks[1], window=window, softcap=var["softcap"], fwd=fwd, bwd=bwd)
    n_local, k_local = lay.n_local, lay.k_local
    fwd_moves = _half_shard_moves(r * u, r, to_zigzag=True) if reorder else None
    back_moves = _half_shard_moves(r * u, r, to_zigzag=False) if reorder else None
    batch_axis = DATA if DATA in mesh.axis_names else None
    spec = P(batch_axis, _FLAT)

    def body(q, k, v, *seg):
        # q: [B/D, L, N, H]; k, v: [B/D, L, K, H]; seg: [B/D, L]  (L = S/(R*U), local dims)
        seg = seg[0] if seg else None
        q, k, v = pad_heads(q, k, v, lay)                # k: [B, L, K'R, H] (copies, padding)
        if u > 1 or reorder:
            qkv = _pack_qkv(q, k, v, u)                                  # [B, L, N+2K, H]
            if reorder:
                qkv = _reorder(qkv, fwd_moves, r * u)
                seg = None if seg is None else _reorder(seg, fwd_moves, r * u)
            if u > 1:
                qkv = seq_to_heads(qkv)                                  # [B, S/R, (N+2K)/U, H]
                seg = None if seg is None else lax.all_gather(seg, SEQ, axis=1, tiled=True)
            q, k, v = _unpack_qkv(qkv, n_local, k_local)                 # q: [B, S/R, N/U, H]
        if counts:
            out, lse, fwd_count = _ring_forward(q, k, v, seg, g)
            bwd_count = _ring_backward(q, k, v, seg, out, lse, out, g)[3]
            return jnp.stack([fwd_count, bwd_count]).reshape(1, 1, 1, 2)
        out = _ring_attention(q, k, v, seg, g)                           # [B, S/R, N/U, H]
        out = heads_to_seq(out) if u > 1 else out                        # [B, L, N', H]
        out = _reorder(out, back_moves, r * u) if reorder else out
        return unpad_output(out, lay)                                    # [B, L, N, H]

    args = [shard(x, mesh, spec) for x in (q, k, v)]
    if segment_ids is not None:
        args.append(shard(segment_ids, mesh, spec))
    out_specs = P(batch_axis, RING, SEQ) if counts else spec
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec for _ in args), out_specs=out_specs)
    return fn(*args)
