"""Where each parameter lives: replicated, or (ZeRO-3) split over all devices along one axis;
expert weights split over their expert axis in every mode (expert parallelism).

The trainer lays out its state with it, and the Hugging Face import (interop/hf.py) and the
evaluate CLI place loaded weights the same way, so it sits below both.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import ordering
from .expert_parallel import expert_spec
from .moe import is_expert_param


def param_spec(shape: tuple[int, ...], mesh: Mesh, mode: str) -> P:
    """Replicated, or (zero3) split over all data x seq devices along the largest axis that
    divides evenly; arrays with no such axis stay replicated."""
    n = math.prod(mesh.shape.values())
    if mode != "zero3" or n == 1:
        return P()
    axes = [i for i in sorted(range(len(shape)), key=lambda i: -shape[i]) if shape[i] % n == 0]
    if not axes:
        return P()
    spec = [None] * len(shape)
    spec[axes[0]] = tuple(mesh.axis_names)
    return P(*spec)


def leaf_spec(keys: tuple, shape: tuple[int, ...], mesh: Mesh, mode: str) -> P:
    """``param_spec`` for a named parameter: expert weights (``moe.is_expert_param``) are
    split over all devices along their expert axis in every mode (expert parallelism);
    everything else as ``param_spec``."""
    if is_expert_param(keys):
        return expert_spec(len(shape), mesh)
    return param_spec(shape, mesh, mode)


def param_shardings(params, mesh: Mesh, mode: str, memory_kind: str | None = None):
    """NamedSharding of every leaf of a parameter pytree (``leaf_spec``), in ``memory_kind``
    (None: the device's)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, leaf_spec(_names(path), a.shape, mesh, mode),
                                      memory_kind=memory_kind), params)


def _names(path) -> tuple:
    """The names along a pytree path; an ``nnx.Variable``'s ``.value`` is none of them."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path
                 if not isinstance(k, jax.tree_util.GetAttrKey))


def in_split(y, mesh: Mesh):
    """``y`` (a pytree of ZeRO-3 parameters other than experts' weights) constrained to its
    stored split (``param_spec``)."""
    return jax.tree.map(lambda w: jax.lax.with_sharding_constraint(
        w, NamedSharding(mesh, param_spec(w.shape, mesh, "zero3"))), y)


def after_in_split(y, x, mesh: Mesh):
    """``ordering.after(y, x)`` for ZeRO-3 parameters ``y``, the edge taken in their stored
    split, so that whatever gathers or moves them next reads its result. Left free, the
    partitioner gathers (or moves) a weight first and adds the edge to the result: the
    gather then has no path from x and runs beside the loop x came from (the compilation
    cache, ``ordering``). The identity where ``ordering`` adds no edges."""
    if not ordering.active():
        return y
    return in_split(ordering.after(y, x), mesh)


def layer_after(state, x, mesh: Mesh):
    """``after_in_split`` for one layer's ZeRO-3 state (an ``nnx.State``) and its input x:
    every float weight but the experts' (split over their expert axis and used inside expert
    parallelism's ``shard_map``, where their inputs order them) computed after x, in its
    stored split. For a layer stack that runs once: XLA removes a loop of one trip, and the
    gathers of its weights, which the loop's body would order, then run beside the loops
    before it (the embedding's, the previous stack's). x is read outside ``shard_map``, so
    its first element travels to every device: one scalar collective, after x. The identity
    where ``ordering`` adds no edges."""
    if not ordering.active():
        return state
    return ordering.after_where(
        state, (x,),
        lambda path, w: jnp.issubdtype(w.dtype, jnp.floating) and not is_expert_param(
            _names(path)),
        then=lambda w: in_split(w, mesh))
