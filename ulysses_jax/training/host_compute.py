"""Computing in host memory (XLA's host offloading), in the form XLA:GPU's stock pipeline takes.

``optimizer.offload`` keeps the fp32 parameters and AdamW's moments in host memory and updates
them there; gradient accumulation adds to a host accumulator. On a GPU, XLA compiles each host
computation for the CPU and runs it beside each GPU (``hlo_host_device_type_call_wrapper``
makes the call, a ``HostExecute``). Two forms abort or crash that compile (jax 0.12.0.1,
benchmarks/host_passthrough_repro.py), so every host computation here is built without them:

  - a result that is one of the computation's own arguments, unchanged ("Parameter
    instructions cannot be added to a computation after it has been built", an abort):
    ``computed_on_host`` takes such results from the arguments outside the host computation;
  - a collective inside host code: a reduction over an axis the mesh splits (the gradient's
    global norm under ZeRO-3) makes the partitioner put an all-reduce into the CPU program,
    where it has no place (the latency-hiding scheduler segfaults on it). ``by_shard`` runs a
    host computation on each device's shards apart (``shard_map``), so it holds no
    collective, and ``global_norm`` sums each device's share on the host and adds the shares
    up on the device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _host_region(f):
    """``f`` as one host computation: jax 0.11 made ``compute_on`` a function wrapper that
    places the results; before it was a context manager, and the callers' out shardings
    placed them."""
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11):
        return compute_on(f, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)

    def on_host(*args):
        with compute_on("device_host"):
            return f(*args)
    return on_host


def computed_on_host(f):
    """``f(*args)`` computed in host memory, its results left there. Results that are
    arguments returned unchanged (a cast that leaves some leaves as they are) come from the
    arguments, outside the host computation (module docstring): they are in host memory
    already, and the values are the same."""
    def on_host(*args):
        flat, tree = jax.tree.flatten(args)
        closed, shapes = jax.make_jaxpr(lambda *xs: f(*tree.unflatten(xs)),
                                        return_shape=True)(*flat)
        position = {id(v): i for i, v in enumerate(closed.jaxpr.invars)}
        # per result: the argument it is (its index), or None where the host computes it
        source = [position.get(id(v)) for v in closed.jaxpr.outvars]
        computed = [i for i, s in enumerate(source) if s is None]

        def region(*xs):
            results = jax.tree.leaves(f(*tree.unflatten(xs)))
            return [results[i] for i in computed]

        made = iter(_host_region(region)(*flat) if computed else ())
        results = [next(made) if s is None else flat[s] for s in source]
        return jax.tree.unflatten(jax.tree.structure(shapes), results)
    return on_host


def specs(shardings):
    """The PartitionSpec of every NamedSharding of a pytree."""
    return jax.tree.map(lambda s: s.spec, shardings)


def by_shard(f, mesh: Mesh, in_specs, out_specs):
    """``f`` computed in host memory on each device's shards apart (``shard_map``): the host
    computation sees local arrays and holds no collective. ``f`` must be the same function of
    the whole arrays, elementwise over the split axes (AdamW's update, a cast, a sum of two
    gradients); its arguments and results are laid out by ``in_specs`` and ``out_specs``."""
    return jax.shard_map(computed_on_host(f), mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs)


def _counted_once(mesh: Mesh, spec: P) -> np.ndarray:
    """1.0 on the devices whose shard of an array laid out by ``spec`` is counted, 0.0 on the
    others: along each axis the array is replicated over, only index 0 counts. [devices], in
    the row-major order of the mesh's axes."""
    split = {a for part in spec if part is not None
             for a in (part if isinstance(part, tuple) else (part,))}
    coords = np.indices(mesh.devices.shape).reshape(len(mesh.axis_names), -1)
    keep = np.ones(coords.shape[1], bool)
    for axis, c in zip(mesh.axis_names, coords):
        if axis not in split:
            keep &= c == 0
    return keep.astype(np.float32)


def global_norm(tree, shardings, mesh: Mesh):
    """The global L2 norm of a pytree of arrays held in host memory (laid out by
    ``shardings``), as a float32 scalar on the devices, replicated: each device's sum of
    squares of its shards is computed on the host (``by_shard``), the [devices, leaves] table
    moved to the devices, and the shards counted once each (``_counted_once``) summed there.
    """
    leaves = jax.tree.leaves(tree)
    leaf_specs = [s.spec for s in jax.tree.leaves(shardings)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    axes = tuple(mesh.axis_names)

    def squares(*xs):  # local shards -> [1, leaves]
        return jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs])[None]

    table = by_shard(squares, mesh, tuple(leaf_specs), P(axes))(*leaves)   # [devices, leaves]
    table = jax.device_put(table, NamedSharding(mesh, P(axes), memory_kind="device"))
    counted = np.stack([_counted_once(mesh, s) for s in leaf_specs], axis=1)  # [devices, leaves]
    total = jnp.sum(table * counted)
    return jax.lax.with_sharding_constraint(jnp.sqrt(total), NamedSharding(mesh, P()))
