"""Flax NNX decoder with Ulysses sequence-parallel attention: embedding, the layer stack, the
final norm and the head. Its blocks come from the block registry (``blocks.py``): the
Llama 3 / Mistral / Qwen block (llama.py), Gemma 2 / 3 (gemma.py), Qwen3-Next (qwen3_next.py),
each built from the shared parts in layers.py.

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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from ..config import LAYER_KINDS, ModelConfig
from ..mesh import act_spec, shard
from . import vocab
from ..families import family
from .blocks import block_class as _block_class
from .layers import gathered as _gathered, norm
from .moe import STAT_KEYS, is_moe_layer
from .multimodal import prepare
from .vision import VisionTower, merge_features

_LAYER_INPUT = "layer_input"


def _fused_attention_saveable(prim, *_, **__) -> bool:
    """cuDNN's fused attention forward (jax's ``dot_product_attention_fwd``): its output and
    softmax statistics, O(S) a row, are what its backward reads, so keeping them spares the
    backward pass a second attention forward, the dearest part of a long sequence's layer.
    No CPU program calls it."""
    return prim.name.startswith("dot_product_attention_fwd")


def _dots_and_fused_attention_saveable(prim, *args, **params) -> bool:
    return (jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)
            or _fused_attention_saveable(prim))


_REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute all of it
    # the weight matmuls' outputs and the fused attention's (no [S, S] scores either way)
    "save_dots": _dots_and_fused_attention_saveable,
    # recompute all but the fused attention: its forward runs once (GPU; on CPUs = full)
    "save_attention": _fused_attention_saveable,
    # Save the weight matmul outputs, but in host memory, copied back for the backward pass.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    # remat full with model.offload_checkpoints: the layer input, the one value the layer
    # loop keeps per layer for the backward pass, goes to host memory and comes back there.
    "full_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[_LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
}


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


def unit_kinds(cfg: ModelConfig, first: int, unit: tuple, repeats: int):
    """The attention kinds of a layer group (``layer_groups``), per position u of its unit
    over the repeats: (static, ids), each a list over u: a kind letter in ``static`` where
    every repeat has the same (its ids entry None), else None there and an int32 [repeats]
    of indices into LAYER_KINDS in ``ids`` (the layer loop switches on it)."""
    kinds = cfg.layer_kinds()
    per_u = [kinds[first + u::len(unit)][:repeats] for u in range(len(unit))]
    static = [k[0] if len(set(k)) == 1 else None for k in per_u]
    ids = [None if st else jnp.asarray([LAYER_KINDS.index(c) for c in k], jnp.int32)
           for st, k in zip(static, per_u)]
    return static, ids


class LayerStack(NamedTuple):
    """One layer group (``layer_groups``) as a layer loop walks it: a ``lax.scan`` over
    ``repeats`` copies of its unit, each position u of the unit a module split into
    ``graphdefs[u]`` and its stacked ``states[u]`` ([repeats, ...] per leaf)."""
    first: int
    repeats: int
    graphdefs: tuple
    states: list
    static: list  # per position: the one kind letter of its layers, or None where they mix
    ids: list     # per position: None, or int32 [repeats] indices into LAYER_KINDS
    kinds: list   # per position: the kind letters of its layers, in repeat order


def layer_stacks(cfg: ModelConfig, layers) -> list[LayerStack]:
    """The decoder's layer stacks in order, for any walk over them: the forward pass
    (``Decoder._run_layers``) and generation's prefill and decode
    (``generation.blocks.run_layers``). ``layers`` is ``Decoder.layers``: one stacked module
    when every layer has one type, else an ``nnx.List`` per group of an ``nnx.List`` per unit
    position."""
    groups = [[layers]] if not isinstance(layers, nnx.List) else layers
    all_kinds = cfg.layer_kinds()
    stacks = []
    for (first, unit, repeats), units in zip(layer_groups(cfg), groups):
        graphdefs, states = zip(*(nnx.split(m) for m in units))
        static, ids = unit_kinds(cfg, first, unit, repeats)
        kinds = [list(all_kinds[first + u::len(unit)][:repeats]) for u in range(len(unit))]
        stacks.append(LayerStack(first, repeats, graphdefs, list(states), static, ids, kinds))
    return stacks


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
        # Multimodal families (Qwen2.5-VL): the vision tower whose features replace the
        # placeholder tokens' embeddings (vision.py).
        self.visual = VisionTower(cfg, mesh, rngs=rngs) if family(cfg.family).vision else None

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

    def hidden(self, tokens, positions=None, segment_ids=None, vision=None) -> jax.Array:
        """Final-normed hidden states [B, S, D] in the compute dtype (``hidden_and_stats``
        without the router statistics)."""
        return self.hidden_and_stats(tokens, positions, segment_ids, vision)[0]

    def hidden_and_stats(self, tokens, positions=None, segment_ids=None, vision=None):
        """Final-normed hidden states [B, S, D] in the compute dtype, and router statistics.

        Args:
          tokens: [B, S] int32.
          positions: [B, S] ints (default 0..S-1 in every row); [B, S, 3] M-RoPE positions
            for a multimodal family (``multimodal.rope_index``).
          segment_ids: [B, S] ints for packed documents (0 = padding), or None.
          vision: a multimodal family's images and videos (``multimodal.prepare``), or None.
        Returns:
          (hidden, stats): stats is None for a dense model, else ``moe.router_stats`` summed
          over all devices and MoE layers (the inputs of ``moe.aux_loss``).
        """
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self.embed_tokens(tokens)                                               # [B, S, D]
        if vision is not None:
            self._need_tower()
            with jax.named_scope("vision"):
                x = merge_features(x, self.visual(vision), vision["feature_index"], self.mesh)
        with jax.named_scope("layers"):
            x, stats = self._run_layers(x, positions, segment_ids)
        # The final norm's weight replicated at its point of use (gathered under ZeRO-3).
        norm_def, norm_state = nnx.split(self.final_norm)
        norm_state = jax.tree.map(lambda w: _gathered(w, w.dtype, self.mesh), norm_state)
        return nnx.merge(norm_def, norm_state)(x), stats

    def embed_tokens(self, tokens, split: bool = True) -> jax.Array:
        """Embeddings [B, S, D] of tokens [B, S] in the compute dtype (x sqrt(D) where the
        family scales them). ``split``: the tokens are split over the sequence devices as
        activations are (the vocabulary-parallel lookup where the model uses it); False for
        tokens every device holds whole (a decode step's one token per row)."""
        with jax.named_scope("embed"):
            if split and self.vocab_parallel:
                x = vocab.embed(self.embed[...], tokens, mesh=self.mesh, dtype=self.dtype,
                                chunk=self.cfg.loss_chunk)
            else:
                x = jnp.take(_gathered(self.embed[...], self.dtype, self.mesh), tokens, axis=0)
                if split:
                    x = shard(x, self.mesh, act_spec(self.mesh, 1))
            if family(self.cfg.family).embed_scale:  # x sqrt(D), the factor in the compute dtype
                x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
        return x

    def logits(self, h) -> jax.Array:
        """fp32 logits [..., V] of final-normed hidden states h [..., D] (the final softcap
        applied)."""
        w = _gathered(self.head_weight(), self.dtype, self.mesh)
        logits = jnp.einsum("...D,DV->...V", h, w, preferred_element_type=jnp.float32)
        cap = self.cfg.final_softcap
        return cap * jnp.tanh(logits / cap) if cap else logits

    def _need_tower(self) -> None:
        if self.visual is None:
            raise ValueError(f"model.family={self.cfg.family} has no vision tower; images and "
                             f"videos need a multimodal family (qwen2_5_vl)")

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
        totals = None
        for stack in layer_stacks(self.cfg, self.layers):
            def apply(graphdef, kind):
                def fn(x, state, kind_id):
                    if stream:
                        state = jax.device_put(state, jax.memory.Space.Device)
                    if offload:  # the checkpoint the backward pass recomputes the layer from
                        x = checkpoint_name(x, _LAYER_INPUT)                         # [B, S, D]
                    return nnx.merge(graphdef, state)(x, positions, segment_ids,
                                                      kind if kind_id is None else kind_id)

                if self.cfg.remat_policy != "none":
                    policy = _REMAT_POLICIES["full_offload" if offload
                                             else self.cfg.remat_policy]
                    fn = jax.checkpoint(fn, policy=policy, prevent_cse=False)
                return fn

            blocks = [apply(g, k) for g, k in zip(stack.graphdefs, stack.static)]

            def body(x, xs):
                found = []
                for block, state, kind_id in zip(blocks, *xs):
                    x, stats = block(x, state, kind_id)
                    found.append(stats)
                return x, found

            x, found = jax.lax.scan(body, x, (stack.states, stack.ids))
            for stats in found:  # [repeats, ...] each, or None for dense layers
                if stats is not None:
                    summed = {k: jnp.sum(stats[k], axis=0) for k in STAT_KEYS}
                    totals = summed if totals is None else jax.tree.map(jnp.add, totals, summed)
        return x, totals

    def __call__(self, tokens, positions=None, segment_ids=None, vision=None,
                 **images) -> jax.Array:
        """fp32 logits [B, S, V]. A multimodal family also takes transformers' image inputs
        as keywords (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
        ``video_grid_thw``, ``second_per_grid_ts``), turned into M-RoPE positions and
        ``vision`` on the host (``multimodal.prepare``: the tokens must be concrete, not
        traced; under jit pass ``positions`` and ``vision`` instead)."""
        if images:
            if isinstance(tokens, jax.core.Tracer):
                raise ValueError("image inputs are prepared on the host from the tokens; under "
                                 "jit pass positions and vision from multimodal.prepare")
            self._need_tower()
            positions, vision = prepare(np.asarray(tokens), self.cfg, segment_ids=(
                None if segment_ids is None else np.asarray(segment_ids)),
                shards=self.visual.shards(), **images)
        return self.logits(self.hidden(tokens, positions, segment_ids, vision))

