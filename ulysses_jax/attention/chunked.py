"""Chunked (flash-style) local attention in plain JAX: linear memory on any backend.

Letters as in models/decoder.py: B batch, T query positions, S key positions, N query heads,
K kv heads, G = N // K query heads per kv head, H head dim; Tb and Sb are the query and key block sizes,
nq and nk the numbers of blocks.

Forward (FlashAttention-2 order). Queries are cut into nq blocks of Tb rows. For each query
block a loop walks over key blocks and keeps, per row, a running max m, a running sum l of
exp(score - m) and an unnormalised output accumulator, all fp32. A new key block rescales the
old sum and accumulator by exp(m_old - m_new) before adding its own terms (online softmax), so
only one [B, K, G, Tb, Sb] score tile lives at a time; the [T, S] score matrix never exists.
Key block 0 (seen by every query block) seeds the running state instead of a -inf/zeros init.
GQA/MQA reshape q to [B, T, K, G, H] and read each kv head once; K/V are never repeated.

Causal skipping. The key loop is a ``lax.fori_loop`` whose upper bound depends on the query
block index (a traced value, so it lowers to a while loop with a dynamic trip count): query
block i visits key blocks 0 .. ceil(min((i+1)*Tb, T) / Sb) - 1 only. Blocks above the diagonal
are never computed, not computed-and-masked; the diagonal blocks apply the position mask.

Segment skipping. With segment ids (packed documents) a tile whose query rows and key columns
share no document is skipped too: from the smallest and largest id of each block's valid
positions, tile (i, j) is visible only if the two id ranges intersect (and, causal, j is not
above the diagonal). Query block i visits key blocks lo_i .. hi_i - 1, a range covering
every visible one found by two binary searches (``tiles._covering``), seeded by block lo_i; the
backward pass walks each key block's query range the same way. For packed rows (ids that
increase along the row, as the loader emits them) the ranges are exactly the first and last
visible blocks, so a row costs about the sum of its documents' squares, not S². For any
other ids they still cover every visible tile (exact results, less skipping: padding id 0
after the last document removes the upper bound, which the causal bound then gives); rows
of a batch share one range (the union).

Window skipping. With a sliding window W a query at position i sees the keys i - W < j <= i
(causal), or |i - j| < W without the causal mask, always within its document. Query block i
then visits only the key blocks that hold a key within reach of one of its rows, and key
block j only the query blocks that reach it (``tiles._Plan._window_ranges``: exact, from the
block bounds), so cost is O(S x W) tiles instead of O(S²), and the tiles on the window's
edges get the band mask. With segment ids too, each loop visits the intersection of both
ranges. A ring pair (ring.py) passes the offset between its query and key chunks, so the
same rule holds on true positions.

Scale and softcap. Scores are scale * q.k (default 1/sqrt(H)); with a softcap c (Gemma 2)
they become c * tanh(score / c) before masking, and the backward multiplies dS by the
derivative, 1 - tanh², recomputed with the tile (in both loop orders).

Backward (custom_vjp). The residuals are q, k, v, out and the per-row logsumexp (O(S) extra).
One scan walks over key blocks j; an inner fori_loop walks over the query blocks that can see
block j (from floor(j*Sb / Tb) when causal, from 0 otherwise), recomputes the score tile,
P = exp(S - lse), and with delta = rowsum(dO * O) forms dS = P * (dP - delta). dK_j and dV_j
accumulate in the inner carry; dQ accumulates into one fp32 [B, T, K, G, H] buffer in the
scan carry (updated in place). Backward memory is O(S * H + Tb * Sb) per head, never S x S.
The backward is not itself differentiable (no second derivatives).

Layout. Every block is a slice of the arrays as they come ([B, T, N, H] rows i*Tb ...): no
loop reads a pre-transposed [nq, B, Tb, ...] copy, and the output, logsumexp, dQ, dK and dV
are written into their final layout in place, so the kernel holds no second copy of q, dO
or its results (each such copy is as large as q).

Ragged lengths. T and S are padded up to multiples of the (clamped) block sizes; padded keys are
masked out, padded query rows are computed and dropped (their cotangent is zero, so they add
nothing to dK/dV). A row that sees no key gets output 0, not NaN.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from .tiles import _Plan

_F32 = jnp.float32


def _pad_to(x, axis: int, size: int):
    """Pads ``x`` with zeros along ``axis`` up to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _scores(plan, scale, q_i, k, i, j, seg_q, seg_k, offset=0):
    """Scaled, capped, masked fp32 scores of query block i against key block j.

    Returns (scores [B, K, G, Tb, Sb] with masked entries -inf, k_j [B, Sb, K, H], and
    tanh(raw / c) [B, K, G, Tb, Sb] with a softcap c, for its derivative; else None).
    """
    k_j = lax.dynamic_slice_in_dim(k, j * plan.bk, plan.bk, 1)            # [B, Sb, K, H]
    s = jnp.einsum("btkgh,bskh->bkgts", q_i, k_j, preferred_element_type=_F32) * scale
    capped = None
    if plan.softcap is not None:
        capped = jnp.tanh(s / plan.softcap)                               # [B, K, G, Tb, Sb]
        s = plan.softcap * capped
    mask = plan.mask(i, j, seg_q, seg_k, offset)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return s, k_j, capped


def _rows(x, i, block: int, kh: int):
    """Rows i*block .. (i+1)*block - 1 of [B, T, N, H] as [B, Tb, K, G, H]: a slice of the
    array as it is (no blocked copy of the whole)."""
    b, _, n, h = x.shape
    return lax.dynamic_slice_in_dim(x, i * block, block, 1).reshape(b, block, kh, n // kh, h)


def _row_stats(x, i, block: int, kh: int):
    """Rows of a per-row statistic [B, T, N] as [B, K, G, Tb] (query head n = kv head * G +
    group member)."""
    b, _, n = x.shape
    rows = lax.dynamic_slice_in_dim(x, i * block, block, 1)                # [B, Tb, N]
    return rows.reshape(b, block, kh, n // kh).transpose(0, 2, 3, 1)


def _forward(q, k, v, seg_q, seg_k, plan: _Plan, scale: float, out_dtype=None, offset=0):
    """Blocked forward pass on padded inputs.

    Args:
      q: [B, nq*Tb, N, H]; k, v: [B, nk*Sb, K, H]; seg_q: padded [B, nq*Tb] ints or None,
      seg_k: padded [B, nk*Sb] ints or None (both or neither).
      out_dtype: dtype of the output, default q's (fp32 when the caller merges partial results).
      offset: with a window, query row 0's position minus key column 0's (an int, may be
        traced); 0 for attention of a sequence over itself.

    Returns:
      out [B, nq*Tb, N, H], the normalised attention output; lse [B, nq*Tb, N] fp32, the
      logsumexp of each row's scores (-inf on rows that see no key); and the number of
      (query block, key block) tiles computed, an int32 scalar.
    """
    b, tp, n, h = q.shape
    kh = k.shape[2]
    out_dtype = out_dtype or q.dtype
    (key_lo, key_hi), _ = plan.ranges(seg_q, seg_k, offset)              # [nq] each

    def one_query_block(carry, xs):
        visits, out_all, lse_all = carry                                  # [B, T, N, H], [B, T, N]
        i, lo, hi = xs
        q_i = _rows(q, i, plan.bq, kh)                                    # [B, Tb, K, G, H]

        def tile(j):
            """Softmax stats of one key block on its own: local max, sum, unnormalised P @ V."""
            s, *_ = _scores(plan, scale, q_i, k, i, j, seg_q, seg_k, offset)  # [B,K,G,Tb,Sb]
            v_j = lax.dynamic_slice_in_dim(v, j * plan.bk, plan.bk, 1)    # [B, Sb, K, H]
            m = s.max(-1)                                                 # [B, K, G, Tb]
            # A fully masked row has m = -inf; shifting by 0 keeps exp(-inf) = 0, not NaN.
            p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])  # [B, K, G, Tb, Sb]
            pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v.dtype), v_j,
                            preferred_element_type=_F32)                  # [B, K, G, Tb, H]
            return m, p.sum(-1), pv

        def merge(j, carry):
            """Online softmax: rescale both partial results to their common running max."""
            m, l, acc, visits = carry
            m_j, l_j, pv_j = tile(j)
            m_new = jnp.maximum(m, m_j)                                   # [B, K, G, Tb]
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            a, c = jnp.exp(m - shift), jnp.exp(m_j - shift)               # [B, K, G, Tb]
            return m_new, a * l + c * l_j, a[..., None] * acc + c[..., None] * pv_j, visits + 1

        # The first visible key block seeds the carry, so the carry is computed from the
        # inputs (inside shard_map it then varies over the same mesh axes as the loop body's
        # output, which a jnp.zeros init would not). A query block that sees no key block
        # (possible for a ring pair) computes that one tile and discards it: l = 0 below.
        nonempty = hi > lo
        m, l, acc = tile(jnp.minimum(lo, plan.nk - 1))
        m = jnp.where(nonempty, m, -jnp.inf)
        l, acc = l * nonempty, acc * nonempty
        visits = visits + nonempty.astype(jnp.int32)
        if plan.nk > 1:  # one key block: the seed is all there is (no loop, no loop buffers)
            m, l, acc, visits = lax.fori_loop(lo + 1, hi, merge, (m, l, acc, visits))
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]                    # [B, K, G, Tb, H]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)  # [B, K, G, Tb]
        out = out.transpose(0, 3, 1, 2, 4).reshape(b, plan.bq, n, h)      # [B, Tb, N, H]
        lse = lse.transpose(0, 3, 1, 2).reshape(b, plan.bq, n)            # [B, Tb, N]
        # Written into the result in place: no [nq, ...] stack to transpose at the end.
        out_all = lax.dynamic_update_slice_in_dim(out_all, out.astype(out_dtype), i * plan.bq, 1)
        lse_all = lax.dynamic_update_slice_in_dim(lse_all, lse, i * plan.bq, 1)
        return (visits, out_all, lse_all), None

    # zeros_like of the inputs: inside shard_map the carries then vary over the same mesh
    # axes as what the loop writes into them.
    init = (jnp.zeros_like(key_lo[0]), jnp.zeros_like(q, dtype=out_dtype),
            jnp.zeros_like(q[..., 0], dtype=_F32))
    (visits, out, lse), _ = lax.scan(one_query_block, init,
                                     (jnp.arange(plan.nq), key_lo, key_hi))
    return out, lse, visits                                               # [B, T, N, H], [B, T, N]


def _delta(out, d_out):
    """rowsum(dO * O), fp32 [B, T, N]: the softmax-backward term of FlashAttention-2.
    (Accumulated in fp32 by the contraction itself: no fp32 copies of O and dO.)"""
    return jnp.einsum("btnh,btnh->btn", out, d_out, preferred_element_type=_F32)


def _backward(q, k, v, seg_q, seg_k, lse, delta, d_out, plan: _Plan, scale: float,
              grad_dtype=None, out=None, offset=0):
    """Blocked FlashAttention-2 backward on padded inputs (shapes as in ``_forward``).

    Args:
      lse: [B, nq*Tb, N] fp32, the logsumexp of each row over ALL the keys its output saw
        (for a partial key range inside a ring, the merged one); -inf on rows that saw none.
      delta: [B, nq*Tb, N] fp32, ``_delta`` of the final output and its cotangent; or None,
        and ``out`` (the final output) given: each query block's delta is then formed where
        it is used, with no fp32 [B, T, N, H] operands.
      grad_dtype: dtype of dq, dk, dv; default the dtypes of q, k, v.
      offset: as in ``_forward``.

    Returns:
      dq, dk, dv and the number of tiles recomputed.

    Two loop orders, the same tiles: over key blocks outside (dq accumulates in an fp32
    [B, T, N, H] buffer) or, when a kv head serves more than two query heads (G > 2, GQA),
    over query blocks outside (dk and dv accumulate in fp32 [B, S, K, H] buffers, 2K < N
    heads' worth: less memory).
    """
    if q.shape[2] > 2 * k.shape[2]:
        return _backward_by_query(q, k, v, seg_q, seg_k, lse, delta, d_out, plan, scale,
                                  grad_dtype, out, offset)
    b, tp, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    sp = plan.nk * plan.bk
    # A row that saw no key: lse +inf makes p = exp(-inf - inf) = 0 instead of NaN.
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                       # [B, T, N]
    dt = lambda x: grad_dtype or x.dtype

    _, (query_lo, query_hi) = plan.ranges(seg_q, seg_k, offset)          # [nk] each

    def one_key_block(carry, xs):
        j, lo, hi = xs
        dq_acc, dk_all, dv_all, visits = carry        # [B, T, K, G, H] fp32, [B, S, K, H] x2, []
        v_j = lax.dynamic_slice_in_dim(v, j * plan.bk, plan.bk, 1)        # [B, Sb, K, H]

        def one_query_block(i, inner):
            dk_j, dv_j, dq_acc, visits = inner
            q_i, do_i = _rows(q, i, plan.bq, kh), _rows(d_out, i, plan.bq, kh)  # [B, Tb, K, G, H]
            lse_i = _row_stats(lse, i, plan.bq, kh)                       # [B, K, G, Tb]
            delta_i = _block_delta(delta, out, do_i, i, plan.bq, kh)      # [B, K, G, Tb]
            s, k_j, capped = _scores(plan, scale, q_i, k, i, j, seg_q, seg_k, offset)
            p = jnp.exp(s - lse_i[..., None])                             # [B, K, G, Tb, Sb]
            dv_j += jnp.einsum("bkgts,btkgh->bskh", p.astype(do_i.dtype), do_i,
                               preferred_element_type=_F32)               # [B, Sb, K, H]
            dp = jnp.einsum("btkgh,bskh->bkgts", do_i, v_j, preferred_element_type=_F32)
            # Masked entries have p == 0, hence ds == 0: no second mask needed.
            ds = _softcap_grad(p * (dp - delta_i[..., None]), capped).astype(q.dtype)
            dq_i = jnp.einsum("bkgts,bskh->btkgh", ds, k_j, preferred_element_type=_F32)
            # dq accumulates in the rows' own layout, in place (XLA updates the carry).
            old = lax.dynamic_slice_in_dim(dq_acc, i * plan.bq, plan.bq, 1)
            dq_acc = lax.dynamic_update_slice_in_dim(dq_acc, old + dq_i, i * plan.bq, 1)
            dk_j += jnp.einsum("bkgts,btkgh->bskh", ds, q_i, preferred_element_type=_F32)
            return dk_j, dv_j, dq_acc, visits + 1

        zeros = jnp.zeros_like(lse, shape=(b, plan.bk, kh, h))            # see init below
        if plan.nq > 1:
            dk_j, dv_j, dq_acc, visits = lax.fori_loop(
                lo, hi, one_query_block, (zeros, zeros, dq_acc, visits))
        else:  # one query block: no loop. If it sees no key, its p is 0 and it adds nothing.
            dk_j, dv_j, dq_acc, _ = one_query_block(0, (zeros, zeros, dq_acc, visits))
            visits = visits + (hi > lo).astype(jnp.int32)
        dk_all = lax.dynamic_update_slice_in_dim(dk_all, (dk_j * scale).astype(dk_all.dtype),
                                                 j * plan.bk, 1)
        dv_all = lax.dynamic_update_slice_in_dim(dv_all, dv_j.astype(dv_all.dtype),
                                                 j * plan.bk, 1)
        return (dq_acc, dk_all, dv_all, visits), None

    # zeros_like(lse): lse depends on every input, so inside shard_map the zeros vary over
    # the same mesh axes as the loop bodies' outputs (a plain jnp.zeros would not).
    init = (jnp.zeros_like(lse, shape=(b, tp, kh, g, h)),
            jnp.zeros_like(lse, shape=(b, sp, kh, h), dtype=dt(k)),
            jnp.zeros_like(lse, shape=(b, sp, kh, h), dtype=dt(v)),
            jnp.zeros_like(query_lo[0]))
    (dq, dk, dv, visits), _ = lax.scan(one_key_block, init,
                                       (jnp.arange(plan.nk), query_lo, query_hi))
    dq = (dq * scale).reshape(b, tp, n, h)                                # [B, T, N, H]
    return dq.astype(dt(q)), dk, dv, visits


def _block_delta(delta, out, do_i, i, block: int, kh: int):
    """Query block i's delta [B, K, G, Tb]: a slice of ``delta``, or (None) formed from the
    block of the output and its cotangent do_i [B, Tb, K, G, H]."""
    if delta is not None:
        return _row_stats(delta, i, block, kh)
    o_i = _rows(out, i, block, kh)                                        # [B, Tb, K, G, H]
    return jnp.einsum("btkgh,btkgh->bkgt", o_i, do_i, preferred_element_type=_F32)


def _softcap_grad(ds, capped):
    """dS [B, K, G, Tb, Sb] through the softcap: d(c tanh(x / c)) / dx = 1 - tanh² (``capped``
    from ``_scores``; None without a cap)."""
    return ds if capped is None else ds * (1.0 - capped * capped)


def _backward_by_query(q, k, v, seg_q, seg_k, lse, delta, d_out, plan: _Plan, scale: float,
                       grad_dtype=None, out=None, offset=0):
    """``_backward`` with the query blocks in the outer loop (see there): dq of a block is
    finished in its inner loop and written once; dk and dv accumulate over query blocks."""
    b, tp, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    sp = plan.nk * plan.bk
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)                       # [B, T, N]
    dt = lambda x: grad_dtype or x.dtype
    (key_lo, key_hi), _ = plan.ranges(seg_q, seg_k, offset)              # [nq] each

    def one_query_block(carry, xs):
        i, lo, hi = xs
        dq_all, dk_acc, dv_acc, visits = carry        # [B, T, N, H], [B, S, K, H] fp32 x2, []
        q_i, do_i = _rows(q, i, plan.bq, kh), _rows(d_out, i, plan.bq, kh)  # [B, Tb, K, G, H]
        lse_i = _row_stats(lse, i, plan.bq, kh)                           # [B, K, G, Tb]
        delta_i = _block_delta(delta, out, do_i, i, plan.bq, kh)          # [B, K, G, Tb]

        def one_key_block(j, inner):
            dq_i, dk_acc, dv_acc, visits = inner
            s, k_j, capped = _scores(plan, scale, q_i, k, i, j, seg_q, seg_k, offset)
            v_j = lax.dynamic_slice_in_dim(v, j * plan.bk, plan.bk, 1)    # [B, Sb, K, H]
            p = jnp.exp(s - lse_i[..., None])                             # [B, K, G, Tb, Sb]
            dv_j = jnp.einsum("bkgts,btkgh->bskh", p.astype(do_i.dtype), do_i,
                              preferred_element_type=_F32)                # [B, Sb, K, H]
            dp = jnp.einsum("btkgh,bskh->bkgts", do_i, v_j, preferred_element_type=_F32)
            ds = _softcap_grad(p * (dp - delta_i[..., None]), capped).astype(q.dtype)
            dq_i += jnp.einsum("bkgts,bskh->btkgh", ds, k_j, preferred_element_type=_F32)
            dk_j = jnp.einsum("bkgts,btkgh->bskh", ds, q_i, preferred_element_type=_F32)
            add = lambda acc, x: lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, j * plan.bk, plan.bk, 1) + x, j * plan.bk, 1)
            return dq_i, add(dk_acc, dk_j), add(dv_acc, dv_j), visits + 1

        zeros = jnp.zeros_like(lse, shape=(b, plan.bq, kh, g, h))         # see init below
        if plan.nk > 1:
            dq_i, dk_acc, dv_acc, visits = lax.fori_loop(
                lo, hi, one_key_block, (zeros, dk_acc, dv_acc, visits))
        else:  # one key block: no loop. If the block sees no key, its p is 0.
            dq_i, dk_acc, dv_acc, _ = one_key_block(0, (zeros, dk_acc, dv_acc, visits))
            visits = visits + (hi > lo).astype(jnp.int32)
        dq_i = (dq_i * scale).reshape(b, plan.bq, n, h).astype(dq_all.dtype)
        return (lax.dynamic_update_slice_in_dim(dq_all, dq_i, i * plan.bq, 1), dk_acc,
                dv_acc, visits), None

    # zeros_like of the inputs: inside shard_map the carries vary over the same mesh axes as
    # what the loops write into them.
    init = (jnp.zeros_like(q, dtype=dt(q)), jnp.zeros_like(lse, shape=(b, sp, kh, h)),
            jnp.zeros_like(lse, shape=(b, sp, kh, h)), jnp.zeros_like(key_lo[0]))
    (dq, dk, dv, visits), _ = lax.scan(one_query_block, init,
                                       (jnp.arange(plan.nq), key_lo, key_hi))
    return dq, (dk * scale).astype(dt(k)), dv.astype(dt(v)), visits


def _pad_inputs(q, k, v, seg_q, seg_k, plan: _Plan):
    """Pads q, seg_q to nq*Tb and k, v, seg_k to nk*Sb positions (zeros).

    Padded keys are masked by position; padded query rows are computed and dropped.
    """
    tp, sp = plan.nq * plan.bq, plan.nk * plan.bk
    q, k, v = _pad_to(q, 1, tp), _pad_to(k, 1, sp), _pad_to(v, 1, sp)
    if seg_q is not None:
        seg_q, seg_k = _pad_to(seg_q, 1, tp), _pad_to(seg_k, 1, sp)
    return q, k, v, seg_q, seg_k


# The kernel's loops carry this name scope, so a compiled program shows them
# (hlo.attention_kernels).
SCOPE = "chunked_attention"


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, seg, plan, scale):
    with jax.named_scope(SCOPE):
        out, _, _ = _forward(*_pad_inputs(q, k, v, seg, seg, plan), plan, scale)
    return out[:, :plan.t]


def _attention_fwd(q, k, v, seg, plan, scale):
    padded = _pad_inputs(q, k, v, seg, seg, plan)
    with jax.named_scope(SCOPE):
        out, lse, _ = _forward(*padded, plan, scale)
    return out[:, :plan.t], (padded, out, lse)


def _attention_bwd(plan, scale, res, d_out):
    padded, out, lse = res
    d_out = _pad_to(d_out, 1, out.shape[1])
    with jax.named_scope(SCOPE):
        dq, dk, dv, _ = _backward(*padded, lse, None, d_out, plan, scale, out=out)
    return dq[:, :plan.t], dk[:, :plan.s], dv[:, :plan.s], None


_attention.defvjp(_attention_fwd, _attention_bwd)


def chunked_attention(q, k, v, *, causal: bool, segment_ids=None, block_q: int = 512,
                      block_k: int = 512, scale: float | None = None,
                      window: int | None = None, softcap: float | None = None):
    """Memory-linear attention: online softmax over key blocks, recomputing backward.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values; N must be a multiple of K (GQA/MQA).
      causal: mask keys after each query and skip key blocks above the diagonal (T == S).
      segment_ids: optional [B, S] ints; a query only sees keys with the same id (T == S).
      block_q, block_k: query / key block sizes, clamped to T and S; need not divide them.
      scale: logit scale (a Python float), default 1/sqrt(H).
      window: sliding window W (T == S): query i sees keys i - W < j <= i (causal) or
        |i - j| < W; tiles outside it are never visited, so cost is O(S x W).
      softcap: tanh logit cap c > 0: scores c * tanh(scale * q.k / c), before masking.

    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B, S, K, H] matching q {q.shape}")
    if n % kh:
        raise ValueError(f"query heads {n} not divisible by kv heads {kh}")
    if (causal or segment_ids is not None) and t != s:
        raise ValueError(f"causal or segment masks need T == S, got T {t}, S {s}")
    if segment_ids is not None and tuple(segment_ids.shape) != (b, s):
        raise ValueError(f"segment_ids must be [B, S] = {(b, s)}, got {tuple(segment_ids.shape)}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q {block_q}, block_k {block_k}")
    check_variants(window, softcap)
    if window is not None and t != s:
        raise ValueError(f"a sliding window needs T == S, got T {t}, S {s}")
    scale = float(h ** -0.5 if scale is None else scale)
    plan = block_plan(t, s, causal, block_q, block_k, window=window, softcap=softcap)
    if segment_ids is not None:
        # The tiles' masks depend only on the segment ids, the same in every layer: without
        # this tie JAX's scan partial evaluation computes them for all tiles at once, outside
        # the layer loop, and keeps them (a [nq, B, K, G, Tb, Sb] mask, growing with S).
        q, segment_ids = lax.optimization_barrier((q, segment_ids))
    return _attention(q, k, v, segment_ids, plan, scale)


def check_variants(window, softcap) -> None:
    """Raises ValueError unless ``window`` is None or a positive int and ``softcap`` is None
    or a positive number."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys each query sees, itself "
                         f"included) or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")


# ----------------------------------------------------------------------------- blocks for a ring

def block_plan(t: int, s: int, causal: bool, block_q: int = 512, block_k: int = 512, *,
               window: int | None = None, softcap: float | None = None) -> _Plan:
    """Static block geometry, block sizes clamped to the lengths: ``chunked_attention``'s, and
    the one ``block_forward`` / ``block_backward`` take."""
    return _Plan(t, s, min(block_q, t), min(block_k, s), causal, window=window,
                 softcap=None if softcap is None else float(softcap))


def block_forward(q, k, v, seg_q, seg_k, plan: _Plan, scale: float, offset=0):
    """Attention of q over ONE key range, with the statistics needed to merge ranges.

    A ring attention step sees a slice of the keys at a time; it calls this on each (query
    chunk, key chunk) pair and merges the results by their logsumexp. Memory is one
    [B, K, G, Tb, Sb] tile, as in ``chunked_attention``.

    Args:
      q: [B, T, N, H]; k, v: [B, S, K, H]; seg_q [B, T], seg_k [B, S] ints, or both None.
      plan: ``block_plan(T, S, causal)``; causal masks key j > query i by local position,
        which is right for a pair whose query and key chunks start at the same position.
      offset: with a windowed plan, the query chunk's first position minus the key chunk's
        (an int, may be traced): the window and causal masks then use true positions.

    Returns:
      out [B, T, N, H] fp32, normalised over this key range, and lse [B, T, N] fp32 (-inf on
      rows that see no key of the range; their out is 0).
    """
    out, lse, _ = _forward(*_pad_inputs(q, k, v, seg_q, seg_k, plan), plan, scale,
                           out_dtype=_F32, offset=offset)
    return out[:, :plan.t], lse[:, :plan.t]


def block_backward(q, k, v, seg_q, seg_k, lse, delta, d_out, plan: _Plan, scale: float,
                   offset=0):
    """Gradients of one (query chunk, key range) pair, given the rows' FINAL statistics.

    Args:
      q, k, v, seg_q, seg_k, plan, scale, offset: as in ``block_forward``.
      lse: [B, T, N] fp32, each row's logsumexp over all the keys it attended to (-inf none).
      delta: [B, T, N] fp32, ``rowsum(d_out * final out)``.
      d_out: [B, T, N, H], the cotangent of the final output.

    Returns:
      dq [B, T, N, H], dk, dv [B, S, K, H], all fp32, for summing over key ranges / queries.
    """
    qp, kp, vp, sq, sk = _pad_inputs(q, k, v, seg_q, seg_k, plan)
    tp = qp.shape[1]
    lse = _pad_to(lse, 1, tp)          # padded rows: lse 0 with zero cotangent, add nothing
    dq, dk, dv, _ = _backward(qp, kp, vp, sq, sk, lse, _pad_to(delta, 1, tp),
                              _pad_to(d_out, 1, tp), plan, scale, grad_dtype=_F32,
                              offset=offset)
    return dq[:, :plan.t], dk[:, :plan.s], dv[:, :plan.s]
