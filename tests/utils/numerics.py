"""Numerical checks shared by the tests."""
import jax.numpy as jnp


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2
