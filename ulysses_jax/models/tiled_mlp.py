"""TiledMLP (ALST): a token-local function applied over sequence chunks, with a backward pass
that recomputes each chunk from the input it already has.

Letters as in models/decoder.py: B batch, S tokens on this device, D model dim, F ffn dim;
C the chunk, n = S / C the chunks.

The MLP's [B, S, F] intermediates are the largest activations of a layer. Running it over
chunks of C tokens keeps one [B, C, F] chunk alive at a time. ``jax.checkpoint`` inside
``lax.map`` does that too, but it keeps a stacked [n, B, C, D] copy of the input as the
map's residual, and the map's transposes around it add copies of the input and the output
(each as large as the layer input). Here the forward pass writes each chunk's output into
the result in place, and the backward pass slices the chunk of the input and of the output
cotangent it needs, recomputes the chunk, and writes the chunk of the input gradient in
place; weight gradients accumulate in fp32. Residuals: the input and the weights, which
exist anyway.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def tiled(fn: Callable, x, weights: tuple, chunk: int):
    """``fn(x_chunk, *weights)`` over chunks of ``chunk`` tokens along axis 1 of ``x``.

    Args:
      fn: token-local function [B, C, D] -> [B, C, D] (the MLP); weights: its parameters.
      x: [B, S, D]; ``chunk`` must divide S.

    Returns:
      [B, S, D], equal to ``fn(x, *weights)`` (token-local), differentiable in x and weights.
    """
    if x.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} does not divide the {x.shape[1]} tokens")
    return _tiled(fn, chunk, x, *weights)


def _chunk(x, i, c):
    return lax.dynamic_slice_in_dim(x, i * c, c, 1)                        # [B, C, ...]


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiled(fn, c, x, *weights):
    n = x.shape[1] // c

    def step(i, y):
        return lax.dynamic_update_slice_in_dim(y, fn(_chunk(x, i, c), *weights), i * c, 1)

    y = step(0, jnp.zeros_like(x))  # zeros_like(x): varies over x's mesh axes in shard_map
    return lax.fori_loop(1, n, step, y) if n > 1 else y


def _tiled_fwd(fn, c, x, *weights):
    return _tiled(fn, c, x, *weights), (x, weights)


def _tiled_bwd(fn, c, res, dy):
    x, weights = res
    n = x.shape[1] // c

    def chunk_grads(i):
        _, vjp = jax.vjp(fn, _chunk(x, i, c), *weights)
        dx_i, *dw = vjp(_chunk(dy, i, c))
        return dx_i, [g.astype(_F32) for g in dw]

    # Chunk 0 seeds the accumulators (computed from the inputs: inside shard_map they then
    # vary over the same mesh axes as the loop's additions).
    dx0, dw = chunk_grads(0)
    dx = lax.dynamic_update_slice_in_dim(jnp.zeros_like(x), dx0, 0, 1)

    def step(i, carry):
        dx, dw = carry
        dx_i, dw_i = chunk_grads(i)
        return (lax.dynamic_update_slice_in_dim(dx, dx_i, i * c, 1),
                [a + b for a, b in zip(dw, dw_i)])

    if n > 1:
        dx, dw = lax.fori_loop(1, n, step, (dx, dw))
    return (dx, *(g.astype(w.dtype) for g, w in zip(dw, weights)))


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
