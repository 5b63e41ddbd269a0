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
that off they are token-local too. In a mixture-of-experts layer (``model.num_experts``,
``moe.py``) the experts are split over all devices and tokens visit them by all-to-all
(``expert_parallel.py``); ``layer_groups`` says how dense and MoE layers are stacked.

RoPE runs before the exchange, on each device's own tokens, with the global (or per-document)
position of every token carried in the batch (``positions`` [B, S], sharded like the tokens).
Rotating before the exchange needs no knowledge of which shard a token came from, and the
exchange moves rotated q/k, which is all attention needs. RoPE itself, with its scalings
(``model.rope_scaling``, ``model.rope_local_scaling``), is rope.py.

Weights use an [in, out] layout per projection (``wq`` [D, N, H], ``wo`` [N, H, D],
``w_gate`` [D, F] ...), so a Hugging Face Linear weight [out, in] maps by a transpose and a
reshape. Transformer blocks are stacked on a leading L axis and run with ``jax.lax.scan``, so
compile time does not grow with depth; local (sliding-window) and global layers share that
scan (``Decoder._run_layers``).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..config import INT32_MAX, LAYER_KINDS, ModelConfig
from .loss import largest_divisor_at_most
from .norms import rms_norm
from .rope import apply_rope
from .tiled_mlp import tiled
from ..mesh import act_spec, shard
from . import vocab
from ..attention import DEFAULT_MAX_SEGMENTS, ulysses_attention
from .moe import MoE, STAT_KEYS, is_moe_layer

_LAYER_INPUT = "layer_input"
_REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute all of it
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Save the weight matmul outputs, but in host memory, copied back for the backward pass.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    # remat full with model.offload_checkpoints: the layer input, the one value the layer
    # loop keeps per layer for the backward pass, goes to host memory and comes back there.
    "full_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[_LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
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
    """Unscaled RoPE over the whole head (``rope.apply_rope``, kept for older callers).

    Args:
      x: [B, S, N, H]; positions: [B, S] ints.
    Returns:
      [B, S, N, H] in x's dtype.
    """
    return apply_rope(x, positions, theta)


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
        w = self.scale[...] if mesh is None else _gathered(self.scale[...], jnp.float32, mesh)
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
    return RMSNorm(dim, cfg.norm_eps, one_plus=cfg.family in ("gemma", "qwen3_next"))


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
            theta, scaling = cfg.rope(kind)
            # INT32_MAX: transformers' fp32 angles at every position (no exact branch at all)
            exact_from = None if cfg.rope_exact_from >= INT32_MAX else cfg.rope_exact_from
            q = apply_rope(q, positions, theta, scaling, exact_from=exact_from)      # [B, S, N, H]
            k = apply_rope(k, positions, theta, scaling, exact_from=exact_from)      # [B, S, K, H]
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

    def __call__(self, x, norm: RMSNorm, post_norm: RMSNorm | None = None):
        """mlp(norm(x)), or post_norm(mlp(norm(x))) (Gemma's post-feedforward norm). With
        ``model.mlp_chunk`` (ALST's TiledMLP) the norms and the MLP run over chunks of each
        device's tokens together, recomputed per chunk in the backward pass: the [B, S/P, F]
        intermediates and the normed input exist one [B, C, .] chunk at a time. All of it is
        token-local, so Gemma's (1 + w) scales (``RMSNorm.weight``) and post-norm fuse too."""
        dt, mesh, chunk = x.dtype, self.mesh, self.cfg.mlp_chunk
        weights = [_gathered(w[...], dt, mesh) for w in (self.w_gate, self.w_up, self.w_down)]
        # GeGLU (tanh GELU) in the Gemma family, SwiGLU otherwise.
        gelu = partial(jax.nn.gelu, approximate=True)
        act = gelu if self.cfg.family == "gemma" else jax.nn.silu
        if not chunk or mesh is None:
            y = self._mlp(norm(x), *weights, activation=act)                       # [B, S, D]
            return y if post_norm is None else post_norm(y)
        eps = norm.eps
        if post_norm is None:
            fn = lambda xc, s, *w: MLP._mlp(rms_norm(xc, s, eps), *w, activation=act)
            scales = (norm.weight(mesh),)
        else:
            post_eps = post_norm.eps
            fn = lambda xc, s, s_post, *w: rms_norm(
                MLP._mlp(rms_norm(xc, s, eps), *w, activation=act), s_post, post_eps)
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


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    ``sparse``: the MLP is a mixture of experts (``self.moe``, models/moe.py) instead of the
    dense SwiGLU (``self.mlp``). Calls return (x, router stats or None).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh | None, *, rngs: nnx.Rngs,
                 layout: str = "natural", head_chunks: int = 1, sparse: bool = False):
        self.attn_norm = norm(cfg, cfg.d_model)
        self.attn = Attention(cfg, mesh, rngs=rngs, layout=layout, head_chunks=head_chunks)
        self.mlp_norm = norm(cfg, cfg.d_model)
        self.mlp = None if sparse else MLP(cfg, mesh, rngs=rngs)
        self.moe = MoE(cfg, mesh, rngs=rngs) if sparse else None
        self.mesh, self.chunk = mesh, cfg.mlp_chunk

    def __call__(self, x, positions, segment_ids, kind="G"):
        """``kind``: the layer's attention kind (``Attention.__call__``)."""
        # Named scopes label the ops (profiles, ulysses_jax/memory.py's categories).
        with jax.named_scope("attention"):
            normed = self.attn_norm.over_chunks(x, self.mesh, self.chunk)             # [B, S, D]
            x = x + self.attn(normed, positions, segment_ids, kind)
        return self.feed_forward(x, segment_ids)

    def feed_forward(self, x, segment_ids):
        """x + mlp(norm(x)), dense or MoE; returns (x resharded, router stats or None)."""
        stats = None
        with jax.named_scope("mlp"):
            if self.moe is None:
                x = x + self.mlp(x, self.mlp_norm)
            else:
                valid = jnp.ones(x.shape[:2], jnp.float32) if segment_ids is None else \
                    (segment_ids > 0).astype(jnp.float32)                   # [B, S]
                y, stats = self.moe(self.mlp_norm(x), valid)
                x = x + y
        return (x if self.mesh is None else shard(x, self.mesh, act_spec(self.mesh, 1))), stats


def layer_groups(cfg: ModelConfig) -> list[tuple[int, tuple[tuple[bool, str], ...], int]]:
    """How the layers are stacked: [(first layer, unit, repeats)], in order.

    A layer's type is (sparse, mixer): whether its MLP is a mixture of experts, and its
    token mixer (``cfg.layer_mixers()``: "A" attention, "D" Gated DeltaNet), the two things
    that change its parameters. ``unit`` lists the types of one repeat; a group is one
    ``lax.scan`` over ``repeats`` copies of its unit, layer ``first + r * len(unit) + u``
    being position u of repeat r. Layers of one type form one group of unit length 1 (the
    dense model as always); a pattern with a period (decoder_sparse_step = 2: dense, MoE,
    dense, MoE, ...; Qwen3-Next's three DeltaNet layers then one attention layer) one group
    whose unit is the period; anything else one group per run of equal layers. (Attention
    kinds, local or global, do not split groups: a stack whose layers mix them switches per
    layer, ``Decoder._run_layers``.)
    """
    mixers = cfg.layer_mixers()
    kinds = tuple((is_moe_layer(cfg, i), mixers[i]) for i in range(cfg.n_layers))
    n = len(kinds)
    for p in range(1, n + 1):
        if n % p == 0 and kinds == kinds[:p] * (n // p):
            if p < n or p == 1:
                return [(0, kinds[:p], n // p)]
            break
    groups, start = [], 0
    for i in range(1, n + 1):
        if i == n or kinds[i] != kinds[start]:
            groups.append((start, (kinds[start],), i - start))
            start = i
    return groups


def stacked_layer_indices(cfg: ModelConfig, keys: tuple) -> tuple[list[int], tuple]:
    """Which layers a stacked parameter under ``layers`` holds, in stack order.

    Args:
      keys: its path below the model, starting with "layers" (as in ``nnx.to_pure_dict``).
    Returns:
      (layer indices, the path inside one Block).
    """
    groups = layer_groups(cfg)
    if len(groups) == 1 and len(groups[0][1]) == 1:
        return list(range(cfg.n_layers)), tuple(keys[1:])
    g, u = int(keys[1]), int(keys[2])
    first, unit, repeats = groups[g]
    return [first + r * len(unit) + u for r in range(repeats)], tuple(keys[3:])


def _block_class(family: str):
    """The decoder block of a model family (the family modules build on this one, so they
    are imported here, when a model is built)."""
    if family == "gemma":
        from .gemma import GemmaBlock
        return GemmaBlock
    if family == "qwen3_next":
        from .qwen3_next import Qwen3NextBlock
        return Qwen3NextBlock
    return Block


class Decoder(nnx.Module):
    """Decoder-only LM. ``model(tokens)`` -> fp32 logits [B, S, V].

    ``layout`` matters only on a mesh with a ring axis: "natural" (tokens in order; attention
    reorders internally) or "zigzag" (the batch is already in ``ring.zigzag_permutation``
    order, as the training data loader produces it, with true positions). ``head_chunks``:
    see ``ulysses_attention``.
    """

    def __init__(self, cfg: ModelConfig, *, mesh: Mesh, rngs: nnx.Rngs, layout: str = "natural",
                 head_chunks: int = 1, stream_layers: bool = False):
        self.cfg, self.mesh = cfg, mesh
        # The layer weights live in host memory (optimizer.offload): each layer's are moved
        # to the device inside the layer loop, so one layer's weights are on it at a time,
        # and their gradients go back to the host the same way (the transpose of the move).
        self.stream_layers = stream_layers
        self.embed = nnx.Param(nnx.initializers.normal(cfg.init_std)(
            rngs.params(), (cfg.vocab_size, cfg.d_model)))                          # [V, D]
        keys = jax.random.split(rngs.params(), cfg.n_layers)
        block_class = _block_class(cfg.family)

        def stack(layer_keys, kind):
            sparse, mixer = kind
            extra = {} if mixer == "A" else {"mixer": mixer}
            return nnx.vmap(lambda key: block_class(
                cfg, mesh, rngs=nnx.Rngs(key), layout=layout, head_chunks=head_chunks,
                sparse=sparse, **extra))(layer_keys)                                 # [R, ...]

        groups = layer_groups(cfg)
        if len(groups) == 1 and len(groups[0][1]) == 1:
            self.layers = stack(keys, groups[0][1][0])                               # [L, ...]
        else:  # layers/{group}/{position in unit}: [repeats, ...] each; layer i keeps keys[i]
            self.layers = nnx.List([nnx.List([
                stack(keys[first + u::len(unit)][:repeats], kind)
                for u, kind in enumerate(unit)]) for first, unit, repeats in groups])
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
        """Final-normed hidden states [B, S, D] in the compute dtype (``hidden_and_stats``
        without the router statistics)."""
        return self.hidden_and_stats(tokens, positions, segment_ids)[0]

    def hidden_and_stats(self, tokens, positions=None, segment_ids=None):
        """Final-normed hidden states [B, S, D] in the compute dtype, and router statistics.

        Args:
          tokens: [B, S] int32.
          positions: [B, S] ints (default 0..S-1 in every row).
          segment_ids: [B, S] ints for packed documents (0 = padding), or None.
        Returns:
          (hidden, stats): stats is None for a dense model, else ``moe.router_stats`` summed
          over all devices and MoE layers (the inputs of ``moe.aux_loss``).
        """
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        with jax.named_scope("embed"):
            if self.vocab_parallel:
                x = vocab.embed(self.embed[...], tokens, mesh=self.mesh, dtype=self.dtype,
                                chunk=self.cfg.loss_chunk)                          # [B, S, D]
            else:
                x = jnp.take(_gathered(self.embed[...], self.dtype, self.mesh), tokens, axis=0)
                x = shard(x, self.mesh, act_spec(self.mesh, 1))
            if self.cfg.family == "gemma":  # embeddings x sqrt(D), the factor in the compute dtype
                x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
        with jax.named_scope("layers"):
            x, stats = self._run_layers(x, positions, segment_ids)
        return self.final_norm(x), stats

    def _run_layers(self, x, positions, segment_ids):
        """All layer groups in order; returns (x, router stats summed over MoE layers).

        Per-layer attention kinds (``cfg.layer_kinds()``: L sliding window, G global): where
        all layers of a stack are of one kind it is a static argument, the program of a model
        without windows. Where they mix (Gemma 3's five local then one global, Qwen2's
        max_window_layers) the scan also walks an int [repeats] of kind indices, and each
        layer's attention chooses its branch by ``lax.switch``: both branches are compiled
        once (each with a static window, RoPE base and kernel: cuDNN's window length must be
        static, as must the ring's plan of steps), the parameters stay stacked as they are,
        and the residuals the two branches save share buffers where their types agree (JAX
        merges them), so memory stays that of one kind.
        """
        offload, stream = self.cfg.offload_checkpoints, self.stream_layers
        homogeneous = not isinstance(self.layers, nnx.List)
        groups = [[self.layers]] if homogeneous else self.layers
        kinds = self.cfg.layer_kinds()
        totals = None
        for (first, unit, repeats), units in zip(layer_groups(self.cfg), groups):
            graphdefs, states = zip(*(nnx.split(m) for m in units))
            # The kinds of unit position u over the repeats: one static letter, or an index
            # into LAYER_KINDS per repeat ([repeats] int32) when they mix.
            unit_kinds = [kinds[first + u::len(unit)][:repeats] for u in range(len(unit))]
            static = [k[0] if len(set(k)) == 1 else None for k in unit_kinds]
            ids = [None if st else jnp.asarray([LAYER_KINDS.index(c) for c in k], jnp.int32)
                   for st, k in zip(static, unit_kinds)]

            def apply(graphdef, kind):
                def fn(x, state, kind_id):
                    if stream:
                        state = jax.device_put(state, jax.memory.Space.Device)
                    if offload:  # the checkpoint the backward pass recomputes the layer from
                        x = checkpoint_name(x, _LAYER_INPUT)                         # [B, S, D]
                    return nnx.merge(graphdef, state)(x, positions, segment_ids,
                                                      kind if kind_id is None else kind_id)

                if self.cfg.remat == "none":
                    return fn
                policy = _REMAT_POLICIES["full_offload" if offload else self.cfg.remat]
                return jax.checkpoint(fn, policy=policy, prevent_cse=False)

            blocks = [apply(g, k) for g, k in zip(graphdefs, static)]

            def body(x, xs):
                found = []
                for block, state, kind_id in zip(blocks, *xs):
                    x, stats = block(x, state, kind_id)
                    found.append(stats)
                return x, found

            x, found = jax.lax.scan(body, x, (list(states), ids))
            for stats in found:  # [repeats, ...] each, or None for dense layers
                if stats is not None:
                    summed = {k: jnp.sum(stats[k], axis=0) for k in STAT_KEYS}
                    totals = summed if totals is None else jax.tree.map(jnp.add, totals, summed)
        return x, totals

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        h = self.hidden(tokens, positions, segment_ids)
        w = _gathered(self.head_weight(), self.dtype, self.mesh)
        logits = jnp.einsum("BSD,DV->BSV", h, w, preferred_element_type=jnp.float32)
        cap = self.cfg.final_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits

