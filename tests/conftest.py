"""Test devices: 8 fake CPU devices, or the real GPUs when at least two are visible.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time.
"""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402


def _test_devices():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) >= 2:
        # fp32 comparisons need true fp32 matmuls, not TF32.
        jax.config.update("jax_default_matmul_precision", "highest")
        return gpus
    return jax.devices("cpu")


DEVICES = _test_devices()


@pytest.fixture(scope="session")
def devices():
    return DEVICES


def need_devices(n: int):
    """Skips the calling test when fewer than ``n`` test devices exist."""
    if len(DEVICES) < n:
        pytest.skip(f"needs {n} devices, only {len(DEVICES)} {DEVICES[0].platform} devices visible")
    return DEVICES[:n]


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-2
