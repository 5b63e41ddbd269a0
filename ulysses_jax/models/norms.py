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


def gated_rms_norm(x, scale, gate, eps):
    """RMS norm of x times SiLU(gate) (Qwen3-Next's DeltaNet output norm), in x's dtype.

    y = (x / rms(x) * scale) * silu(gate), computed in fp32. The backward pass keeps only x,
    gate (both in their own dtype), the scale and 1/rms, as ``rms_norm`` does, instead of the
    fp32 products autodiff would keep.

    Args:
      x, gate: [..., D]; scale: [D] fp32; eps: a float.
    """
    extra = tuple(sorted(_varying(x) - _varying(scale)))
    if extra:
        scale = jax.lax.pcast(scale, extra, to="varying")
    return _gated(x, scale, gate, eps)


@jax.custom_vjp
def _gated(x, scale, gate, eps):
    normed, _ = _forward(x, scale, eps)
    return (normed.astype(_F32) * jax.nn.silu(gate.astype(_F32))).astype(x.dtype)


def _gated_fwd(x, scale, gate, eps):
    normed, r = _forward(x, scale, eps)
    y = (normed.astype(_F32) * jax.nn.silu(gate.astype(_F32))).astype(x.dtype)
    return y, (x, scale, gate, r)


def _gated_bwd(res, dy):
    x, scale, gate, r = res
    g32 = gate.astype(_F32)
    sig = jax.nn.sigmoid(g32)
    xhat = x.astype(_F32) * r
    # The forward rounds x̂·scale to x's dtype before the gate (as transformers does); the
    # derivative treats that rounding as identity.
    dnormed = dy.astype(_F32) * g32 * sig                                     # d/d(x̂·scale)
    dgate = dy.astype(_F32) * xhat * scale * sig * (1.0 + g32 * (1.0 - sig))
    gs = dnormed * scale
    dx = r * (gs - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum((dnormed * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dgate.astype(gate.dtype), None


_gated.defvjp(_gated_fwd, _gated_bwd)
