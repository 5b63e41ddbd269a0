"""Prefill: one forward pass over the prompts, split over the devices by sequence as training
splits it (Ulysses attention), that fills the KV cache and gives the logits of each row's
last prompt token.

The prompts come left-padded to a common length S that the ``seq`` axis divides (padding:
segment id 0, never attended by a real token), with their true positions; each layer's K and
V leave the sequence split for the cache's head split (``cache.to_cache``). Each prompt is
prefilled once however many samples it has: its cache is the prompt's part all its samples
read (``cache.sample_caches``), and its last logits give each sample's first token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..models.vision import merge_features
from .blocks import block_functions, run_layers
from .cache import CacheLayout, empty_pools, sample_caches
from .sampling import Sampling, choose


def prefill_program(graphdef, layout: CacheLayout, new: CacheLayout, mesh: Mesh,
                    sampling: Sampling, samples: int = 1):
    """Jitted ``(params, tokens, positions, segment_ids, rows, seed, vision) -> (first new
    tokens [Bp G], their logits [Bp G, V], the prompts' caches, the samples' caches)``:
    ``layout`` the prompts' part of the cache ([Bp, S]), ``new`` the new tokens' ([Bp G, T]),
    G = ``samples`` per prompt (prompt i's at rows iG .. iG + G - 1).

    tokens, segment_ids: [Bp, S] int32, S a multiple of the ``seq`` axis; positions [Bp, S]
    (or a multimodal model's M-RoPE [Bp, S, 3]); rows [Bp G] and seed as in
    ``decode.decode_program`` (the first token is step 0); vision: the prompts' images and
    videos (``multimodal.prepare``) whose features replace their placeholders' embeddings,
    or None."""

    replicated = NamedSharding(mesh, P())

    def run(params, tokens, positions, segment_ids, rows, seed, vision):
        model = nnx.merge(graphdef, params)
        prefill_block, _ = block_functions(model.cfg)
        x = model.embed_tokens(tokens)                                            # [B, S, D]
        if vision is not None:
            x = merge_features(x, model.visual(vision), vision["feature_index"], mesh)

        def layer(block, x, kind, cache, _):
            return prefill_block(block, x, positions, segment_ids, kind, layout, mesh, cache)

        x, caches = run_layers(model, x, layer,
                               empty=lambda kinds: empty_pools(layout, mesh, kinds))
        out = model.logits(model.final_norm(x[:, -1]))                           # [Bp, V]
        out = jnp.repeat(out, samples, axis=0)                                 # [Bp G, V]
        tok = choose(out, sampling, seed, rows, jnp.int32(0))
        # Replicated, whatever layout the head's propagation reaches (an MoE model's can be
        # split): the next decode step was compiled for replicated tokens.
        tok, out = (jax.lax.with_sharding_constraint(a, replicated) for a in (tok, out))
        return (tok, out, *sample_caches(model.cfg, caches, new, mesh, samples))

    return jax.jit(run)
