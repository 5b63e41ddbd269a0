"""Flax NNX decoder of the Llama 3 / Mistral / Qwen family with Ulysses sequence-parallel
attention; the Gemma 2 / 3 block (``model.family=gemma``) is gemma.py, built from these parts.

Einsum letters: B batch, T query positions, S key positions (and the sequence in general),
N query heads, K kv heads, G group (N // K), H head dim, D model dim, F ffn dim, V vocab,
L layers.

Layout: activations are [B, S, D] sharded P("data", "seq", None) (P("data", ("ring", "seq"),
None) on a mesh with a ring axis): every device holds S/P tokens, and only attention
(``attention.ulysses_attention``: pure Ulysses, or hybrid Ulysses x Ring) ever sees a whole
sequence, for N/P heads.
Norms, projections and the MLP are token-local. The embedding and the loss split the
vocabulary over the same devices by default (``vocab.py``, ``model.vocab_parallel``); with
that off they are token-local too.

RoPE runs before the exchange, on each device's own tokens, with the global (or per-document)
position of every token carried in the batch (``positions`` [B, S], sharded like the tokens).
Rotating before the exchange needs no knowledge of which shard a token came from, and the
exchange moves rotated q/k, which is all attention needs.

Weights use an [in, out] layout per projection (``wq`` [D, N, H], ``wo`` [N, H, D],
``w_gate`` [D, F] ...), so a Hugging Face Linear weight [out, in] maps by a transpose and a
reshape. Transformer blocks are stacked on a leading L axis and run with ``jax.lax.scan``, so
compile time does not grow with depth; local (sliding-window) and global layers share that
scan (``scan_layers``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import LAYER_KINDS, ModelConfig
from .loss import largest_divisor_at_most
from ..mesh import act_spec, shard
from . import vocab
from ..attention import DEFAULT_MAX_SEGMENTS, ulysses_attention

_REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute all of it
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save the weight matmul outputs, but in host memory, copied back for the backward pass.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def _gathered(w: jax.Array, dtype, mesh: Mesh | None) -> jax.Array:
    """A weight in the compute dtype, replicated at its point of use.

    With ZeRO-3 sharding the stored weight is split over the devices; constraining the cast
    copy to be replicated makes XLA all-gather it here (and reduce-scatter its gradient),
    instead of moving activations to the weight. With replicated weights it is a no-op.
    """
    w = w.astype(dtype)
    return w if mesh is None else jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split convention (as Llama/Qwen in transformers).

    Args:
      x: [B, S, N, H]; positions: [B, S] ints.
    Returns:
      [B, S, N, H] in x's dtype.
    """
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)          # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq                   # [B, S, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]            # [B, S, 1, H]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMS normalisation in fp32 with a learned scale; output in the input's dtype.
    ``one_plus``: the scale is (1 + w) with w initialised to 0 (Gemma)."""

    def __init__(self, dim: int, eps: float, one_plus: bool = False):
        self.scale = nnx.Param((jnp.zeros if one_plus else jnp.ones)((dim,), jnp.float32))
        self.eps, self.one_plus = eps, one_plus

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = 1.0 + self.scale[...] if self.one_plus else self.scale[...]
        return (y * scale).astype(x.dtype)


def norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """The family's RMSNorm over ``dim``."""
    return RMSNorm(dim, cfg.norm_eps, one_plus=cfg.family == "gemma")


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
        """``kind``: "L" (local: sliding window, local RoPE base) or "G"; or, when the layers
        mix both, a traced index into LAYER_KINDS (``lax.switch`` between the two)."""
        dt, mesh, cfg = x.dtype, self.mesh, self.cfg
        q = jnp.einsum("BSD,DNH->BSNH", x, _gathered(self.wq[...], dt, mesh))
        k = jnp.einsum("BSD,DKH->BSKH", x, _gathered(self.wk[...], dt, mesh))
        v = jnp.einsum("BSD,DKH->BSKH", x, _gathered(self.wv[...], dt, mesh))
        if self.bq is not None:
            q = q + _gathered(self.bq[...], dt, mesh)
            k = k + _gathered(self.bk[...], dt, mesh)
            v = v + _gathered(self.bv[...], dt, mesh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def attend(kind, q, k, v):
            local = kind == "L"
            theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
            q = rope(q, positions, theta)                                            # [B, S, N, H]
            k = rope(k, positions, theta)                                            # [B, S, K, H]
            return ulysses_attention(q, k, v, mesh=mesh, causal=True, segment_ids=segment_ids,
                                     impl=cfg.attn_impl, head_chunks=self.head_chunks,
                                     layout=self.layout,
                                     max_segments=cfg.max_segments or DEFAULT_MAX_SEGMENTS,
                                     scale=cfg.attn_scale or None,
                                     window=cfg.sliding_window if local else None,
                                     softcap=cfg.attn_softcap or None)               # [B, S, N, H]

        if isinstance(kind, str):
            o = attend(kind, q, k, v)
        else:
            o = jax.lax.switch(kind, [partial(attend, c) for c in LAYER_KINDS], q, k, v)
        return jnp.einsum("BSNH,NHD->BSD", o, _gathered(self.wo[...], dt, mesh))


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
    def _mlp(x, w_gate, w_up, w_down, activation=jax.nn.silu):
        gate = jnp.einsum("BSD,DF->BSF", x, w_gate)                                # [B, S, F]
        up = jnp.einsum("BSD,DF->BSF", x, w_up)
        return jnp.einsum("BSF,FD->BSD", activation(gate) * up, w_down)

    def __call__(self, x):
        dt, mesh, chunk = x.dtype, self.mesh, self.cfg.mlp_chunk
        weights = [_gathered(w[...], dt, mesh) for w in (self.w_gate, self.w_up, self.w_down)]
        # GeGLU (tanh GELU) in the Gemma family, SwiGLU otherwise.
        gelu = partial(jax.nn.gelu, approximate=True)
        activation = gelu if self.cfg.family == "gemma" else jax.nn.silu
        if not chunk or mesh is None:
            return self._mlp(x, *weights, activation=activation)
        return _tiled_mlp(x, weights, mesh, chunk, activation)


def _tiled_mlp(x, weights, mesh: Mesh, chunk: int, activation=jax.nn.silu):
    """The MLP over sequence chunks of each device's tokens (ALST's TiledMLP).

    Each device maps the MLP over its own tokens ``chunk`` at a time, recomputing each chunk
    in the backward pass, so the [B, S/P, F] intermediates never exist whole: only one
    [B, C, F] chunk at a time.
    """
    act = act_spec(mesh, 1)

    def body(x, w_gate, w_up, w_down):
        b, s, d = x.shape                                                  # x: [B/D, S/P, D]
        c = largest_divisor_at_most(s, chunk)
        xs = jnp.moveaxis(x.reshape(b, s // c, c, d), 1, 0)               # [S/P/C, B, C, D]
        step = jax.checkpoint(lambda xc: MLP._mlp(xc, w_gate, w_up, w_down, activation))
        return jnp.moveaxis(jax.lax.map(step, xs), 0, 1).reshape(b, s, d)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(act, P(), P(), P()), out_specs=act)
    return fn(x, *weights)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1):
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, mesh, rngs=rngs, layout=layout, head_chunks=head_chunks)
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg, mesh, rngs=rngs)
        self.mesh = mesh

    def __call__(self, x, positions, segment_ids, kind="G"):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids, kind)
        x = x + self.mlp(self.mlp_norm(x))
        return x if self.mesh is None else shard(x, self.mesh, act_spec(self.mesh, 1))


class Decoder(nnx.Module):
    """Decoder-only LM. ``model(tokens)`` -> fp32 logits [B, S, V].

    ``layout`` matters only on a mesh with a ring axis: "natural" (tokens in order; attention
    reorders internally) or "zigzag" (the batch is already in ``ring.zigzag_permutation``
    order, as the training data loader produces it, with true positions). ``head_chunks``:
    see ``ulysses_attention``.
    """

    def __init__(self, cfg: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs, layout: str = "natural",
                 head_chunks: int = 1):
        self.cfg, self.mesh = cfg, mesh
        self.embed = nnx.Param(nnx.initializers.normal(cfg.init_std)(
            rngs.params(), (cfg.vocab_size, cfg.d_model)))                          # [V, D]
        keys = jax.random.split(rngs.params(), cfg.n_layers)
        if cfg.family == "gemma":
            from .gemma import GemmaBlock as block  # gemma.py builds on this module's pieces
        else:
            block = Block
        self.layers = nnx.vmap(
            lambda key: block(cfg, mesh, rngs=nnx.Rngs(key), layout=layout,
                              head_chunks=head_chunks))(keys)                        # [L, ...]
        self.final_norm = norm(cfg, cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nnx.Param(
            nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.d_model, cfg.vocab_size)))

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    @property
    def vocab_parallel(self) -> bool:
        """Embedding and loss split over the vocabulary (``model.vocab_parallel``, P > 1)."""
        return self.cfg.vocab_parallel and vocab.shards(self.mesh) > 1

    def head_weight(self) -> jax.Array:
        """The output projection [D, V] in float32 (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def hidden(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """Final-normed hidden states [B, S, D] in the compute dtype.

        Args:
          tokens: [B, S] int32.
          positions: [B, S] ints (default 0..S-1 in every row).
          segment_ids: [B, S] ints for packed documents, or None.
        """
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if self.vocab_parallel:
            x = vocab.embed(self.embed[...], tokens, mesh=self.mesh, dtype=self.dtype,
                            chunk=self.cfg.loss_chunk)                              # [B, S, D]
        else:
            x = jnp.take(_gathered(self.embed[...], self.dtype, self.mesh), tokens, axis=0)
            x = shard(x, self.mesh, act_spec(self.mesh, 1))
        if self.cfg.family == "gemma":  # embeddings x sqrt(D), the factor in the compute dtype
            x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
        return self.final_norm(scan_layers(self.layers, self.cfg, x, positions, segment_ids))

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        h = self.hidden(tokens, positions, segment_ids)
        w = _gathered(self.head_weight(), self.dtype, self.mesh)
        logits = jnp.einsum("BSD,DV->BSV", h, w, preferred_element_type=jnp.float32)
        cap = self.cfg.final_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits


def scan_layers(layers, cfg: ModelConfig, x, positions, segment_ids):
    """Runs the stacked layers [L, ...] over x [B, S, D] in one ``lax.scan``.

    Per-layer attention kinds (``cfg.layer_kinds()``: L sliding window, G global): when all
    layers are of one kind it is a static argument, the program of a model without windows.
    When they mix (Gemma 3's five local then one global, Qwen2's max_window_layers) the scan
    also walks an int [L] of kind indices, and each layer's attention chooses its branch by
    ``lax.switch``: both branches are compiled once (each with a static window, RoPE base
    and kernel: cuDNN's window length must be static, as must the ring's plan of steps), the
    parameters stay stacked as they are, and the residuals the two branches save share
    buffers where their types agree (JAX merges them), so memory stays that of one kind.
    """
    graphdef, stacked = nnx.split(layers)
    kinds = cfg.layer_kinds()

    def layer(x, xs):
        state, kind = xs if len(set(kinds)) > 1 else (xs, kinds[0])
        return nnx.merge(graphdef, state)(x, positions, segment_ids, kind), None

    if cfg.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    if len(set(kinds)) > 1:
        ids = jnp.asarray([LAYER_KINDS.index(c) for c in kinds], jnp.int32)           # [L]
        x, _ = jax.lax.scan(layer, x, (stacked, ids))
    else:
        x, _ = jax.lax.scan(layer, x, stacked)
    return x
