"""Numerical checks shared by the tests: the tolerance of a dtype, the relative error of an
array against a reference, and that assertion over pytrees."""
import jax
import jax.numpy as jnp
import numpy as np


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2


def rel_error(a, b) -> float:
    """max |a - b| / max |b|: the largest difference from the reference ``b`` relative to its
    largest magnitude, computed by numpy in the arrays' own dtypes."""
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def assert_rel_close(a, b, rtol):
    """Asserts that every leaf of the pytree ``a`` is within ``rtol`` of the same leaf of ``b``
    relative to that leaf's largest magnitude (at least 1e-12): the trees have the same number
    of leaves, at least one. The bound holds both as max |x - y| / scale <= rtol and as
    max |x - y| <= rtol * scale, whose roundings differ."""
    checked = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        diff, scale = np.abs(x - y).max(), max(np.abs(y).max(), 1e-12)
        assert diff / scale <= rtol and diff <= rtol * scale, (diff, scale)
        checked += 1
    assert checked
