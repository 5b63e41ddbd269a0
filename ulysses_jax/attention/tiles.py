"""Which tiles a blocked attention visits: block geometry, the ranges of key blocks each
query block sees (and of query blocks each key block is seen by), and each tile's mask.

Letters as in models/decoder.py: B batch, T query positions, S key positions; Tb and Sb the
query and key block sizes, nq and nk the numbers of blocks. The rules themselves (causal
skipping, segment skipping) are described in chunked.py, the kernel that uses them; the
hybrid ring (ring.py) plans each of its (query chunk, key chunk) pairs with the same class.
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
    # Skip tiles that share no segment (module docstring). False keeps only the causal skip,
    # the kernel as it was before segment skipping: for benchmarks that compare the two.
    skip_segments: bool = True

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

    def ranges(self, seg_q, seg_k):
        """Which tiles each loop visits: ((lo [nq], hi [nq]) key blocks per query block,
        (lo [nk], hi [nk]) query blocks per key block), int32.

        Without segment ids these are the static causal bounds. With them (module
        docstring), each range covers every tile whose id ranges intersect, and may be empty
        (lo >= hi) when a query block sees no key. Memory O(blocks), not O(blocks²).
        """
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

    def mask(self, i, j, seg_q, seg_k):
        """Boolean [B|1, 1, 1, Tb, Sb] mask for tile (i, j), or None when nothing is masked."""
        qpos = i * self.bq + jnp.arange(self.bq)                          # [Tb]
        kpos = j * self.bk + jnp.arange(self.bk)                          # [Sb]
        m = None
        if self.nk * self.bk != self.s:
            m = jnp.broadcast_to(kpos[None, :] < self.s, (self.bq, self.bk))
        if self.causal:
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
