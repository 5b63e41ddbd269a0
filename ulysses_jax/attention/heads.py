"""The padding of a head layout (``ulysses_jax/head_layout.py`` says which layout and why):
zero query and kv heads added and kv heads copied before the exchange, the added heads'
outputs dropped after it. Letters as there: N query heads, K kv heads, G = N // K, H head dim.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..head_layout import HeadLayout


def pad_heads(q, k, v, lay: HeadLayout):
    """Adds the layout's zero heads and kv copies, on each device's tokens.

    Args:
      q: [B, s, N, H]; k, v: [B, s, K, H].

    Returns:
      q [B, s, N', H] grouped by kv head (G' per group, the real ones first), k and v
      [B, s, K'R, H] (each kv head's R copies adjacent). Even layouts only repeat.
    """
    return (pad_query(q, lay), *pad_kv(k, v, lay))


def pad_query(q, lay: HeadLayout):
    """q [B, s, N, H] -> [B, s, N', H], grouped by kv head (``pad_heads``)."""
    if not lay.padded:
        return q
    b, s, _, h = q.shape
    g = lay.n // lay.k
    q = q.reshape(b, s, lay.k, g, h)                                       # [B, s, K, G, H]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, lay.k_pad - lay.k), (0, lay.g_pad - g), (0, 0)))
    return q.reshape(b, s, lay.n_pad, h)                                   # [B, s, N', H]


def pad_kv(k, v, lay: HeadLayout):
    """k, v [B, s, K, H] -> [B, s, K'R, H]: zero heads appended, each copied R times."""
    if lay.padded:
        widths = ((0, 0), (0, 0), (0, lay.k_pad - lay.k), (0, 0))
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)                      # [B, s, K', H]
    if lay.reps > 1:
        k = jnp.repeat(k, lay.reps, axis=2)                                # [B, s, K'R, H]
        v = jnp.repeat(v, lay.reps, axis=2)
    return k, v


def unpad_output(out, lay: HeadLayout):
    """[B, s, N', H] -> [B, s, N, H]: the real query heads' outputs, in their order."""
    if not lay.padded:
        return out
    b, s, _, h = out.shape
    out = out.reshape(b, s, lay.k_pad, lay.g_pad, h)[:, :, :lay.k, :lay.n // lay.k]
    return out.reshape(b, s, lay.n, h)
