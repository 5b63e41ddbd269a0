"""Parts every decoder family shares: weights gathered at their point of use, RMSNorm, RoPE
(``rope.py``), GQA attention through the Ulysses exchange, the gated MLP and its token chunks.

Letters as in decoder.py. This module imports no decoder block and no family module: the
families (``llama.py``, ``gemma.py``, ``qwen3_next.py``) build their blocks from these parts,
and what differs between families (norm scales of (1 + w), the MLP's activation) comes from
the family traits (``ulysses_jax/families.py``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..attention import DEFAULT_MAX_SEGMENTS, ulysses_attention
from ..config import INT32_MAX, LAYER_KINDS, ModelConfig
from ..mesh import act_spec
from ..families import family
from . import lora
from .loss import largest_divisor_at_most
from .norms import rms_norm
from .rope import apply_rope
from .tiled_mlp import tiled

@jax.custom_jvp
def gelu_exact(x):
    """GELU with the normal CDF, ``x * Phi(x)`` (PyTorch's ``nn.GELU()``), as
    ``jax.nn.gelu(approximate=False)``, with its derivative ``Phi(x) + x * phi(x)`` written
    out: jax 0.12.0.1's own rule differentiates ``lax.erfc``'s ``polynomial`` primitive, whose
    constant coefficients fail shard_map's varying-axes check inside any manual region."""
    return jax.nn.gelu(x, approximate=False)


@gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = 0.5 * jax.lax.erfc(-x * jnp.sqrt(0.5).astype(x.dtype))
    pdf = jnp.exp(-0.5 * x * x) * jnp.sqrt(0.5 / jnp.pi).astype(x.dtype)
    return gelu_exact(x), (cdf + x * pdf) * dx


# The MLP gate activations the families name (``families.Family.activation``).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": partial(jax.nn.gelu, approximate=True)}


def gathered(w: jax.Array, dtype, mesh: Mesh | None) -> jax.Array:
    """A weight in the compute dtype, replicated at its point of use.

    With ZeRO-3 sharding the stored weight is split over the devices; constraining the cast
    copy to be replicated makes XLA all-gather it here (and reduce-scatter its gradient),
    instead of moving activations to the weight. With replicated weights it is a no-op.
    """
    w = w.astype(dtype)
    return w if mesh is None else jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))


def lora_adapt(module: nnx.Module, weights: dict, cfg: ModelConfig, dtype, mesh: Mesh | None):
    """``adapt(y, target, spec, inputs)``: y + s (inputs A) B with ``target``'s adapter on
    ``module`` (models/lora.py; A and B gathered like the weights), or y where it has none."""
    adapters = lora.adapters(module, weights)  # {} unless model.lora.rank > 0

    def adapt(y, target, spec, inputs):
        if target not in adapters:
            return y
        a, b = (gathered(w, dtype, mesh) for w in adapters[target])
        return y + lora.delta(spec, inputs, a, b, lora.scaling(cfg.lora))

    return adapt


def out_projection(o, wo, adapt, dtype, mesh: Mesh | None):
    """Attention's output projection with its "o" adapter (``lora_adapt``): o [B, S, N, H],
    wo [N, H, D] -> [B, S, D]."""
    y = jnp.einsum("BSNH,NHD->BSD", o, gathered(wo, dtype, mesh))
    return adapt(y, "o", "BSNH,NHD->BSD", o)


class RMSNorm(nnx.Module):
    """RMS normalisation in fp32 with a learned scale; output in the input's dtype.
    ``one_plus``: the scale is (1 + w) with w initialised to 0 (Gemma)."""

    def __init__(self, dim: int, eps: float, one_plus: bool = False):
        self.scale = nnx.Param((jnp.zeros if one_plus else jnp.ones)((dim,), jnp.float32))
        self.eps, self.one_plus = eps, one_plus

    def __call__(self, x):
        return rms_norm(x, self.weight(), self.eps)  # norms.py: no fp32 copy kept

    def weight(self, mesh: Mesh | None = None):
        """The fp32 scale [D] the norm multiplies by: w, or 1 + w (Gemma); replicated at its
        point of use on a mesh (``_gathered``)."""
        w = self.scale[...] if mesh is None else gathered(self.scale[...], jnp.float32, mesh)
        return 1.0 + w if self.one_plus else w

    def over_chunks(self, x, mesh: Mesh | None, chunk: int):
        """The norm over ``chunk`` tokens of each device at a time (``model.mlp_chunk``):
        its fp32 work exists one chunk at a time, never for all of a device's tokens."""
        if not chunk or mesh is None:
            return self(x)
        eps = self.eps
        return _token_chunks(lambda xc, s: rms_norm(xc, s, eps), x, (self.weight(mesh),),
                             mesh, chunk)


def norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The family's RMSNorm over ``dim``."""
    return RMSNorm(dim, cfg.norm_eps, one_plus=family(cfg.family).one_plus_norms)


def by_kind(fn, kind, *args):
    """``fn(kind, *args)`` for a static layer kind letter ("L", "G"), or a ``lax.switch``
    between LAYER_KINDS on a traced index (layers of both kinds in one scan)."""
    if isinstance(kind, str):
        return fn(kind, *args)
    return jax.lax.switch(kind, [partial(fn, c) for c in LAYER_KINDS], *args)


class Attention(nnx.Module):
    """GQA self-attention: token-local projections and RoPE, Ulysses (or hybrid) exchange."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        self.wq = nnx.Param(init(rngs.params(), (d, n, h)))
        self.wk = nnx.Param(init(rngs.params(), (d, k, h)))
        self.wv = nnx.Param(init(rngs.params(), (d, k, h)))
        self.wo = nnx.Param(out_init(rngs.params(), (n, h, d)))
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.float32))
        self.bq = zeros(n, h) if cfg.qkv_bias else None
        self.bk = zeros(k, h) if cfg.qkv_bias else None
        self.bv = zeros(k, h) if cfg.qkv_bias else None
        self.q_norm = norm(cfg, h) if cfg.qk_norm else None
        self.k_norm = norm(cfg, h) if cfg.qk_norm else None
        self.cfg, self.mesh, self.layout, self.head_chunks = cfg, mesh, layout, head_chunks

    def __call__(self, x, positions, segment_ids, kind="G"):
        """``kind``: "L" (local: sliding window, local RoPE base and scaling) or "G"; or, when
        the layers mix both, a traced index into LAYER_KINDS (``lax.switch`` between the two)."""
        q, k, v, adapt = self.project(x)

        def attend(kind, q, k, v):
            q, k = self.rope(kind, q, k, positions)               # [B, S, N, H], [B, S, K, H]
            return self.attend(kind, q, k, v, segment_ids)                       # [B, S, N, H]

        o = by_kind(attend, kind, q, k, v)
        return out_projection(o, self.wo[...], adapt, x.dtype, self.mesh)

    def project(self, x):
        """(q [B, S, N, H], k, v [B, S, K, H], adapt): the projections of x with their LoRA
        adapters, biases and q / k norms, before RoPE; ``adapt`` gives the output projection
        its adapter (``out_projection``)."""
        dt, mesh, cfg = x.dtype, self.mesh, self.cfg
        q = jnp.einsum("BSD,DNH->BSNH", x, gathered(self.wq[...], dt, mesh))
        k = jnp.einsum("BSD,DKH->BSKH", x, gathered(self.wk[...], dt, mesh))
        v = jnp.einsum("BSD,DKH->BSKH", x, gathered(self.wv[...], dt, mesh))
        adapt = lora_adapt(self, lora.ATTENTION, cfg, dt, mesh)
        q = adapt(q, "q", "BSD,DNH->BSNH", x)
        k = adapt(k, "k", "BSD,DKH->BSKH", x)
        v = adapt(v, "v", "BSD,DKH->BSKH", x)
        if self.bq is not None:
            q = q + gathered(self.bq[...], dt, mesh)
            k = k + gathered(self.bk[...], dt, mesh)
            v = v + gathered(self.bv[...], dt, mesh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, adapt

    def attend(self, kind: str, q, k, v, segment_ids):
        """Ulysses attention of rotated q [B, S, N, H] over k, v [B, S, K, H] with the
        variants of the layer kind ("L": the sliding window) -> [B, S, N, H]."""
        cfg = self.cfg
        return ulysses_attention(q, k, v, mesh=self.mesh, causal=True, segment_ids=segment_ids,
                                 impl=cfg.attn_impl, head_chunks=self.head_chunks,
                                 layout=self.layout,
                                 max_segments=cfg.max_segments or DEFAULT_MAX_SEGMENTS,
                                 scale=cfg.attn_scale or None,
                                 window=cfg.sliding_window if kind == "L" else None,
                                 softcap=cfg.attn_softcap or None)

    def rope(self, kind: str, q, k, positions):
        """q and k rotated at ``positions`` [B, S] (or M-RoPE's [B, S, 3]) with the RoPE of
        the layer kind ("L" local or "G" global: its base and scaling)."""
        cfg = self.cfg
        theta, scaling = cfg.rope(kind)
        # INT32_MAX: transformers' fp32 angles at every position (no exact branch at all)
        exact_from = None if cfg.rope_exact_from >= INT32_MAX else cfg.rope_exact_from
        rope = partial(apply_rope, positions=positions, theta=theta, scaling=scaling,
                       exact_from=exact_from, sections=cfg.mrope_section)
        return rope(q), rope(k)


class MLP(nnx.Module):
    """SwiGLU MLP, optionally over sequence chunks (``model.mlp_chunk``, TiledMLP)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.ffn_dim
        init = nnx.initializers.normal(cfg.init_std)
        self.w_gate = nnx.Param(init(rngs.params(), (d, f)))
        self.w_up = nnx.Param(init(rngs.params(), (d, f)))
        self.w_down = nnx.Param(nnx.initializers.normal(
            cfg.init_std / (2 * cfg.n_layers) ** 0.5)(rngs.params(), (f, d)))
        self.cfg, self.mesh = cfg, mesh

    @staticmethod
    def _mlp(x, w_gate, w_up, w_down, *adapted, activation=jax.nn.silu, targets=(), scale=0.0):
        """``adapted``: A, B of each of ``targets`` in turn (LoRA, models/lora.py), flat so
        that the token-chunk loop passes them like the weights; none without LoRA."""
        adapters = dict(zip(targets, zip(adapted[0::2], adapted[1::2])))

        def proj(spec, inputs, w, target):
            y = jnp.einsum(spec, inputs, w)
            if target in adapters:
                y = y + lora.delta(spec, inputs, *adapters[target], scale)
            return y

        gate = proj("BSD,DF->BSF", x, w_gate, "gate")                              # [B, S, F]
        up = proj("BSD,DF->BSF", x, w_up, "up")
        return proj("BSF,FD->BSD", activation(gate) * up, w_down, "down")

    def __call__(self, x, norm: RMSNorm, post_norm: RMSNorm | None = None):
        """mlp(norm(x)), or post_norm(mlp(norm(x))) (Gemma's post-feedforward norm). With
        ``model.mlp_chunk`` (ALST's TiledMLP) the norms and the MLP run over chunks of each
        device's tokens together, recomputed per chunk in the backward pass: the [B, S/P, F]
        intermediates and the normed input exist one [B, C, .] chunk at a time. All of it is
        token-local, so Gemma's (1 + w) scales (``RMSNorm.weight``) and post-norm fuse too."""
        dt, mesh, chunk = x.dtype, self.mesh, self.cfg.mlp_chunk
        weights = [gathered(w[...], dt, mesh) for w in (self.w_gate, self.w_up, self.w_down)]
        # The family's gate activation: SwiGLU, or GeGLU (tanh GELU) in the Gemma family.
        act = ACTIVATIONS[family(self.cfg.family).activation]
        adapters = lora.adapters(self, lora.MLP)  # {} unless model.lora.rank > 0
        mlp = MLP._mlp
        if adapters:
            weights += [gathered(w, dt, mesh) for ab in adapters.values() for w in ab]
            mlp = partial(MLP._mlp, targets=tuple(adapters), scale=lora.scaling(self.cfg.lora))
        if not chunk or mesh is None:
            y = mlp(norm(x), *weights, activation=act)                       # [B, S, D]
            return y if post_norm is None else post_norm(y)
        eps = norm.eps
        if post_norm is None:
            fn = lambda xc, s, *w: mlp(rms_norm(xc, s, eps), *w, activation=act)
            scales = (norm.weight(mesh),)
        else:
            post_eps = post_norm.eps
            fn = lambda xc, s, s_post, *w: rms_norm(
                mlp(rms_norm(xc, s, eps), *w, activation=act), s_post, post_eps)
            scales = (norm.weight(mesh), post_norm.weight(mesh))
        return _token_chunks(fn, x, (*scales, *weights), mesh, chunk)


def _token_chunks(fn, x, weights, mesh: Mesh, chunk: int):
    """``fn(x_chunk, *weights)`` over ``chunk`` tokens of each device at a time
    (``tiled_mlp.tiled``: recomputed per chunk in the backward pass, no stacked copies).

    Args:
      fn: token-local [B, C, D] -> [B, C, D]; x: [B, S, D] sharded like the activations;
      weights: replicated (``_gathered``) arrays.
    """
    act = act_spec(mesh, 1)

    def body(x, *w):
        c = largest_divisor_at_most(x.shape[1], chunk)                     # x: [B/D, S/P, D]
        return tiled(fn, x, w, c)

    return jax.shard_map(body, mesh=mesh, in_specs=(act,) + (P(),) * len(weights),
                         out_specs=act)(x, *weights)
