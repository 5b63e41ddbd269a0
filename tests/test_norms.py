"""The memory-lean RMSNorm and TiledMLP against plain autodiff of the same functions."""
import functools

import chex
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from ulysses_jax.models.norms import rms_norm
from ulysses_jax.models.tiled_mlp import tiled


def _plain_rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def _value_and_grads(fn, args, ct):
    return jax.jit(jax.value_and_grad(
        lambda *a: jnp.sum((fn(*a) * ct).astype(jnp.float32)), argnums=tuple(range(len(args)))))(
        *args)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_rms_norm_matches_autodiff(dtype, tol):
    @functools.partial(jax.jit, static_argnums=1)
    def normals(seed, dtype):        # one program; the arithmetic after it stays op by op
        k = jax.random.split(jax.random.key(seed), 3)
        x = jax.random.normal(k[0], (2, 7, 32), dtype)
        return x, jax.random.normal(k[1], (32,)), jax.random.normal(k[2], x.shape, dtype)
    x, scale, ct = normals(0, dtype)
    scale = 1 + 0.1 * scale
    got = _value_and_grads(lambda x, s: rms_norm(x, s, 1e-6), (x, scale), ct)
    want = _value_and_grads(lambda x, s: _plain_rms_norm(x, s, 1e-6), (x, scale), ct)
    chex.assert_trees_all_close(got, want, atol=tol, rtol=tol)


def _mlp(x, wg, wu, wd):
    h = jax.nn.silu(jnp.einsum("BSD,DF->BSF", x, wg)) * jnp.einsum("BSD,DF->BSF", x, wu)
    return jnp.einsum("BSF,FD->BSD", h, wd)


@functools.cache
def _mlp_case():
    """test_tiled_mlp_matches_the_whole_mlp's inputs and the whole MLP's value and gradients
    (the same for every chunk)."""
    @jax.jit
    def normals(seed):               # one program; the scaling after it stays op by op
        k = jax.random.split(jax.random.key(seed), 5)
        x = jax.random.normal(k[0], (2, 64, 16))
        ws = tuple(jax.random.normal(kk, s) for kk, s in
                   zip(k[1:4], ((16, 48), (16, 48), (48, 16))))
        return x, ws, jax.random.normal(k[4], x.shape)
    x, ws, ct = normals(1)
    ws = tuple(0.2 * w for w in ws)
    return x, ws, ct, _value_and_grads(_mlp, (x, *ws), ct)


@pytest.mark.parametrize("chunk", [64, 16, 8])
def test_tiled_mlp_matches_the_whole_mlp(chunk):
    x, ws, ct, want = _mlp_case()
    got = _value_and_grads(lambda x, *w: tiled(_mlp, x, w, chunk), (x, *ws), ct)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_tiled_mlp_keeps_no_stacked_copy_of_its_input():
    """Compiled fwd+bwd temporaries: well under two copies of the input beyond one chunk's
    [B, C, F] work (lax.map with checkpoint keeps a stacked [n, B, C, D] copy and more)."""
    s, d, f, c = 8192, 256, 1024, 512
    x = jax.ShapeDtypeStruct((1, s, d), jnp.float32)
    ws = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((d, f), (d, f), (f, d))]
    grad = jax.jit(jax.grad(lambda x, *w: jnp.sum(tiled(_mlp, x, w, c) ** 2),
                            argnums=(0, 1, 2, 3)))
    temp = grad.lower(x, *ws).compile().memory_analysis().temp_size_in_bytes
    x_bytes, chunk_work = s * d * 4, 8 * c * f * 4
    assert temp < 2 * x_bytes + chunk_work, (temp, x_bytes, chunk_work)


def test_tiled_mlp_rejects_a_chunk_that_does_not_divide():
    with pytest.raises(ValueError, match="chunk 5 does not divide the 64 tokens"):
        tiled(_mlp, jnp.zeros((1, 64, 4)), (jnp.zeros((4, 8)),) * 2 + (jnp.zeros((8, 4)),), 5)


def test_gated_rms_norm_matches_autodiff():
    """Qwen3-Next's gated output norm: values and all three gradients as autodiff of the
    plain formula (fp32)."""
    from ulysses_jax.models.norms import gated_rms_norm
    rng = np.random.default_rng(4)
    x, gate, ct = (jnp.asarray(rng.normal(size=(2, 6, 3, 8)).astype(np.float32))
                   for _ in range(3))
    scale = jnp.asarray(1 + 0.3 * rng.normal(size=(8,)).astype(np.float32))

    def plain(x, scale, gate):
        r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x * r * scale * jax.nn.silu(gate)

    np.testing.assert_allclose(jax.jit(lambda *a: gated_rms_norm(*a, 1e-6))(x, scale, gate),
                               jax.jit(plain)(x, scale, gate), atol=1e-6)
    vjp = lambda f: jax.jit(lambda ct, *a: jax.vjp(f, *a)[1](ct))  # noqa: E731
    got = vjp(lambda *a: gated_rms_norm(*a, 1e-6))(ct, x, scale, gate)
    want = vjp(plain)(ct, x, scale, gate)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
