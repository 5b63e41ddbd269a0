"""Device meshes for sequence parallelism: axis names, the mesh factory, layout specs.

The mesh has axes ("data", "seq"): batch rows are split over "data", the tokens of each
sequence over "seq". Activations are laid out ``P("data", "seq", ...)`` everywhere except
inside attention, where Ulysses swaps the sequence split for a head split.

With a ring degree R > 1 the mesh is ("data", "ring", "seq") and the tokens are split over
("ring", "seq"), ring major: device (r, u) holds shard r*U + u of the sequence, so the U
devices of one ring rank together hold one contiguous S/R block (see ``attention/ring.py``). Use
``seq_axes`` / ``act_spec`` rather than spelling the spec, so code serves both meshes.
"""
from __future__ import annotations

import math
import os
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA = "data"
SEQ = "seq"
RING = "ring"


def request_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` CPU devices (fake ones on a machine without accelerators).

    Effective only before JAX initialises its backends; a device count already in XLA_FLAGS
    wins. Only the CPU platform reads the flag, so it is harmless where GPUs exist.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def make_mesh(seq: int, data: int = -1, devices: Sequence[jax.Device] | None = None,
              ring: int = 1) -> Mesh:
    """Builds a ("data", "seq") mesh, or ("data", "ring", "seq") when ``ring > 1``.

    Args:
      seq: devices per Ulysses group (the all-to-all degree U; head counts it does not
        divide are padded, head_layout.py).
      data: data-parallel replicas; -1 uses all remaining devices.
      devices: devices to use (default: ``jax.devices()``).
      ring: ring-attention degree R; the sequence is split over R * seq devices.

    Returns:
      A ``Mesh`` of shape (data, seq) or (data, ring, seq) with Auto axis types, so XLA
      inserts the layout changes that jitted code outside the shard_map needs.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq axis size must be a positive integer, got {seq!r}")
    if not isinstance(ring, int) or ring < 1:
        raise ValueError(f"ring axis size must be a positive integer, got {ring!r}")
    per_row = seq * ring
    what = f"seq axis size {seq}" if ring == 1 else f"ring x seq = {ring} x {seq} = {per_row}"
    if data == -1:
        if n % per_row:
            raise ValueError(f"{what} does not divide the {n} available devices")
        data = n // per_row
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"data axis size must be a positive integer or -1, got {data!r}")
    if data * per_row > n:
        dims = f"seq={seq}" if ring == 1 else f"ring={ring} x seq={seq}"
        raise ValueError(f"mesh data={data} x {dims} needs {data * per_row} devices but only "
                         f"{n} are available")
    used = devices[: data * per_row]
    if ring == 1:
        return jax.make_mesh((data, seq), (DATA, SEQ),
                             axis_types=(AxisType.Auto, AxisType.Auto), devices=used)
    return jax.make_mesh((data, ring, seq), (DATA, RING, SEQ),
                         axis_types=(AxisType.Auto,) * 3, devices=used)


def axis_size(mesh: Mesh, name: str) -> int:
    """Size of a mesh axis, 1 if the mesh has no such axis."""
    return dict(mesh.shape).get(name, 1)


def seq_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The mesh axes the sequence is split over: ("ring", "seq") if ring > 1, else "seq"."""
    return (RING, SEQ) if axis_size(mesh, RING) > 1 else SEQ


def act_spec(mesh: Mesh, extra_dims: int = 0) -> P:
    """Spec of a token-major activation [B, S, *extra]: P("data", seq_axes(mesh), None, ...).

    The batch entry is None when the mesh has no "data" axis.
    """
    batch = DATA if DATA in mesh.axis_names else None
    return P(batch, seq_axes(mesh), *([None] * extra_dims))


def shard(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """Lays ``x`` out as ``spec`` on ``mesh``, inside or outside jit, for any axis type."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def num_devices(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())
