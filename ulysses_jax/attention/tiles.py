"""Which tiles a blocked attention visits: block geometry, the ranges of key blocks each
query block sees (and of query blocks each key block is seen by), and each tile's mask.

Letters as in models/decoder.py: B batch, T query positions, S key positions; Tb and Sb the
query and key block sizes, nq and nk the numbers of blocks. The rules themselves (causal,
segment and window skipping) are described in chunked.py, the kernel that uses them; the
hybrid ring (ring.py) plans each of its (query chunk, key chunk) pairs with the same class,
giving the offset between the two chunks when a window makes true positions matter.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static block geometry shared by forward and backward (hashable: a custom_vjp static)."""
    t: int          # query length
    s: int          # key length
    bq: int         # query block, already clamped to t
    bk: int         # key block, already clamped to s
    causal: bool
    # Skip tiles that share no segment (chunked.py docstring). False keeps only the causal skip,
    # the kernel as it was before segment skipping: for benchmarks that compare the two.
    skip_segments: bool = True
    # Sliding window W (chunked.py docstring): key k is visible from query q only if q - k < W
    # (and q - k > -W without the causal mask). None: no window.
    window: int | None = None
    # tanh logit cap c (Gemma 2): scores become c * tanh(scores / c) before masking.
    softcap: float | None = None

    @property
    def nq(self) -> int:
        return -(-self.t // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.s // self.bk)

    def key_hi(self, i):
        """One past the last key block that query block ``i`` must visit."""
        if not self.causal:
            return self.nk
        last_row = jnp.minimum((i + 1) * self.bq, self.t)
        return jnp.minimum((last_row + self.bk - 1) // self.bk, self.nk)

    def query_lo(self, j):
        """First query block that can see key block ``j``."""
        return (j * self.bk) // self.bq if self.causal else 0

    def ranges(self, seg_q, seg_k, offset=0):
        """Which tiles each loop visits: ((lo [nq], hi [nq]) key blocks per query block,
        (lo [nk], hi [nk]) query blocks per key block), int32.

        Without segment ids or a window these are the static causal bounds. With segment ids
        (chunked.py docstring) each range covers every tile whose id ranges intersect; with a
        window, exactly the tiles that hold a pair inside it (``offset``: query row 0's
        position minus key column 0's, may be traced); with both, the intersection. A range
        may be empty (lo >= hi) when a query block sees no key. Memory O(blocks).
        """
        if self.window is not None:
            return self._window_ranges(seg_q, seg_k, offset)
        qi, kj = jnp.arange(self.nq), jnp.arange(self.nk)
        if seg_q is None or not self.skip_segments:
            full = lambda x, n: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (n,))
            return ((full(0, self.nq), full(self.key_hi(qi), self.nq)),
                    (full(self.query_lo(kj), self.nk), full(self.nq, self.nk)))
        q_lo, q_hi = _id_ranges(seg_q, self.bq, self.nq, self.t)          # [B, nq]
        k_lo, k_hi = _id_ranges(seg_k, self.bk, self.nk, self.s)          # [B, nk]
        key_lo, key_hi = _covering(q_lo, q_hi, k_lo, k_hi)                # [nq] each
        query_lo, query_hi = _covering(k_lo, k_hi, q_lo, q_hi)            # [nk] each
        if self.causal:
            key_hi = jnp.minimum(key_hi, self.key_hi(qi))
            query_lo = jnp.maximum(query_lo, self.query_lo(kj))
        return (key_lo, key_hi), (query_lo, query_hi)

    def _window_ranges(self, seg_q, seg_k, offset):
        """``ranges`` with a window: query block i (positions [a, b] once shifted by
        ``offset``) sees keys [a - W + 1, b] (causal) or [a - W + 1, b + W - 1]; key block j
        (keys [c, d]) is seen by queries [c, d + W - 1] or [c - W + 1, d + W - 1], shifted back."""
        reach = self.window - 1
        qi, kj = jnp.arange(self.nq), jnp.arange(self.nk)
        first_q = qi * self.bq + offset                                   # [nq]
        last_q = jnp.minimum((qi + 1) * self.bq, self.t) - 1 + offset
        key_lo, key_hi = _blocks_meeting(first_q - reach, last_q + (0 if self.causal else reach),
                                         self.bk, self.s)                 # [nq] each
        first_k, last_k = kj * self.bk, jnp.minimum((kj + 1) * self.bk, self.s) - 1  # [nk]
        query_lo, query_hi = _blocks_meeting(first_k - (0 if self.causal else reach) - offset,
                                             last_k + reach - offset, self.bq, self.t)
        if seg_q is not None and self.skip_segments:
            # Segment ranges alone (their causal bound assumes offset 0; the window's has it).
            (sk_lo, sk_hi), (sq_lo, sq_hi) = dataclasses.replace(
                self, window=None, causal=False).ranges(seg_q, seg_k)
            key_lo, key_hi = jnp.maximum(key_lo, sk_lo), jnp.minimum(key_hi, sk_hi)
            query_lo, query_hi = jnp.maximum(query_lo, sq_lo), jnp.minimum(query_hi, sq_hi)
        return (key_lo, key_hi), (query_lo, query_hi)

    def mask(self, i, j, seg_q, seg_k, offset=0):
        """Boolean [B|1, 1, 1, Tb, Sb] mask for tile (i, j), or None when nothing is masked."""
        qpos = i * self.bq + jnp.arange(self.bq)                          # [Tb]
        kpos = j * self.bk + jnp.arange(self.bk)                          # [Sb]
        m = None
        if self.nk * self.bk != self.s:
            m = jnp.broadcast_to(kpos[None, :] < self.s, (self.bq, self.bk))
        if self.window is not None:
            rel = (qpos + offset)[:, None] - kpos[None, :]                # [Tb, Sb]
            c = (rel < self.window) & ((rel >= 0) if self.causal else (rel > -self.window))
            m = c if m is None else m & c
        elif self.causal:
            c = qpos[:, None] >= kpos[None, :]                            # [Tb, Sb]
            m = c if m is None else m & c
        if m is not None:
            m = m[None]                                                   # [1, Tb, Sb]
        if seg_q is not None:
            sq = lax.dynamic_slice_in_dim(seg_q, i * self.bq, self.bq, 1)  # [B, Tb]
            sk = lax.dynamic_slice_in_dim(seg_k, j * self.bk, self.bk, 1)  # [B, Sb]
            e = sq[:, :, None] == sk[:, None, :]                          # [B, Tb, Sb]
            m = e if m is None else m & e
        return None if m is None else m[:, None, None]


def _blocks_meeting(lo_pos, hi_pos, block: int, length: int):
    """[lo, hi) of the blocks of ``block`` positions (``length`` real ones) that hold a
    position of [lo_pos, hi_pos]; (0, 0) when none does. int32, shaped like the bounds."""
    lo_pos, hi_pos = jnp.maximum(lo_pos, 0), jnp.minimum(hi_pos, length - 1)
    empty = lo_pos > hi_pos
    lo = jnp.where(empty, 0, lo_pos // block).astype(jnp.int32)
    return lo, jnp.where(empty, 0, hi_pos // block + 1).astype(jnp.int32)


def _id_ranges(seg, block: int, n: int, valid: int):
    """Smallest and largest segment id of each block's valid positions: [B, n*block] ->
    ([B, n], [B, n]). Positions past ``valid`` (padding added here) are left out."""
    b = seg.shape[0]
    ok = (jnp.arange(n * block) < valid)[None]                            # [1, n*block]
    info = jnp.iinfo(seg.dtype)
    lo = jnp.where(ok, seg, info.max).reshape(b, n, block).min(-1)
    hi = jnp.where(ok, seg, info.min).reshape(b, n, block).max(-1)
    return lo, hi


def _covering(a_lo, a_hi, b_lo, b_hi):
    """For each block i of side a, a range [lo_i, hi_i) of side-b blocks holding every j
    whose id range [b_lo_j, b_hi_j] meets [a_lo_i, a_hi_i], in some row; int32 [n_a] each.

    Per row, the running maximum of b_hi and the running minimum of b_lo from the end are
    non-decreasing, so two binary searches bound the meeting blocks: j meets i only if
    max(b_hi[:j+1]) >= a_lo_i and min(b_lo[j:]) <= a_hi_i. For ids that never decrease along
    the row the bounds are exact. Rows are joined by the union of their ranges.
    """
    first_hi = lax.cummax(b_hi, axis=1)                                   # [B, n_b]
    last_lo = lax.cummin(b_lo, axis=1, reverse=True)                      # [B, n_b]
    search = jax.vmap(lambda arr, x, side: jnp.searchsorted(arr, x, side=side),
                      in_axes=(0, 0, None))
    lo = search(first_hi, a_lo, "left")                                   # [B, n_a]
    hi = search(last_lo, a_hi, "right")
    seen = lo < hi
    n_b = b_lo.shape[1]
    lo = jnp.where(seen, lo, n_b).min(0)
    hi = jnp.where(seen, hi, 0).max(0)
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)
