"""Choosing the next token from fp32 logits: greedy, or sampled with temperature, top-k and
top-p, in that order (as transformers' ``generate`` applies its warpers).

Randomness is per row and step: row r's token at step t is drawn with
``fold_in(fold_in(key(seed), r), t)``, where r is the row's index in the whole request, so the
same seed gives the same tokens however rows are batched and on every mesh.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 leave the distribution whole."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


def filtered(logits: jax.Array, s: Sampling) -> jax.Array:
    """[B, V] fp32 logits / temperature with the tokens top-k and top-p remove at -inf.

    top-p keeps the smallest set of most likely tokens whose probabilities sum to at least
    top_p (the most likely token always), as transformers' TopPLogitsWarper does."""
    x = logits / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if s.top_p < 1.0:
        order = jnp.argsort(x, axis=-1)                                  # ascending
        ascending = jnp.take_along_axis(x, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        drop = cum <= 1.0 - s.top_p
        drop = drop.at[:, -1].set(False)                                 # keep the top token
        mask = jnp.zeros_like(drop).at[jnp.arange(x.shape[0])[:, None], order].set(drop)
        x = jnp.where(mask, -jnp.inf, x)
    return x


def row_keys(seed, rows: jax.Array, step) -> jax.Array:
    """[B] keys: one per row index in ``rows`` [B] and ``step``; ``seed`` an int or a traced
    uint32."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(rows)


def choose(logits: jax.Array, s: Sampling, seed, rows: jax.Array, step) -> jax.Array:
    """[B] int32 next tokens from [B, V] fp32 logits."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filtered(logits, s)
    keys = row_keys(seed, rows, step)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
