"""Host computations in the form XLA:GPU's stock pipeline takes (training/host_compute.py): the
global norm from per-device shares against optax's, shard-local host code, and results that
are arguments taken from outside the host computation."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.utils.devices import need_devices
from tests.utils.numerics import assert_rel_close
from ulysses_jax.training import host_compute

# every kind of layout a state leaf has: split over one axis, over both, over one of a
# matrix's dims, and replicated (counted once, not once per device)
SPECS = {"data": P("data"), "seq": P("seq"), "both": P(("data", "seq")),
         "cols": P(None, "seq"), "replicated": P(), "scalar": P()}
SHAPES = {"data": (6, 5), "seq": (8,), "both": (16, 3), "cols": (3, 12), "replicated": (7, 2),
          "scalar": ()}


def _mesh():
    devices = np.array(need_devices(8)).reshape(2, 4)
    return jax.sharding.Mesh(devices, ("data", "seq"))


def _tree(seed, mesh, kind="pinned_host"):
    keys = dict(zip(SHAPES, jax.random.split(jax.random.key(seed), len(SHAPES))))
    shardings = {k: NamedSharding(mesh, s, memory_kind=kind) for k, s in SPECS.items()}
    tree = {k: jax.device_put(jax.random.normal(keys[k], SHAPES[k]), shardings[k])
            for k in SHAPES}
    return tree, shardings


def test_global_norm_of_host_arrays_is_optaxs_norm():
    mesh = _mesh()
    tree, shardings = _tree(0, mesh)
    norm = jax.jit(lambda t: host_compute.global_norm(t, shardings, mesh))(tree)
    ref = optax.tree.norm(jax.tree.map(np.asarray, tree))
    assert norm.sharding.is_fully_replicated
    assert_rel_close(norm, ref, 1e-6)


def test_by_shard_is_the_function_of_the_whole_arrays():
    """An elementwise update with a replicated scalar, run per shard on the host, equals the
    same function of the whole arrays."""
    mesh = _mesh()
    params, shardings = _tree(1, mesh)
    grads, _ = _tree(2, mesh)
    specs = host_compute.specs(shardings)
    scale = jax.device_put(jnp.float32(0.3),
                           NamedSharding(mesh, P(), memory_kind="pinned_host"))
    update = lambda p, g, s: jax.tree.map(lambda a, b: a - s * b, p, g)  # noqa: E731
    out = jax.jit(lambda p, g, s: host_compute.by_shard(
        update, mesh, (specs, specs, P()), specs)(p, g, s), out_shardings=shardings)(
        params, grads, scale)
    ref = update(*jax.tree.map(np.asarray, (params, grads, scale)))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(out)} == {"pinned_host"}
    assert_rel_close(out, ref, 1e-6)


def test_results_that_are_arguments_are_not_host_results():
    """A result that is an argument unchanged is that argument, outside the host
    computation; the others are computed there."""
    f = host_compute.computed_on_host(lambda x, y: {"twice": x * 2, "same": y})
    x, y = jnp.arange(4.0), jnp.arange(3.0) + 1
    closed = jax.make_jaxpr(f)(x, y)
    outs = dict(zip(["same", "twice"], closed.jaxpr.outvars))  # sorted keys
    assert outs["same"] is closed.jaxpr.invars[1]
    assert outs["twice"] not in closed.jaxpr.invars
    out = jax.jit(f)(x, y)
    np.testing.assert_array_equal(out["twice"], np.arange(4.0) * 2)
    np.testing.assert_array_equal(out["same"], np.arange(3.0) + 1)
