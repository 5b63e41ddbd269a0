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
squared. Every attention stays inside one frame, so frames are independent: with
``model.vision.split`` (the default) the host deals whole frames to the devices
(``multimodal.vision_layout``), each device runs the tower on its share (the patch embedding,
each block and the merger are ``shard_map``s over the frames) and the features are gathered;
without it every device runs the tower on all of the batch's patches
(benchmarks/vision_memory.py compares the two). The blocks run in one ``lax.scan``, whose step
gathers one block's weights (under ZeRO-3), so no device holds the whole tower's weights. The features then go
to the placeholder tokens of each device's own shard (``merge_features``), and every device
runs the same program whether or not its shard holds an image.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..attention.chunked import chunked_attention
from ..config import ModelConfig
from ..mesh import act_spec, shard
from .layers import RMSNorm, gathered, gelu_exact
from .norms import rms_norm
from .rope import angles, rotate

_BLOCK = 256  # query / key block of the tower's chunked attention (windows are 64 patches)


def _linear(x, w, b):
    """x @ w + b in x's dtype: x [..., I]; w [I, O]; b [O]."""
    dt = x.dtype
    return jnp.einsum("...I,IO->...O", x, w.astype(dt)) + b.astype(dt)


class VisionBlock(nnx.Module):
    """The parameters of one block (its function is ``_block``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
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


def _block(p: dict, x, rope_angles, segment_ids, eps: float):
    """x + attn(norm1(x)), then + mlp(norm2(x)): attention within segments, 2-D RoPE.

    Args:
      p: one block's parameters (``VisionBlock``'s pure dict, float32).
      x: [N, Dv]; rope_angles [N, Hv/2] float32; segment_ids [N] ints.
    """
    dt = x.dtype
    h = rms_norm(x, p["norm1"]["scale"], eps)
    qkv = jnp.einsum("ND,DCMH->NCMH", h, p["wqkv"].astype(dt)) + p["bqkv"].astype(dt)
    q, k, v = (qkv[None, :, i] for i in range(3))                                    # [1, N, Nv, Hv]
    q, k = rotate(q, rope_angles[None]), rotate(k, rope_angles[None])
    block = min(_BLOCK, x.shape[0])
    o = chunked_attention(q, k, v, causal=False, segment_ids=segment_ids[None],
                          block_q=block, block_k=block)[0]                            # [N, Nv, Hv]
    x = x + jnp.einsum("NMH,MHD->ND", o, p["wo"].astype(dt)) + p["bo"].astype(dt)
    h = rms_norm(x, p["norm2"]["scale"], eps)
    gate, up = _linear(h, p["w_gate"], p["b_gate"]), _linear(h, p["w_up"], p["b_up"])
    return x + _linear(jax.nn.silu(gate) * up, p["w_down"], p["b_down"])           # [N, Dv]


def _embed(patch_embed, pixels, rope_hw, *, cfg: ModelConfig, inv: np.ndarray):
    """Patches already in window order (one shard's, or all) [N, K] -> [N, Dv], and their
    2-D RoPE angles [N, Hv/2]."""
    v, dt = cfg.vision, jnp.dtype(cfg.dtype)
    x = jnp.einsum("NK,KD->ND", pixels.astype(dt),
                   patch_embed.astype(dt).reshape(-1, v.hidden_size))               # [N, Dv]
    rope_angles = jnp.concatenate([angles(rope_hw[None, :, 0], inv, None),
                                   angles(rope_hw[None, :, 1], inv, None)], axis=-1)[0]
    return x, rope_angles


def _merge(p: dict, x, *, cfg: ModelConfig):
    """The 2x2 merger: [N, Dv] -> merged units [N / M^2, D] in the same order."""
    v = cfg.vision
    x = rms_norm(x, p["merge_norm"]["scale"], v.norm_eps).reshape(
        -1, v.spatial_merge_size ** 2 * v.hidden_size)
    x = gelu_exact(_linear(x, p["merge_w1"], p["merge_b1"]))
    return _linear(x, p["merge_w2"], p["merge_b2"])                                  # [U, D]


def split_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes the tower's frames are split over (``model.vision.split``): all of them
    (each device embeds 1 / devices of the batch's frames), () on no mesh."""
    return () if mesh is None else tuple(mesh.axis_names)


class VisionTower(nnx.Module):
    """Patch embedding, the blocks (stacked, one ``lax.scan``) and the 2x2 merger."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs):
        v = cfg.vision
        d, m2 = v.hidden_size, v.spatial_merge_size ** 2
        init = nnx.initializers.normal(cfg.init_std)
        # transformers' Conv3d weight [Dv, C, Tp, P, P] with its out axis last
        self.patch_embed = nnx.Param(init(rngs.params(), (
            v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size, d)))
        self.blocks = nnx.vmap(lambda key: VisionBlock(cfg, rngs=nnx.Rngs(key)))(
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

    def shards(self) -> int:
        """Groups the frames are laid out in (``multimodal.vision_layout``): the devices when
        the tower is split over them, else 1."""
        if not self.cfg.vision.split or self.mesh is None:
            return 1
        return int(np.prod([self.mesh.shape[a] for a in split_axes(self.mesh)]))

    def __call__(self, vision: dict) -> jax.Array:
        """The merged features of all images / frames, in their original order first.

        Args:
          vision: ``multimodal.prepare``'s arrays: ``pixels`` [G*C, K], ``rope_hw`` [G*C, 2],
            ``window_segments`` and ``frame_segments`` [G*C] (slots in window order, G groups
            of C, ``shards()``), ``unit_order`` [G*C / M^2].
        Returns:
          [G*C / M^2, D] in the compute dtype: row u < U is unit u of the images then videos.
        """
        cfg, mesh, v = self.cfg, self.mesh, self.cfg.vision
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        # Each weight replicated at its point of use (all-gathered under ZeRO-3; its gradient
        # reduce-scattered), in the compute dtype (the norm scales stay float32, as rms_norm
        # takes them): the blocks' inside the block loop, one block at a time.
        dt = jnp.dtype(cfg.dtype)

        def gather(tree):
            return jax.tree_util.tree_map_with_path(
                lambda path, w: gathered(w, jnp.float32 if "scale" in str(path) else dt, mesh),
                tree) if mesh is not None else tree

        def split(fn, n_in, n_weights=0):
            """fn over each device's frames (a shard_map over the split axes), or as is."""
            if self.shards() == 1:
                return fn
            spec = P(split_axes(mesh))
            return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * n_weights + (spec,) * n_in,
                                 out_specs=spec)

        x, rope_angles = split(partial(_embed, cfg=cfg, inv=self.inv_freq()), 2, 1)(
            gather(params["patch_embed"]), vision["pixels"],
            vision["rope_hw"])                                                        # [G*C, Dv]
        block = split(partial(_block, eps=v.norm_eps), 3, 1)

        def body(x, xs):
            weights, is_full = xs
            seg = jnp.where(is_full, vision["frame_segments"], vision["window_segments"])
            return block(gather(weights), x, rope_angles, seg), None

        if cfg.remat_policy != "none":
            body = jax.checkpoint(body, prevent_cse=False)
        full = np.zeros(v.depth, bool)
        full[list(v.fullatt_block_indexes)] = True
        x, _ = jax.lax.scan(body, x, (params["blocks"], jnp.asarray(full)))
        merger = {k: w for k, w in params.items() if k.startswith("merge")}
        units = split(partial(_merge, cfg=cfg), 1, 1)(gather(merger), x)  # [G*C/M^2, D]
        return jnp.take(units, vision["unit_order"], axis=0)


def vision_shardings(mesh: Mesh, split: bool) -> dict:
    """Shardings of ``positions`` [B, S, 3] and of each ``vision`` array."""
    groups = P(split_axes(mesh)) if split else P()
    act = NamedSharding(mesh, act_spec(mesh))
    return {"positions": NamedSharding(mesh, act_spec(mesh, 1)),
            "vision": {"pixels": NamedSharding(mesh, groups),
                       "rope_hw": NamedSharding(mesh, groups),
                       "window_segments": NamedSharding(mesh, groups),
                       "frame_segments": NamedSharding(mesh, groups),
                       "unit_order": NamedSharding(mesh, P()),
                       "feature_index": act}}


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
