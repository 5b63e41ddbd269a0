"""Where each parameter lives: replicated, or (ZeRO-3) split over all devices along one axis;
expert weights split over their expert axis in every mode (expert parallelism).

The trainer lays out its state with it, and the Hugging Face import (interop/hf.py) and the
evaluate CLI place loaded weights the same way, so it sits below both.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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

