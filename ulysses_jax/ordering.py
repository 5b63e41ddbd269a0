"""Data paths that order a collective against a loop of collectives (the compilation cache).

XLA:CPU runs the steps of a program concurrently where no data dependency orders them; an
executable read back from JAX's persistent cache (jaxlib 0.10) no longer orders a loop that
holds collectives against a collective beside it, and the devices then deadlock or crash
(``compile_cache.py``; ``hlo.unordered_loop_collectives`` finds such pairs). A program is
safe to cache when every collective step reads, through its operands, what the loops beside
it wrote, or they read it. Some of ours get there by their shape (the loss's token count
shares one all-reduce with the loss; accumulation reduces every micro-batch's count before
its loop); these functions give the rest a data path where the program has none:

- ``after(y, x)``: y, computed after x (forward). The collective that reads y waits for x.
- ``grads_first(x, params)``: identity in the forward; in the backward the cotangent of x
  waits for the cotangents of ``params``, so a parameter-gradient reduction (inserted by the
  partitioner where a replicated weight meets sharded activations) runs before whatever the
  cotangent of x flows into, a loop of collectives above all.
- ``saved_after_cotangent(f)``: f, whose backward pass reads what it saved after the
  cotangent of its output: a weight the backward pass gathers again waits for the loops the
  cotangent came through (a layer stack that runs once, whose loop XLA removes).

Each adds ``0 x`` a scalar read from the other values, with non-finite values replaced first:
an exact identity, a scalar read and an add, and a real operand edge that XLA's simplifier keeps
(a float multiply by zero is not folded) and that the CPU runtime sees as a buffer read
(an optimization barrier would alias its operands and order nothing at run time).

Only CPU programs need them: they are identities with no edge when JAX's default backend is
another (a GPU's scheduler is then free to overlap a gradient reduction with the layer
before it, and no GPU executable loses its order in the cache).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp


def _zero_from(tree) -> jax.Array:
    """A float32 0 computed from the first element of every numeric leaf of ``tree``, read
    by index (a reshape of a split leaf would gather all of it: ZeRO-3's stacked weights).

    The first elements are gathered into one vector and reduced once: a train step's state
    has dozens of leaves and its program takes this edge a dozen times, so per leaf it is
    one slice and one convert, not a chain of five scalar ops (the program and its compile
    grow with every op)."""
    total, firsts = jnp.zeros((), jnp.float32), []
    for leaf in jax.tree.leaves(tree):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.number) and leaf.size:
            first = jax.lax.slice(leaf, (0,) * leaf.ndim, (1,) * leaf.ndim).reshape(1)
            if jax.typeof(leaf).memory_space == total.aval.memory_space:
                firsts.append(first.astype(jnp.float32))
            else:  # offloaded to the host: its scalar alone (ops mix no memory spaces)
                total = total + _finite(first[0]) * 0.0
    # Each element is made 0 before any sum (0 x a finite value), so no sum can overflow.
    if firsts:
        total = total + jnp.sum(_finite(jnp.concatenate(firsts)) * 0.0)
    return total


_disabled = False


def active() -> bool:
    """Whether programs traced now get the edges (CPU programs: JAX's default backend)."""
    return not _disabled and jax.default_backend() == "cpu"


@contextlib.contextmanager
def disabled():
    """Programs traced inside get no edges: the programs as they were before them, which a
    read-back executable runs out of order (``benchmarks/cache_collective_repro.py
    --unordered``; the tests of the fence)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before


def after(y, x):
    """``y`` (a pytree), with every leaf computed after ``x``: identical values.

    Where x is an array sharing y's leading dims (y [B, S], x [B, S, D]), each leaf of y reads
    x at index 0 of the remaining dims (x[:, :, 0]), so where the two are split alike over the
    devices the read is local. Otherwise (x a pytree, or other shapes) y reads the first
    element of every leaf of x: for replicated values, or inside a ``shard_map`` body, where
    every read is local (the partitioner would gather a split x to read it).
    """
    if not active():
        return y
    whole = []  # _zero_from(x), built once for all the leaves of y that read it

    def one(a):
        k = min(a.ndim, getattr(x, "ndim", 0))
        if k and a.shape[:k] == x.shape[:k]:
            zero = _finite(x[(Ellipsis,) + (0,) * (x.ndim - k)]) * 0.0       # a's leading dims
            zero = zero.reshape(zero.shape + (1,) * (a.ndim - k))
        else:
            if not whole:
                whole.append(_zero_from(x))
            zero = whole[0]
        return a + jax.lax.stop_gradient(zero).astype(a.dtype)

    return jax.tree.map(one, y)


def after_where(y, x, pick, then=None):
    """``after`` for the leaves of pytree ``y`` that ``pick(path, leaf)`` chooses (x's zero
    built once for all of them), each then passed through ``then`` if given; the other leaves
    as they are."""
    flat, tree = jax.tree_util.tree_flatten_with_path(y)
    chosen = [i for i, (path, leaf) in enumerate(flat) if pick(path, leaf)]
    leaves = [leaf for _, leaf in flat]
    for i, leaf in zip(chosen, after([leaves[i] for i in chosen], x)):
        leaves[i] = leaf if then is None else then(leaf)
    return jax.tree_util.tree_unflatten(tree, leaves)


def _is_float(_, leaf) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


def _finite(v):
    """v in float32 with non-finite values replaced by 0 (so 0 x v is exactly 0)."""
    v = v.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


def grads_first(x, params):
    """Identity on (x, params); the backward pass gives x's cotangent a data path from the
    cotangents of ``params`` (see the module docstring). x: an array (the activations);
    params: a pytree of arrays (or None)."""
    if not active() or not jax.tree.leaves(params):
        return x, params
    return _grads_first(x, params)


@jax.custom_vjp
def _grads_first(x, params):
    return x, params


def _grads_first_fwd(x, params):
    return (x, params), None


def _grads_first_bwd(_, cotangents):
    gx, gp = cotangents
    return gx + _zero_from(gp).astype(gx.dtype), gp


_grads_first.defvjp(_grads_first_fwd, _grads_first_bwd)


def saved_after_cotangent(f):
    """``f`` (its first output an array), whose backward pass reads every float value it
    saved after the cotangent of that output: the same values and gradients, and whatever
    the backward pass gathers or moves of what it saved (a ZeRO-3 weight the forward pass
    used) waits for the cotangent, so it runs after the loops the cotangent came through
    (the loss's) instead of beside them. Each saved value gets an add; the cotangent's
    first element is read where it lies (outside ``shard_map``: one scalar collective).
    ``f`` itself where ``ordering`` adds no edges."""
    if not active():
        return f

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    def fwd(*args):
        return jax.vjp(f, *args)

    def bwd(back, cotangent):
        return after_where(back, (jax.tree.leaves(cotangent)[0],), _is_float)(cotangent)

    g.defvjp(fwd, bwd)
    return g
