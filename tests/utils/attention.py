"""Attention inputs by seed and shape: queries, keys, values, document ids and a cotangent."""
import functools

import jax
import jax.numpy as jnp

# The array each of the five keys split from the seed draws, in split order.
KEYS = ("q", "k", "v", "seg", "ct")


@functools.partial(jax.jit, static_argnames=("b", "s", "n", "kh", "h", "t", "dtype", "segments",
                                             "rate", "boundary", "keys"))
def attention_inputs(seed, b, s, n, kh, h=8, *, t=None, dtype=jnp.float32, segments=False,
                     rate=0.15, boundary=True, keys=KEYS):
    """Standard normal attention inputs, one program per shape (the same bits as op by op).

    Args:
      seed: an integer; each array draws from its own key of five split from it.
      b, s, n, kh, h: batch, key positions, query heads, kv heads, head dim.
      t: query positions (default ``s``).
      dtype: of q, k, v and ct.
      segments: draw document ids too: a token starts a document with probability ``rate``,
        and with ``boundary`` the token at ``s // 3`` of every row does (at least one boundary
        inside each row).
      keys: the names of ``KEYS`` in the order of the split keys they draw from.

    Returns:
      (q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], seg [B, S] int32 or None,
      ct [B, T, N, H]: a cotangent of the attention output).
    """
    t = s if t is None else t
    key = dict(zip(keys, jax.random.split(jax.random.key(seed), 5), strict=True))
    q = jax.random.normal(key["q"], (b, t, n, h), dtype)
    k = jax.random.normal(key["k"], (b, s, kh, h), dtype)
    v = jax.random.normal(key["v"], (b, s, kh, h), dtype)
    seg = None
    if segments:
        starts = jax.random.bernoulli(key["seg"], rate, (b, s))
        if boundary:
            starts = starts.at[:, s // 3].set(True)
        seg = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    ct = jax.random.normal(key["ct"], (b, t, n, h), dtype)
    return q, k, v, seg, ct
