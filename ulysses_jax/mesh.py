"""Device meshes for sequence parallelism: axis names, the mesh factory, layout specs.

The mesh has axes ("data", "seq"): batch rows are split over "data", the tokens of each
sequence over "seq". Activations are laid out ``P("data", "seq", ...)`` everywhere except
inside attention, where Ulysses swaps the sequence split for a head split.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
SEQ = "seq"

# Token-major activations [B, S, ...]: rows over data, tokens over seq.
ACT_BS = P(DATA, SEQ)


def make_mesh(seq: int, data: int = -1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ("data", "seq") mesh.

    Args:
      seq: devices per sequence (the Ulysses degree P).
      data: data-parallel replicas; -1 uses all remaining devices.
      devices: devices to use (default: ``jax.devices()``).

    Returns:
      A ``Mesh`` of shape (data, seq) with Auto axis types, so XLA inserts the layout
      changes that jitted code outside the shard_map needs.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq axis size must be a positive integer, got {seq!r}")
    if data == -1:
        if n % seq:
            raise ValueError(
                f"seq axis size {seq} does not divide the {n} available devices")
        data = n // seq
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"data axis size must be a positive integer or -1, got {data!r}")
    if data * seq > n:
        raise ValueError(
            f"mesh data={data} x seq={seq} needs {data * seq} devices but only {n} are available")
    used = devices[: data * seq]
    return jax.make_mesh((data, seq), (DATA, SEQ), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=used)


def axis_size(mesh: Mesh, name: str) -> int:
    """Size of a mesh axis, 1 if the mesh has no such axis."""
    return dict(mesh.shape).get(name, 1)


def shard(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """Lays ``x`` out as ``spec`` on ``mesh``, inside or outside jit, for any axis type."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def num_devices(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())
