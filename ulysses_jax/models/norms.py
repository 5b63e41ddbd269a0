"""RMS normalisation with a backward pass that keeps no fp32 copy of its input.

y = x / rms(x) * scale, computed in fp32, returned in x's dtype. Differentiated by autodiff,
the fp32 input, the normalised value and their products are kept for (or recomputed into)
the backward pass as [..., D] fp32 arrays, each twice the size of a bf16 activation. Here
the forward pass keeps only x (the caller has it anyway), the scale and the per-row
1/rms ([..., 1] fp32), and the backward pass forms

    x̂ = x · r,  g = dy · scale,  dx = r · (g − x̂ · mean(g · x̂)),  dscale = Σ dy · x̂

from them in one go, returning dx in x's dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def rms_norm(x, scale, eps):
    """RMS norm over the last axis: x [..., D], scale [D] fp32, eps a float -> [..., D]."""
    # Inside shard_map a replicated scale meets a per-device x: make the scale vary like x
    # first, so the gradient the rule returns (per device) has the scale's type; the
    # cast's own transpose then sums it over the devices, as autodiff would.
    extra = tuple(sorted(_varying(x) - _varying(scale)))
    if extra:
        scale = jax.lax.pcast(scale, extra, to="varying")
    return _rms_norm(x, scale, eps)


def _varying(a) -> set:
    """The mesh axes ``a`` varies over inside shard_map (none outside)."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)   # jax 0.10
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))


@jax.custom_vjp
def _rms_norm(x, scale, eps):
    return _forward(x, scale, eps)[0]


def _forward(x, scale, eps):
    x32 = x.astype(_F32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)   # [..., 1]
    return (x32 * r * scale).astype(x.dtype), r


def _fwd(x, scale, eps):
    y, r = _forward(x, scale, eps)
    return y, (x, scale, r)


def _bwd(res, dy):
    x, scale, r = res
    xhat = x.astype(_F32) * r                                               # [..., D]
    g = dy.astype(_F32) * scale
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum((dy.astype(_F32) * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype), None


_rms_norm.defvjp(_fwd, _bwd)
