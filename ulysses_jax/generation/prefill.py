"""Prefill: one forward pass over the prompts, split over the devices by sequence as training
splits it (Ulysses attention), that fills the KV cache and gives the logits of each row's
last prompt token.

The prompts come left-padded to a common length S that the ``seq`` axis divides (padding:
segment id 0, never attended by a real token), with their true positions; each layer's K and
V leave the sequence split for the cache's head split (``cache.to_cache``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..models.vision import merge_features
from .blocks import block_functions, run_layers
from .cache import CacheLayout, empty_pools
from .sampling import Sampling, choose


def prefill_program(graphdef, layout: CacheLayout, mesh: Mesh, sampling: Sampling):
    """Jitted ``(params, tokens, positions, segment_ids, rows, seed, vision) -> (first new
    tokens [B], their logits [B, V], caches)``.

    tokens, segment_ids: [B, S] int32, S a multiple of the ``seq`` axis; positions [B, S]
    (or a multimodal model's M-RoPE [B, S, 3]); rows and seed as in ``decode.decode_program``
    (the first token is step 0); vision: the prompts' images and videos
    (``multimodal.prepare``) whose features replace their placeholders' embeddings, or
    None."""

    replicated = NamedSharding(mesh, P())

    def run(params, tokens, positions, segment_ids, rows, seed, vision):
        model = nnx.merge(graphdef, params)
        prefill_block, _ = block_functions(model.cfg)
        x = model.embed_tokens(tokens)                                            # [B, S, D]
        if vision is not None:
            x = merge_features(x, model.visual(vision), vision["feature_index"], mesh)

        def layer(block, x, kind, cache):
            return prefill_block(block, x, positions, segment_ids, kind, layout, mesh, cache)

        x, caches = run_layers(model, x, layer,
                               empty=lambda kinds: empty_pools(layout, mesh, kinds))
        out = model.logits(model.final_norm(x[:, -1]))                            # [B, V]
        tok = choose(out, sampling, seed, rows, jnp.int32(0))
        # Replicated, whatever layout the head's propagation reaches (an MoE model's can be
        # split): the next decode step was compiled for replicated tokens.
        tok, out = (jax.lax.with_sharding_constraint(a, replicated) for a in (tok, out))
        return tok, out, caches

    return jax.jit(run)
