"""The decoder's blocks run for generation: over a prompt (the layer as in training, keeping
its K and V) and over one new token per row (reading and extending the cache).

Families: the Llama block (dense or mixture of experts; Qwen2.5-VL's text decoder, whose
images enter in the prefill's embeddings) and the Gemma block share the
attention part and differ in what follows it (``_llama_rest``, ``_gemma_rest``). The new
tokens of a decode step reach their experts as one row of B tokens, padded to a multiple of
the devices (``_moe_tokens``), by the expert-parallel dispatch training uses. Qwen3-Next's
block mixes tokens with gated attention (the same cache, its output gate) or Gated DeltaNet,
whose cache is the recurrent state per value head (split over ``seq`` by head like K and V)
and the convolution's last W - 1 inputs: a decode step convolves over them and advances the
state by one token of the delta rule (``deltanet.delta_step``), O(1) in the prompt length.

Both walk the model's layer stacks as ``Decoder._run_layers`` does (one ``lax.scan`` per
position of a group's unit, the caches scanned beside the weights, or carried as one pool
per attention kind where a stack mixes local and global layers) and call a family's two
functions (``block_functions``) per layer, built from the block's own parts, so the weights,
LoRA adapters and variants (biases, q/k norms, RoPE scalings, windows) are the ones training
uses.
Letters as in models/decoder.py; C cache slots, T = 1 new token.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..attention.deltanet import DEFAULT_CHUNK, conv_step, delta_step, normalized_qk
from ..attention.heads import pad_kv, pad_query, unpad_output
from ..config import LAYER_KINDS
from ..families import FAMILIES, load
from ..attention.linear import gated_deltanet, gates
from ..mesh import DATA, SEQ, act_spec, axis_size, shard
from ..models.decoder import layer_stacks
from ..models.layers import by_kind, out_projection
from .cache import CacheLayout, pool_index, to_cache


class GenerationError(ValueError):
    """A model or request generation cannot serve (the message names the rule)."""


def cached_attention(q, parts, *, scale: float | None, softcap: float | None):
    """Attention of new queries over cache slots, on whatever heads each device holds: one
    softmax over the slots of every part.

    Args:
      q: [B, T, N', H]; parts: (k, v, valid) each, k and v [B', C, K', H] with B' dividing
        B (a prompt's part: one row per prompt, its B / B' samples' queries at consecutive
        rows) and N' a multiple of K' (grouped as the exchange groups them); valid
        [B, T, C] bool, the slots each query sees.
    Returns:
      [B, T, N', H] in q's dtype (fp32 logits and softmax).
    """
    b, t, n, h = q.shape
    kh = parts[0][0].shape[2]
    scale = h ** -0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
    logits = []
    for k, _, valid in parts:
        rows, c = k.shape[:2]
        x = jnp.einsum("RSTKGH,RCKH->RSKGTC", qg.reshape(rows, b // rows, *qg.shape[1:]),
                       k.astype(jnp.float32)).reshape(b, kh, n // kh, t, c) * scale
        if softcap is not None:
            x = softcap * jnp.tanh(x / softcap)
        logits.append(jnp.where(valid[:, None, None], x, -jnp.inf))
    probs = jax.nn.softmax(jnp.concatenate(logits, axis=-1), axis=-1)
    out, at = 0.0, 0
    for k, v, _ in parts:
        rows, c = k.shape[:2]
        p = probs[..., at:at + c].reshape(rows, b // rows, kh, n // kh, t, c)
        out = out + jnp.einsum("RSKGTC,RCKH->RSTKGH", p, v.astype(jnp.float32)).reshape(
            b, t, kh, n // kh, h)
        at += c
    return out.reshape(b, t, n, h).astype(q.dtype)


def visible(last, pad, ring: int, window: int | None, slot=None):
    """[B, 1, W] bool: the entries of a W-entry cache ring (``cache``) written up to slot
    ``last`` that the token at ``slot`` (default ``last``) sees in each row (``pad`` [B]
    left padding): entry r holds the latest slot j = last - ((last - r) mod W) written there,
    seen when j is in the row's prompt or answer (j >= pad) and, with a ``window``, among the
    token's last ``window`` slots."""
    slot = last if slot is None else slot
    j = last - jnp.mod(last - jnp.arange(ring), ring)[None, :]
    seen = j >= pad[:, None]
    if window:
        seen &= slot - j < window
    return seen[:, None, :]


def _parts(prompt, new, slot, pad, layout: CacheLayout, window: int | None) -> list:
    """The two parts ``cached_attention`` reads for the token at ``slot``: the prompt's
    (k, v) [Bp, Wp, K', H], written up to slot S - 1 (S = ``layout.slots``), and the new
    tokens' [B, Wn, K', H], entries in step order (the token's step t = slot - S included)."""
    s = layout.slots
    return [(*prompt, visible(s - 1, pad, prompt[0].shape[1], window, slot)),
            (*new, visible(slot - s, jnp.zeros_like(pad), new[0].shape[1], window))]


def _put(cache, kind: str, kv):
    """``cache`` with the layer's (k, v) replaced: ``kv`` itself, or written at its entry of
    its kind's pool."""
    if isinstance(cache, dict):
        return {**cache, kind: tuple(jax.lax.dynamic_update_index_in_dim(a, x, cache["at"], 0)
                                     for a, x in zip(cache[kind], kv))}
    return kv


# ------------------------------------------------------------------------- attention blocks

def _attend_prompt(block, x, positions, segment_ids, kind, layout: CacheLayout, mesh: Mesh,
                   cache=None):
    """The block's attention over the prompt as training runs it: (the projected output
    [B, S, D], the prompt's (k, v) as the layer's cache ring, or ``cache`` (a mixed stack's
    pools) with them written)."""
    attn = block.attn
    q, k, v, adapt = attn.project(block.attn_norm(x))

    def attend(kind, q, k, v, cache):
        q, k = attn.rope(kind, q, k, positions)
        o = attn.attend(kind, q, k, v, segment_ids)
        return o, _put(cache, kind, to_cache(k, v, layout, mesh, kind))

    o, cache = by_kind(attend, kind, q, k, v, cache)
    return out_projection(o, attn.wo[...], adapt, x.dtype, mesh), cache


def _attend_cached(block, x, positions, kind, cache, prompt, slot, pad, layout: CacheLayout,
                   mesh: Mesh):
    """The block's attention for one new token per row over the prompt's part of the cache
    (``prompt``) and the new tokens' (``cache``): (the projected output [B, 1, D], the new
    tokens' part with this token's k and v written)."""
    attn, cfg = block.attn, block.attn.cfg
    q, k, v, adapt = attn.project(block.attn_norm(x))                      # [B, 1, ., H]
    if isinstance(cache, dict):
        o, cache = _attend_pools(attn, q, k, v, positions, kind, cache, prompt, slot, pad,
                                 layout, mesh)
        return out_projection(o, attn.wo[...], adapt, x.dtype, mesh), cache

    def attend(kind, q, k, v, cache):
        q, k = attn.rope(kind, q, k, positions)
        window = cfg.sliding_window if kind == "L" else None
        return _cached_heads(cfg, q, k, v, cache, prompt, slot, pad, layout, mesh, window)

    o, cache = by_kind(attend, kind, q, k, v, cache)
    return out_projection(o, attn.wo[...], adapt, x.dtype, mesh), cache


def _attend_pools(attn, q, k, v, positions, kind, cache, prompt, slot, pad,
                  layout: CacheLayout, mesh: Mesh):
    """``_attend_cached`` for a layer of a stack mixing kinds (``kind`` a traced index,
    ``cache`` the stack's new-token pools and the layer's entry "at", ``prompt`` the stack's
    prompt pools): the new token's k and v are
    written into every pool before the kind switch, into the layer's own entry of its kind's
    pool and, in the other pools, over the value already there (a token-sized read and
    write), so the switch only reads the pools; a switch that wrote them would return pools
    XLA copies. Returns (attention output [B, 1, N, H], the pools)."""
    cfg, at = attn.cfg, cache["at"]
    heads = NamedSharding(mesh, layout.spec(mesh))
    pools = {c: pair for c, pair in cache.items() if c != "at"}
    for c, pair in pools.items():
        mine = kind == LAYER_KINDS.index(c)
        _, kc = attn.rope(c, q, k, positions)
        new = [jax.lax.with_sharding_constraint(a.astype(pair[0].dtype), heads)
               for a in pad_kv(kc, v, layout.heads)]                       # [B, 1, K'R, H]
        start = (jnp.where(mine, at, 0), 0, jnp.mod(slot - layout.slots, pair[0].shape[2]),
                 0, 0)

        def put(pool, token, start=start, mine=mine):
            old = jax.lax.dynamic_slice(pool, start, (1,) + token.shape)
            return jax.lax.dynamic_update_slice(pool, jnp.where(mine, token[None], old), start)

        pools[c] = tuple(put(pool, token) for pool, token in zip(pair, new))

    def attend(c, q, pools):
        q, _ = attn.rope(c, q, k, positions)
        layer_kv = [tuple(jax.lax.dynamic_index_in_dim(a, at, keepdims=False) for a in part[c])
                    for part in (prompt, pools)]
        q = jax.lax.with_sharding_constraint(pad_query(q, layout.heads), heads)
        window = cfg.sliding_window if c == "L" else None
        o = cached_attention(q, _parts(*layer_kv, slot, pad, layout, window),
                             scale=cfg.attn_scale or None, softcap=cfg.attn_softcap or None)
        return unpad_output(o, layout.heads)

    return by_kind(attend, kind, q, pools), pools


def _cached_heads(cfg, q, k, v, cache, prompt, slot, pad, layout: CacheLayout, mesh: Mesh,
                  window: int | None):
    """Rotated q [B, 1, N, H], k, v [B, 1, K, H] of the new tokens: (attention over the
    prompt's ring and the new tokens' [B, 1, N, H], the new tokens' ring (k, v) with them
    written at entry t mod W), each device on its own heads."""
    ck, cv = cache
    heads = NamedSharding(mesh, layout.spec(mesh))
    k, v = (jax.lax.with_sharding_constraint(a.astype(ck.dtype), heads)
            for a in pad_kv(k, v, layout.heads))
    at = jnp.mod(slot - layout.slots, ck.shape[1])
    ck = jax.lax.dynamic_update_slice_in_dim(ck, k, at, axis=1)
    cv = jax.lax.dynamic_update_slice_in_dim(cv, v, at, axis=1)
    q = jax.lax.with_sharding_constraint(pad_query(q, layout.heads), heads)
    o = cached_attention(q, _parts(prompt, (ck, cv), slot, pad, layout, window),
                         scale=cfg.attn_scale or None, softcap=cfg.attn_softcap or None)
    return unpad_output(o, layout.heads), (ck, cv)


def _moe_tokens(moe, x, mesh: Mesh):
    """The experts on the [B, 1, D] new tokens: laid out as one row per data replica of its
    B/D tokens, padded to a multiple of the sequence devices (the padding marked invalid),
    as training splits rows."""
    from ..models import vocab
    b, _, d = x.shape
    reps = axis_size(mesh, DATA)
    m = b // reps
    n = -(-m // vocab.shards(mesh)) * vocab.shards(mesh)
    rows = jnp.pad(x.reshape(reps, m, d), ((0, 0), (0, n - m), (0, 0)))
    valid = jnp.broadcast_to((jnp.arange(n) < m).astype(jnp.float32), (reps, n))
    y, _ = moe(rows, valid)
    return y[:, :m].reshape(b, 1, d)


def _llama_rest(block, x, o, segment_ids, mesh: Mesh):
    """Llama: x + o, then + the MLP (dense, or the experts) of its norm."""
    x = x + o
    if block.moe is None:
        return x + block.mlp(x, block.mlp_norm)
    if segment_ids is None:  # a new token per row
        return x + _moe_tokens(block.moe, block.mlp_norm(x), mesh)
    y, _ = block.moe(block.mlp_norm(x), (segment_ids > 0).astype(jnp.float32))
    return x + y


def _gemma_rest(block, x, o, segment_ids, mesh: Mesh):
    """Gemma 2 / 3: x + post_norm(o), then + post_norm(mlp(norm(x)))."""
    x = x + block.attn_post_norm(o)
    return x + block.mlp(x, block.mlp_norm, block.mlp_post_norm)


# ----------------------------------------------------------------------------- Qwen3-Next

def _next_prompt(block, x, positions, segment_ids, kind, layout: CacheLayout, mesh: Mesh,
                 cache=None):
    """Qwen3-Next's token mixer over the prompt: gated attention (its cache (k, v)) or Gated
    DeltaNet (its cache (state, the convolution's last q, k, v inputs))."""
    normed = block.attn_norm(x)
    if block.attn is None:
        return _deltanet_prompt(block.linear_attn, normed, segment_ids, mesh)
    attn = block.attn
    q, gate, k, v, adapt = attn.project(normed)
    q, k = attn.rope(q, k, positions)
    o = attn.gated_output(attn.attend(q, k, v, segment_ids), gate, adapt, x.dtype)
    return o, to_cache(k, v, layout, mesh)


def _next_cached(block, x, positions, kind, cache, prompt, slot, pad, layout: CacheLayout,
                 mesh: Mesh):
    """Qwen3-Next's token mixer for one new token per row, reading and updating its cache."""
    normed = block.attn_norm(x)
    if block.attn is None:
        return _deltanet_cached(block.linear_attn, normed, cache, mesh)
    attn = block.attn
    q, gate, k, v, adapt = attn.project(normed)                            # [B, 1, ., H]
    q, k = attn.rope(q, k, positions)
    o, kv = _cached_heads(attn.cfg, q, k, v, cache, prompt, slot, pad, layout, mesh, None)
    return attn.gated_output(o, gate, adapt, x.dtype), kv


def _rows_heads(mesh: Mesh) -> P:
    """[B, heads, ...]: rows over ``data`` (as the activations' rows), heads over ``seq``."""
    return P(act_spec(mesh)[0], SEQ)


def _rows(mesh: Mesh) -> NamedSharding:
    """[B, ...]: rows over ``data``, the rest on every device."""
    return NamedSharding(mesh, P(act_spec(mesh)[0]))


def _deltanet_prompt(mixer, x, segment_ids, mesh: Mesh):
    """Gated DeltaNet over the prompts as training runs it, keeping for each row the state
    after its last token [B, Hv, Q, V] (split by value head over ``seq``) and the last W - 1
    inputs of its convolution (q, k [B, W-1, Hk, Q], v [B, W-1, Hv, V]; zeros before the
    prompt). Returns (the output [B, S, D], that cache)."""
    s = x.shape[1]
    q, k, v, z, b, a, adapters = mixer.project(x)
    # The final state is the last chunk's: a chunk that S divides (S is a multiple of 16).
    chunk = next(c for c in (DEFAULT_CHUNK, 32, 16, 8, 4, 2, 1) if s % c == 0)
    o, state = gated_deltanet(q, k, v, b, a, *mixer.kernel_weights(), mesh=mesh,
                              segment_ids=segment_ids, chunk=chunk, final_state=True)
    w = mixer.cfg.linear_conv - 1
    rows = _rows(mesh)

    def last(t):  # [B, W-1, ...]: the last W - 1 tokens (zeros before a shorter row)
        t = jnp.pad(t, [(0, 0), (max(w - s, 0), 0)] + [(0, 0)] * (t.ndim - 2))
        return t[:, t.shape[1] - w:]

    seen = last(segment_ids) > 0                                           # [B, W-1]

    def tail(t):  # the convolution's inputs there, zeros at the padding before the prompt
        t = jnp.where(seen.reshape(seen.shape + (1,) * (t.ndim - 2)), last(t), 0)
        return jax.lax.with_sharding_constraint(t, rows)

    return mixer.output(o, z, adapters, x.dtype), (state, tail(q), tail(k), tail(v))


def _deltanet_cached(mixer, x, cache, mesh: Mesh):
    """Gated DeltaNet at one new token per row: its convolution over the kept inputs and
    itself, one step of the delta rule on each device's value heads. Returns (the output
    [B, 1, D], the cache advanced by the token)."""
    state, *kept = cache
    cfg = mixer.cfg
    q, k, v, z, b, a, adapters = mixer.project(x)                         # q: [B, 1, Hk, Q]
    conv_q, conv_k, conv_v, a_log, dt_bias = mixer.kernel_weights()
    windows = [jnp.concatenate([c, t], axis=1) for c, t in zip(kept, (q, k, v))]
    q, k, v = (conv_step(win, w) for win, w in zip(windows, (conv_q, conv_k, conv_v)))
    q, k = normalized_qk(q, k)                                             # [B, Hk, Q] fp32
    r = cfg.linear_value_heads // cfg.linear_key_heads
    heads = NamedSharding(mesh, _rows_heads(mesh))
    q, k, v = (jax.lax.with_sharding_constraint(t, heads)
               for t in (jnp.repeat(q, r, axis=1), jnp.repeat(k, r, axis=1), v))
    beta, g = gates(b[:, 0], a[:, 0], a_log, dt_bias)                      # [B, Hv]
    state, o = delta_step(state, q, k, v, g, beta)                         # o: [B, Hv, V]
    y = mixer.output(o.astype(v.dtype)[:, None], z, adapters, x.dtype)
    rows = _rows(mesh)
    return y, (jax.lax.with_sharding_constraint(state, heads),
               *(jax.lax.with_sharding_constraint(w[:, 1:], rows) for w in windows))


# --------------------------------------------------------------------------------- layers

def _prefill(mix, rest):
    def layer(block, x, positions, segment_ids, kind, layout, mesh, cache=None):
        o, cache = mix(block, x, positions, segment_ids, kind, layout, mesh, cache)
        x = rest(block, x, o, segment_ids, mesh)
        return shard(x, mesh, act_spec(mesh, 1)), cache
    return layer


def _decode(mix, rest):
    def layer(block, x, positions, kind, cache, prompt, slot, pad, layout, mesh):
        o, cache = mix(block, x, positions, kind, cache, prompt, slot, pad, layout, mesh)
        return rest(block, x, o, None, mesh), cache
    return layer


# (prefill, decode) layer functions of the blocks, as the family records name them
# (``families.Family.generation``).
LLAMA = (_prefill(_attend_prompt, _llama_rest), _decode(_attend_cached, _llama_rest))
GEMMA = (_prefill(_attend_prompt, _gemma_rest), _decode(_attend_cached, _gemma_rest))
QWEN3_NEXT = (_prefill(_next_prompt, _llama_rest), _decode(_next_cached, _llama_rest))


def block_functions(cfg):
    """The family's (prefill, decode), or GenerationError naming what is missing."""
    built = sorted(name for name, f in FAMILIES.items() if f.generation is not None)
    if cfg.family not in built:
        raise GenerationError(f"generation is built for the model families "
                              f"{built}; model.family={cfg.family} is not yet")
    return load(FAMILIES[cfg.family].generation)


def run_layers(model, x, layer_fn, caches=None, empty=None, prompt=None):
    """Every layer stack of ``model`` in order: ``layer_fn(block, x, kind, cache, prompt)``
    -> (x, cache) per layer.

    A position of a group's unit whose layers all have one kind gets its own cache: in
    prefill None (the layers make theirs, stacked by the scan, [R, ...] per leaf); in decode
    its entry of those stacks, which the scan carries and each layer's step writes back at
    its index (not a scanned input: XLA would give the scan's stacked output buffers of its
    own, about 1.4 caches of temporary memory on the CPU compiler, where the carried stacks
    are updated in place). One whose layers mix kinds (local and global, ``unit_kinds``)
    keeps the pools of ``cache.empty_pools`` in the carry, and each layer gets {kind: pool,
    "at": its entry} (``_put``, ``_attend_pools``).

    Args:
      caches: None (prefill: made by the layers), or what a previous call returned.
      empty: ``kinds -> pools`` (prefill: the zero pools of a mixed position).
      prompt: decode: the prompts' read-only caches per (group, unit position) (None at a
        DeltaNet position), each layer given its entry (a mixed position: its pools, the
        layer's entry being its cache's "at").
    Returns:
      (x, caches): caches a list per (group, unit position).
    """
    out, at = [], 0
    for stack in layer_stacks(model.cfg, model.layers):
        n, static, graphdefs = len(stack.graphdefs), stack.static, stack.graphdefs
        mixed = [static[u] is None for u in range(n)]
        mine = [None] * n if caches is None else list(caches[at:at + n])
        carried = [mine[u] if caches is not None else empty(stack.kinds[u]) if mixed[u]
                   else None for u in range(n)]
        entries = [jnp.asarray(pool_index(stack.kinds[u]) if mixed[u]
                               else np.arange(stack.repeats)) for u in range(n)]
        read = [None] * n if prompt is None else prompt[at:at + n]

        def body(carry, xs, graphdefs=graphdefs, static=static, mixed=mixed, read=read):
            x, carried = carry
            states, ids, entries = xs
            kept, made = [], []
            for u, (g, state) in enumerate(zip(graphdefs, states)):
                kind, pool, at = static[u] if static[u] else ids[u], carried[u], entries[u]
                # decode: this layer's entry of the carried stacks and of the prompts'
                entry = lambda tree, at=at: None if tree is None else jax.tree.map(  # noqa: E731
                    lambda a: jax.lax.dynamic_index_in_dim(a, at, keepdims=False), tree)
                cache = {**pool, "at": at} if mixed[u] else entry(pool)
                part = read[u] if mixed[u] else entry(read[u])
                x, c = layer_fn(nnx.merge(g, state), x, kind, cache, part)
                if mixed[u]:
                    kept.append({k: c[k] for k in pool})
                    made.append(None)
                elif pool is not None:
                    kept.append(jax.tree.map(
                        lambda a, b, at=at: jax.lax.dynamic_update_index_in_dim(a, b, at, 0),
                        pool, c))
                    made.append(None)
                else:
                    kept.append(None)
                    made.append(c)
            return (x, kept), made

        (x, carried), made = jax.lax.scan(body, (x, carried),
                                          (stack.states, stack.ids, entries))
        out.extend(carried[u] if carried[u] is not None else made[u] for u in range(n))
        at += n
    return x, out
