"""Ulysses attention on 8 fake CPU devices against the dense one-device reference.

    python examples/attention_demo.py   (from anywhere: the repository goes on sys.path)
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ulysses_jax import make_mesh, reference_attention, ulysses_attention  # noqa: E402


def main():
    mesh = make_mesh(seq=8, data=1)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 1024, 16, 64))  # [B, S, N, H]
    k = jax.random.normal(kk, (2, 1024, 4, 64))   # [B, S, K, H]: GQA, kv heads replicated 2x
    v = jax.random.normal(kv, (2, 1024, 4, 64))
    out = jax.jit(lambda q, k, v: ulysses_attention(q, k, v, mesh=mesh))(q, k, v)
    ref = reference_attention(q, k, v)
    print(f"devices: {mesh.devices.size} x {jax.devices()[0].platform}, out sharding {out.sharding.spec}")
    print(f"max |ulysses - reference| = {float(jnp.max(jnp.abs(out - ref))):.2e}")


if __name__ == "__main__":
    main()
