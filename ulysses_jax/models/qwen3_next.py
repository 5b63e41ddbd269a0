"""The Qwen3-Next decoder block (``model.family=qwen3_next``): Gated DeltaNet and gated attention.

Letters as in decoder.py, plus for the DeltaNet layers: Hk linear key heads, Hv linear value
heads (Hv = r Hk), Q key head dim, V value head dim, W convolution width.

As transformers' Qwen3-Next modeling code defines it:
  - every norm scales by (1 + w), w stored and initialised at 0 (``layers.norm``, the
    family's trait in families.py), final norm and q/k norms included; the DeltaNet output
    norm is a plain RMSNorm (weight, init 1) times SiLU of the gate z;
  - token mixer per layer (``ModelConfig.layer_mixers``: D Gated DeltaNet, A full attention;
    transformers' layer_types, by default three DeltaNet layers then one attention layer);
  - full attention: q_proj gives each head its query and an output gate ([D, N, 2H]); q/k
    norms over the head dim, RoPE on the first ``partial_rotary_factor`` x H dims only, the
    attention output times sigmoid(gate) before o_proj;
  - Gated DeltaNet: in_proj_qkvz ([D, Hk, 2Q + 2rV], per key head its q, k, then its r value
    heads' v and z) and in_proj_ba ([D, Hk, 2r]: b then a per key head); a depthwise causal
    convolution (width W, SiLU) over the q, k, v channels; beta = sigmoid(b), decay
    g = -exp(A_log) softplus(a + dt_bias); the gated delta rule with l2-normalised q, k
    (``attention/linear.py``: the exchange, ``attention/deltanet.py``: the kernels);
  - MLP: dense SwiGLU, or the MoE with a sigmoid-gated shared expert (``moe.py``).
LoRA (models/lora.py) adapts the fused weights as they are, as peft adapts transformers'
Linears: the q adapter's B [R, N, 2H] changes each head's query and its gate, the DeltaNet's
B [R, Hk, 2Q + 2rV] (target linear_qkvz) its q, k, v and z.
Parameters keep transformers' fused layouts (in_proj_qkvz, the [C, 1, W] convolution, q and
gate in one wq), so a checkpoint maps tensor for tensor; the model splits them where used.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..attention import DEFAULT_MAX_SEGMENTS, ulysses_attention
from ..attention.linear import gated_deltanet
from ..config import INT32_MAX, ModelConfig
from .layers import gathered as _gathered, lora_adapt, norm, out_projection
from ..families import family
from . import lora
from .llama import Block
from .rope import apply_rope
from .norms import gated_rms_norm


def rotary_dim(cfg: ModelConfig) -> int:
    """Head dims RoPE rotates: int(H x partial_rotary_factor) (transformers' rounding)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


class GatedAttention(nnx.Module):
    """Qwen3-Next full attention: output-gated, partial RoPE, (1 + w) q/k norms."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(cfg.init_std)
        self.wq = nnx.Param(init(rngs.params(), (d, n, 2 * h)))                 # query | gate
        self.wk = nnx.Param(init(rngs.params(), (d, k, h)))
        self.wv = nnx.Param(init(rngs.params(), (d, k, h)))
        self.wo = nnx.Param(nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)(
            rngs.params(), (n, h, d)))
        self.q_norm, self.k_norm = norm(cfg, h), norm(cfg, h)
        self.cfg, self.mesh, self.layout, self.head_chunks = cfg, mesh, layout, head_chunks

    def __call__(self, x, positions, segment_ids):
        q, gate, k, v, adapt = self.project(x)
        q, k = self.rope(q, k, positions)                                          # [B, S, N, H]
        return self.gated_output(self.attend(q, k, v, segment_ids), gate, adapt, x.dtype)

    def project(self, x):
        """(q [B, S, N, H] normed, its gate [B, S, N, H], k normed, v [B, S, K, H], adapt):
        the projections of x with their LoRA adapters, before RoPE."""
        dt, mesh, cfg, h = x.dtype, self.mesh, self.cfg, self.cfg.head_dim
        adapt = lora_adapt(self, lora.ATTENTION, cfg, dt, mesh)
        qg = jnp.einsum("BSD,DNH->BSNH", x, _gathered(self.wq[...], dt, mesh))     # [B, S, N, 2H]
        qg = adapt(qg, "q", "BSD,DNH->BSNH", x)
        q, gate = qg[..., :h], qg[..., h:]
        k = adapt(jnp.einsum("BSD,DKH->BSKH", x, _gathered(self.wk[...], dt, mesh)), "k",
                  "BSD,DKH->BSKH", x)
        v = adapt(jnp.einsum("BSD,DKH->BSKH", x, _gathered(self.wv[...], dt, mesh)), "v",
                  "BSD,DKH->BSKH", x)
        return self.q_norm(q), gate, self.k_norm(k), v, adapt

    def rope(self, q, k, positions):
        """RoPE (with its scaling) on the first rotary_dim dims of each head only."""
        cfg = self.cfg
        theta, scaling = cfg.rope("G")
        exact_from = None if cfg.rope_exact_from >= INT32_MAX else cfg.rope_exact_from
        rope = partial(apply_rope, positions=positions, theta=theta, scaling=scaling,
                       rotary_dim=rotary_dim(cfg), exact_from=exact_from)
        return rope(q), rope(k)

    def attend(self, q, k, v, segment_ids):
        """Ulysses attention of rotated q [B, S, N, H] over k, v [B, S, K, H]."""
        cfg = self.cfg
        return ulysses_attention(q, k, v, mesh=self.mesh, causal=True, segment_ids=segment_ids,
                                 impl=cfg.attn_impl, head_chunks=self.head_chunks,
                                 layout=self.layout,
                                 max_segments=cfg.max_segments or DEFAULT_MAX_SEGMENTS,
                                 scale=cfg.attn_scale or None)

    def gated_output(self, o, gate, adapt, dtype):
        """The attention output [B, S, N, H] times sigmoid(gate), projected -> [B, S, D]."""
        return out_projection(o * jax.nn.sigmoid(gate), self.wo[...], adapt, dtype, self.mesh)


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next linear attention (Gated DeltaNet) over sequence-sharded tokens."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        d, hk, hv = cfg.d_model, cfg.linear_key_heads, cfg.linear_value_heads
        dq, dv, w = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv
        r = hv // hk
        init = nnx.initializers.normal(cfg.init_std)
        self.in_proj_qkvz = nnx.Param(init(rngs.params(), (d, hk, 2 * dq + 2 * r * dv)))
        self.in_proj_ba = nnx.Param(init(rngs.params(), (d, hk, 2 * r)))
        # transformers' depthwise Conv1d weight [channels, 1, W]; channels q | k | v, head-major.
        bound = 1.0 / math.sqrt(w)
        self.conv = nnx.Param(jax.random.uniform(rngs.params(), (2 * hk * dq + hv * dv, 1, w),
                                                 jnp.float32, -bound, bound))
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32,
                                                          1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
        self.norm_scale = nnx.Param(jnp.ones((dv,), jnp.float32))
        self.out_proj = nnx.Param(nnx.initializers.normal(
            cfg.init_std / (2 * cfg.n_layers) ** 0.5)(rngs.params(), (hv, dv, d)))
        self.cfg, self.mesh = cfg, mesh

    def __call__(self, x, segment_ids):
        q, k, v, z, b, a, adapters = self.project(x)
        o = gated_deltanet(q, k, v, b, a, *self.kernel_weights(), mesh=self.mesh,
                           segment_ids=segment_ids)                               # [B, S, Hv, V]
        return self.output(o, z, adapters, x.dtype)

    def project(self, x):
        """(q, k [B, S, Hk, Q], v, z [B, S, Hv, V], b, a [B, S, Hv], adapters): the
        projections of x with their LoRA adapters, before the convolution; ``adapters`` as
        ``lora.adapters`` gives them (gathered), for ``output``."""
        dt, mesh, cfg = x.dtype, self.mesh, self.cfg
        b_, s = x.shape[:2]
        hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
        dq, dv = cfg.linear_key_dim, cfg.linear_value_dim
        r = hv // hk
        adapters = {t: [_gathered(w, dt, mesh) for w in ab]
                    for t, ab in lora.adapters(self, lora.LINEAR).items()}  # {} without LoRA
        s_lora = lora.scaling(cfg.lora) if adapters else 0.0
        # One einsum per piece of in_proj_qkvz (its columns per key head: q, k, v, z), so
        # each lands in its own array; one fused output would be sliced four ways. An
        # adapter's B [R, Hk, 2Q + 2rV] is sliced the same way, x A computed once.
        w = _gathered(self.in_proj_qkvz[...], dt, mesh)                           # [D, Hk, .]
        bounds = (0, dq, 2 * dq, 2 * dq + r * dv, 2 * dq + 2 * r * dv)
        pieces = [jnp.einsum("BSD,DKW->BSKW", x, w[..., lo:hi])
                  for lo, hi in zip(bounds, bounds[1:])]                          # q: [B, S, Hk, Q]
        if "linear_qkvz" in adapters:
            lora_a, lora_b = adapters["linear_qkvz"]                 # [D, R], [R, Hk, 2Q + 2rV]
            xa = jnp.einsum("BSD,DR->BSR", x, lora_a) * jnp.asarray(s_lora, dt)   # [B, S, R]
            pieces = [p + jnp.einsum("BSR,RKW->BSKW", xa, lora_b[..., lo:hi])
                      for p, lo, hi in zip(pieces, bounds, bounds[1:])]
        q, k, v, z = pieces
        v, z = v.reshape(b_, s, hv, dv), z.reshape(b_, s, hv, dv)                 # [B, S, Hv, V]
        ba = jnp.einsum("BSD,DKJ->BSKJ", x, _gathered(self.in_proj_ba[...], dt, mesh))
        if "linear_ba" in adapters:  # (lora.delta's rank letter is R)
            ba = ba + lora.delta("BSD,DKJ->BSKJ", x, *adapters["linear_ba"], s_lora)
        b, a = ba[..., :r].reshape(b_, s, hv), ba[..., r:].reshape(b_, s, hv)     # [B, S, Hv]
        return q, k, v, z, b, a, adapters

    def kernel_weights(self):
        """(conv_q, conv_k [Hk, Q, W], conv_v [Hv, V, W], a_log, dt_bias [Hv]) in float32,
        replicated: the weights ``gated_deltanet`` takes."""
        cfg, mesh = self.cfg, self.mesh
        hk, dq, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
        conv = _gathered(self.conv[...], jnp.float32, mesh)[:, 0]                 # [C, W]
        cq = conv[:hk * dq].reshape(hk, dq, -1)
        ck = conv[hk * dq:2 * hk * dq].reshape(hk, dq, -1)
        cv = conv[2 * hk * dq:].reshape(cfg.linear_value_heads, dv, -1)
        return (cq, ck, cv, _gathered(self.a_log[...], jnp.float32, mesh),
                _gathered(self.dt_bias[...], jnp.float32, mesh))

    def output(self, o, z, adapters, dtype):
        """The delta rule's output o [B, S, Hv, V]: normed, gated by SiLU(z) and projected
        -> [B, S, D]."""
        mesh = self.mesh
        s_lora = lora.scaling(self.cfg.lora) if adapters else 0.0
        out_adapter = adapters.get("linear_out")
        scale = _gathered(self.norm_scale[...], jnp.float32, mesh)
        o = gated_rms_norm(o, scale, z, self.cfg.norm_eps)                        # [B, S, Hv, V]
        y = jnp.einsum("BSNV,NVD->BSD", o, _gathered(self.out_proj[...], dtype, mesh))
        if out_adapter is not None:
            y = y + lora.delta("BSNV,NVD->BSD", o, *out_adapter, s_lora)
        return y


class Qwen3NextBlock(Block):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is Gated DeltaNet (``mixer`` "D")
    or gated attention ("A"), the MLP dense or MoE (``sparse``, llama.Block's
    feed_forward). Returns (x, router stats)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1, sparse: bool = False,
                 mixer: str = "A"):
        self.attn_norm = norm(cfg, cfg.d_model)
        if mixer == "D":
            self.linear_attn, self.attn = GatedDeltaNet(cfg, mesh, rngs=rngs), None
        else:
            self.linear_attn = None
            self.attn = GatedAttention(cfg, mesh, rngs=rngs, layout=layout,
                                       head_chunks=head_chunks)
        self._init_feed_forward(cfg, mesh, rngs, sparse)
        # LoRA adapters (models/lora.py) drawn after every base weight: they leave those alone.
        if self.attn is None:
            lora.attach(self.linear_attn, lora.LINEAR, cfg.lora, rngs)
        else:
            lora.attach(self.attn, lora.ATTENTION, cfg.lora, rngs)
        self._attach_feed_forward_lora(cfg, rngs)

    def __call__(self, x, positions, segment_ids, kind="G"):
        with jax.named_scope("attention"):
            normed = self._mixer_input(x)                                            # [B, S, D]
            if self.attn is None:
                o = self.linear_attn(normed, segment_ids)                            # [B, S, D]
            else:
                o = self.attn(normed, positions, segment_ids)                        # [B, S, D]
        return self.feed_forward(x, segment_ids, o)


def mixer_matmul_params(cfg: ModelConfig, mixer: str) -> int:
    """Weights one token multiplies through in a layer's token mixer (training/flops.py)."""
    d = cfg.d_model
    if mixer == "D":
        hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
        dq, dv = cfg.linear_key_dim, cfg.linear_value_dim
        return d * (2 * hk * dq + 2 * hv * dv) + d * 2 * hv + hv * dv * d
    gate = 2 if family(cfg.family).gated_attention else 1  # q_proj also yields the gate
    return d * cfg.n_heads * cfg.head_dim * (1 + gate) + 2 * d * cfg.n_kv_heads * cfg.head_dim


def deltanet_flops_per_token(cfg: ModelConfig, chunk: int = 64) -> float:
    """Forward + backward FLOPs of one DeltaNet layer's chunked delta rule, per token.

    Per chunk of C tokens and value head, multiply-adds: q.k and k.k (2 C^2 Q), the inverse
    by squaring (2 (ceil(log2 C) - 1) C^3), U and the intra-chunk output (2 C^2 V), reading
    and writing the state (3 C Q V); x 2 FLOPs, x 3 for forward + backward, / C per token.
    """
    c, dq, dv = chunk, cfg.linear_key_dim, cfg.linear_value_dim
    squarings = max(0, math.ceil(math.log2(c)) - 1)
    per_chunk = 2 * c * c * dq + 2 * squarings * c ** 3 + 2 * c * c * dv + 3 * c * dq * dv
    return 6.0 * cfg.linear_value_heads * per_chunk / c
