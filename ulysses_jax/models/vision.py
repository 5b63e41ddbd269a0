"""The Qwen2.5-VL vision tower (``model.family=qwen2_5_vl``), as transformers defines it.

Letters: N patches (of all images and video frames of a batch, concatenated), U merged units
(N / M^2, M = spatial_merge_size: one decoder token each), Dv the tower width, Nv its heads,
Hv their dim, Fv its MLP width, K = C * Tp * P * P the values of one flattened patch (the
processor's ``pixel_values`` rows), D the decoder width.

A flattened patch is projected by one matmul (transformers' Conv3d whose kernel equals its
stride), then the patches are put in window order (``multimodal.vision_layout``: the units of
each window of window_size pixels together, a unit's M^2 patches adjacent) and run through
``depth`` pre-norm blocks: bidirectional attention with 2-D RoPE (a quarter of each head's
dims turned by the patch's row, a quarter by its column, the other half their pairs), within a
window, or within a whole frame at ``fullatt_block_indexes``; a SwiGLU MLP with biases. The
merger (RMSNorm, the M^2 patches of a unit concatenated, Linear, exact GELU, Linear to D) makes
one decoder embedding per unit, and the units go back to their original order.

Both kinds of attention are one ``chunked_attention`` call with segment ids (windows, or frames;
each contiguous in window order), so a tile of patches that shares no segment with another is
never visited: cost grows with the patches times the window (or frame), never with all patches
squared. The tower is token-local to each frame, and the decoder uses only its output rows,
so the Decoder runs it on the whole batch's patches on every sequence device (replicated);
the features then go to the placeholder tokens of each device's own shard
(``merge_features``), and every device runs the same program whether or not its shard holds
an image.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..attention.chunked import chunked_attention
from ..config import ModelConfig
from ..mesh import act_spec, shard
from .layers import RMSNorm, gathered
from .rope import angles, rotate

_BLOCK = 256  # query / key block of the tower's chunked attention (windows are 64 patches)


def _linear(x, w, b, mesh):
    """x @ w + b in x's dtype: x [..., I]; w [I, O]; b [O]."""
    dt = x.dtype
    return jnp.einsum("...I,IO->...O", x, gathered(w, dt, mesh)) + gathered(b, dt, mesh)


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); attention within segments, 2-D RoPE."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        v = cfg.vision
        d, n, f = v.hidden_size, v.num_heads, v.intermediate_size
        h = d // n
        init = nnx.initializers.normal(cfg.init_std)
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, jnp.float32))
        self.norm1 = RMSNorm(d, v.norm_eps)
        self.norm2 = RMSNorm(d, v.norm_eps)
        self.wqkv = nnx.Param(init(rngs.params(), (d, 3, n, h)))                     # [Dv, 3, Nv, Hv]
        self.bqkv = zeros(3, n, h)
        self.wo = nnx.Param(init(rngs.params(), (n, h, d)))                           # [Nv, Hv, Dv]
        self.bo = zeros(d)
        self.w_gate = nnx.Param(init(rngs.params(), (d, f)))
        self.b_gate = zeros(f)
        self.w_up = nnx.Param(init(rngs.params(), (d, f)))
        self.b_up = zeros(f)
        self.w_down = nnx.Param(init(rngs.params(), (f, d)))
        self.b_down = zeros(d)
        self.mesh = mesh

    def __call__(self, x, rope_angles, segment_ids):
        """x [N, Dv]; rope_angles [N, Hv/2] float32; segment_ids [N] ints -> [N, Dv]."""
        dt, mesh = x.dtype, self.mesh
        h = self.norm1(x)
        qkv = jnp.einsum("ND,DCMH->NCMH", h, gathered(self.wqkv[...], dt, mesh)) + \
            gathered(self.bqkv[...], dt, mesh)                                       # [N, 3, Nv, Hv]
        q, k, v = (qkv[None, :, i] for i in range(3))                                # [1, N, Nv, Hv]
        q, k = rotate(q, rope_angles[None]), rotate(k, rope_angles[None])
        block = min(_BLOCK, x.shape[0])
        o = chunked_attention(q, k, v, causal=False, segment_ids=segment_ids[None],
                              block_q=block, block_k=block)[0]                        # [N, Nv, Hv]
        x = x + jnp.einsum("NMH,MHD->ND", o, gathered(self.wo[...], dt, mesh)) + \
            gathered(self.bo[...], dt, mesh)
        h = self.norm2(x)
        gate = _linear(h, self.w_gate[...], self.b_gate[...], mesh)                 # [N, Fv]
        up = _linear(h, self.w_up[...], self.b_up[...], mesh)
        return x + _linear(jax.nn.silu(gate) * up, self.w_down[...], self.b_down[...], mesh)


class VisionTower(nnx.Module):
    """Patch embedding, the blocks (stacked, one ``lax.scan``) and the 2x2 merger."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        v = cfg.vision
        d, m2 = v.hidden_size, v.spatial_merge_size ** 2
        init = nnx.initializers.normal(cfg.init_std)
        # transformers' Conv3d weight [Dv, C, Tp, P, P] with its out axis last
        self.patch_embed = nnx.Param(init(rngs.params(), (
            v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size, d)))
        self.blocks = nnx.vmap(lambda key: VisionBlock(cfg, mesh, rngs=nnx.Rngs(key)))(
            jax.random.split(rngs.params(), v.depth))                                  # [depth, ...]
        self.merge_norm = RMSNorm(d, v.norm_eps)
        self.merge_w1 = nnx.Param(init(rngs.params(), (m2 * d, m2 * d)))
        self.merge_b1 = nnx.Param(jnp.zeros((m2 * d,), jnp.float32))
        self.merge_w2 = nnx.Param(init(rngs.params(), (m2 * d, cfg.d_model)))
        self.merge_b2 = nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32))
        self.cfg, self.mesh = cfg, mesh

    def inv_freq(self) -> np.ndarray:
        """[Hv/4] float32: the frequencies each of the two axes turns by (transformers'
        axial RoPE: base ** (2i / (Hv / 2)))."""
        v = self.cfg.vision
        half = v.hidden_size // v.num_heads // 2
        exponent = np.arange(0, half, 2).astype(np.float32) / np.float32(half)
        return np.float32(1.0) / np.float32(np.float64(v.rope_theta) ** exponent.astype(np.float64))

    def __call__(self, layout: dict) -> jax.Array:
        """The merged features of all images / frames in their original order.

        Args:
          layout: ``multimodal.vision_layout``'s arrays, as jax arrays: ``pixels`` [N, K],
            ``order`` [N] (patch index of each window-order slot), ``rope_hw`` [N, 2] (row,
            column of each slot's patch), ``window_segments`` and ``frame_segments`` [N],
            ``unit_order`` [U] (window-order slot of each unit).
        Returns:
          [U, D] in the compute dtype.
        """
        cfg, mesh = self.cfg, self.mesh
        v, dt = cfg.vision, jnp.dtype(cfg.dtype)
        m2 = v.spatial_merge_size ** 2
        x = jnp.einsum("NK,KD->ND", layout["pixels"].astype(dt),
                       gathered(self.patch_embed[...], dt, mesh).reshape(-1, v.hidden_size))
        x = jnp.take(x, layout["order"], axis=0)                                     # [N, Dv]
        inv = self.inv_freq()
        hw = layout["rope_hw"]
        rope_angles = jnp.concatenate([angles(hw[None, :, 0], inv, None),
                                       angles(hw[None, :, 1], inv, None)], axis=-1)[0]  # [N, Hv/2]
        full = np.zeros(v.depth, bool)
        full[list(v.fullatt_block_indexes)] = True
        graphdef, state = nnx.split(self.blocks)

        def body(x, xs):
            state, is_full = xs
            seg = jnp.where(is_full, layout["frame_segments"], layout["window_segments"])
            return nnx.merge(graphdef, state)(x, rope_angles, seg), None

        if cfg.remat != "none":
            body = jax.checkpoint(body, prevent_cse=False)
        x, _ = jax.lax.scan(body, x, (state, jnp.asarray(full)))
        x = self.merge_norm(x).reshape(-1, m2 * v.hidden_size)                       # [U, M^2 Dv]
        x = jax.nn.gelu(_linear(x, self.merge_w1[...], self.merge_b1[...], mesh),
                        approximate=False)
        x = _linear(x, self.merge_w2[...], self.merge_b2[...], mesh)                 # [U, D]
        return jnp.take(x, layout["unit_order"], axis=0)


def merge_features(x: jax.Array, features: jax.Array, feature_index: jax.Array,
                   mesh: Mesh | None) -> jax.Array:
    """The token embeddings with each placeholder's replaced by its vision feature.

    Args:
      x: [B, S, D] token embeddings (sharded like the activations).
      features: [U, D] the tower's output, all images then all videos (replicated).
      feature_index: [B, S] ints: the feature row of each placeholder token, -1 for text
        (``multimodal.feature_index``, computed for the whole sequence before sharding).
    Returns:
      [B, S, D] in x's dtype, sharded as x.
    """
    picked = jnp.take(features.astype(x.dtype), jnp.maximum(feature_index, 0), axis=0)
    out = jnp.where((feature_index >= 0)[..., None], picked, x)
    return out if mesh is None else shard(out, mesh, act_spec(mesh, 1))
