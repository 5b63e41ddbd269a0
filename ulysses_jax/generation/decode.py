"""Decode: one new token per row through every layer, its K and V written into the cache at
one slot, attention over the cache (the prompt's part and the new tokens') on each device's
own heads, and the next token chosen.

The new token's activations are [B, 1, D] on every device of the ``seq`` axis (the rows
split over ``data``); each device projects and attends with its block of heads against its
block of the cache, and only the attention output (a [B, 1, D] all-reduce after the output
projection) crosses devices: the cache never moves. One compiled program per (batch, cache
slots), reused for every token.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..mesh import act_spec, shard
from .blocks import block_functions, run_layers
from .cache import CacheLayout
from .sampling import Sampling, choose


def decode_program(graphdef, layout: CacheLayout, mesh: Mesh, sampling: Sampling,
                   cache_shardings=None):
    """Jitted ``(params, prompt, caches, tokens [B], slot, pad [B], deltas [B], rows [B],
    step, seed) -> (next tokens [B], logits [B, V], caches)``: ``prompt`` the prompts' part
    of the cache as the prefill made it (``layout``: [Bp, S], Bp dividing B), read only;
    ``caches`` the rows' own (``cache.sample_caches``), donated, and returned laid out as
    ``cache_shardings`` (the prefill's: the next step's input).

    ``slot``: the cache slot of ``tokens``, whose position in row b is slot - pad[b] +
    deltas[b] (``deltas``: 0, or where a multimodal prompt's M-RoPE positions ran ahead of
    its token count, the difference, as transformers' ``rope_deltas``: the text after an
    image counts on from its largest position; all three M-RoPE components of a new token
    are that one position, which rotates as plain RoPE does);
    ``rows``: each row's index in the request, ``step`` the token's index in its answer and
    ``seed`` (uint32) the request's seed (the sampling key, ``sampling.row_keys``)."""

    replicated = NamedSharding(mesh, P())

    def run(params, prompt, caches, tokens, slot, pad, deltas, rows, step, seed):
        model = nnx.merge(graphdef, params)
        _, decode_block = block_functions(model.cfg)
        x = model.embed_tokens(tokens[:, None], split=False)                      # [B, 1, D]
        x = shard(x, mesh, P(act_spec(mesh)[0], None, None))  # rows over data replicas
        positions = (slot - pad + deltas)[:, None]                                # [B, 1]

        def layer(block, x, kind, cache, part):
            return decode_block(block, x, positions, kind, cache, part, slot, pad, layout,
                                mesh)

        x, caches = run_layers(model, x, layer, caches, prompt=prompt)
        if cache_shardings is not None:
            caches = jax.lax.with_sharding_constraint(caches, cache_shardings)
        out = model.logits(model.final_norm(x[:, 0]))                             # [B, V]
        tok = choose(out, sampling, seed, rows, step)
        # Replicated, whatever layout the head's propagation reaches (an MoE model's can be
        # split): the next decode step was compiled for replicated tokens.
        tok, out = (jax.lax.with_sharding_constraint(a, replicated) for a in (tok, out))
        return tok, out, caches

    return jax.jit(run, donate_argnums=2)

