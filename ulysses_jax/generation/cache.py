"""The KV cache: per attention layer, K and V of every position, split over the devices by
head as Ulysses attention splits them.

Layout. Inside Ulysses attention each of the P devices of the ``seq`` axis holds the whole
sequence for its block of heads (``head_layout``: N' query heads, K'R kv head copies, padded
and copied as the exchange pads and copies them). The cache keeps that layout: per layer
``k`` and ``v`` [B, C, K'R, H] for C slots, split over ``seq`` on the head axis (and over
``data`` on the rows, each data replica generating its share of them), so each device holds
1/P of its replica's rows and a decode step reads only its own heads. Layers stacked in the
model (``decoder.layer_groups``) stay stacked here: one [R, B, C, K'R, H] pair per position
of a group's unit, made by the prefill's layer scan and carried through the decode step's,
each layer's entry updated in place (``blocks.run_layers``).

Two parts. A layer's cache is the prompt's part, written by the prefill and only read after
it, and the new tokens' part, written one slot per decode step. A prompt sampled G times
(``Generator.generate(num_samples=G)``) is prefilled once: its part has one row per prompt
([Bp, S, ...]) and the G samples' rows ([Bp G, T, ...], prompt i's samples at rows
iG .. iG + G - 1) attend to it and to their own new tokens. A layer without K and V
(Gated DeltaNet: a recurrent state) has only the second part, the prompt's state copied for
each sample (``sample_caches``).

Slots. Prompts are left-padded to a common length S (a multiple of P) and the new tokens
follow: slot j of row b holds position j - pad[b]; slots before pad[b] are never attended.
New token t (its step) is slot S + t.

Windows. A part is a ring of W entries: slot j lives at entry j mod W (new token t at entry
t mod W), overwritten by slot j + W. A global layer's W is the part's slots (every slot has
its own entry); a sliding-window layer's is min(window, slots), so it keeps only the slots its
window can still see: its cache does not grow past the window however long the prompt and the
answer. When a layer stack mixes local and global layers (Gemma: one scan over all layers,
the kind switching per layer), the stack's caches are two pools per part, one per kind
([layers of that kind, B, W, K'R, H]), each layer reading and writing its own entry of its
kind's pool (``run_layers``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..attention.heads import pad_kv
from ..config import ModelConfig
from ..head_layout import HeadLayout, head_layout
from ..mesh import DATA, SEQ, act_spec, axis_size, shard
from ..models.decoder import layer_groups


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Shape of one part of a layer's cache (the prompt's or the new tokens'): ``batch`` rows
    of ``slots`` positions, the head layout."""
    heads: HeadLayout
    batch: int
    slots: int
    head_dim: int
    dtype: str
    window: int = 0              # the sliding window of "L" layers (0: none)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[B, C, K'R, H]."""
        return self.batch, self.slots, self.heads.kv_sent, self.head_dim

    def ring(self, kind: str) -> int:
        """Entries W of a layer of ``kind``'s cache: min(window, C) for "L" layers with a
        window, else C."""
        return min(self.window, self.slots) if kind == "L" and self.window else self.slots

    def shape_of(self, kind: str) -> tuple[int, int, int, int]:
        """[B, W, K'R, H] of a layer of ``kind``."""
        return self.batch, self.ring(kind), self.heads.kv_sent, self.head_dim

    @staticmethod
    def spec(mesh: Mesh) -> P:
        """Rows over ``data`` (each data replica generates its share of the rows), heads
        over ``seq``."""
        return P(act_spec(mesh)[0], None, SEQ, None)

    def bytes_per_device(self, mesh: Mesh, layers: int | list[str]) -> int:
        """K and V of ``layers`` layers of C entries (or of the layers of those kinds,
        "L" / "G", each its own W), on one device."""
        kinds = ["G"] * layers if isinstance(layers, int) else list(layers)
        entries = sum(int(np.prod(self.shape_of(k))) for k in kinds)
        whole = 2 * entries * jnp.dtype(self.dtype).itemsize
        return whole // (axis_size(mesh, SEQ) * axis_size(mesh, DATA))


def cache_layout(cfg: ModelConfig, mesh: Mesh, batch: int, slots: int) -> CacheLayout:
    """The cache of ``cfg``'s attention layers for ``batch`` rows of ``slots`` positions."""
    return CacheLayout(head_layout(cfg.n_heads, cfg.n_kv_heads, axis_size(mesh, SEQ)),
                       batch, slots, cfg.head_dim, cfg.dtype, cfg.sliding_window or 0)


def to_cache(k: jax.Array, v: jax.Array, layout: CacheLayout, mesh: Mesh, kind: str = "G"):
    """A prompt's [B, S, K, H] keys and values as a layer of ``kind``'s cache ring (slot j
    at entry j mod W; the last W slots where S > W), split by head over ``seq`` (XLA moves
    them from the sequence split: an all-to-all)."""
    sharding = NamedSharding(mesh, layout.spec(mesh))
    ring = layout.ring(kind)

    def entries(x):
        # Heads padded and copied on each device's tokens, then one move from the sequence
        # split to the head split, then the ring formed (a dimension no longer split);
        # padding a split dimension would make XLA gather it whole.
        x = shard(x, mesh, act_spec(mesh, 2))                          # [B, S/P, K'R, H]
        x = jax.lax.with_sharding_constraint(x.astype(layout.dtype), sharding)
        s = x.shape[1]
        if s >= ring:  # slots s - W .. s - 1, slot j at entry j mod W
            x = jnp.roll(x[:, s - ring:], (s - ring) % ring, axis=1)
        else:
            x = jnp.pad(x, ((0, 0), (0, ring - s), (0, 0), (0, 0)))
        return jax.lax.with_sharding_constraint(x, sharding)           # [B, W, K'R/P, H]

    return tuple(entries(x) for x in pad_kv(k, v, layout.heads))


def empty_pools(layout: CacheLayout, mesh: Mesh, kinds: list[str]) -> dict:
    """Zero caches of a stack whose layers have ``kinds`` (mixed): {kind: (k, v) [n, B, W,
    K'R, H]} for each kind present, split as the layer caches are."""
    spec = layout.spec(mesh)
    sharding = NamedSharding(mesh, P(None, *spec))
    zeros = lambda kind: jax.lax.with_sharding_constraint(  # noqa: E731
        jnp.zeros((kinds.count(kind),) + layout.shape_of(kind), layout.dtype), sharding)
    return {kind: (zeros(kind), zeros(kind)) for kind in sorted(set(kinds))}


def pool_index(kinds: list[str]) -> np.ndarray:
    """[R] int32: each layer's entry in its kind's pool (its rank among the layers of its
    kind)."""
    seen: dict = {}
    out = []
    for kind in kinds:
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return np.asarray(out, np.int32)


def unit_caches(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """Per position of each layer group's unit, in ``blocks.run_layers``' order: (its
    layers' token mixer, "A" attention or "D" Gated DeltaNet; their attention kinds in repeat
    order)."""
    kinds = cfg.layer_kinds()
    return [(mixer, list(kinds[first + u::len(unit)][:repeats]))
            for first, unit, repeats in layer_groups(cfg) for u, (_, mixer) in enumerate(unit)]


def sample_caches(cfg: ModelConfig, prefilled: list, new: CacheLayout, mesh: Mesh,
                  samples: int) -> tuple[list, list]:
    """The prefill's caches (one row per prompt) as the decode step's two arguments: (the
    prompts' K and V, read-only: the prefill's own arrays, None for a DeltaNet position; the
    samples' caches: zero new-token parts laid out by ``new``, or a DeltaNet position's state
    and convolution inputs copied ``samples`` times per prompt, row i to rows iG .. iG + G -
    1)."""
    prompt, carried = [], []
    for (mixer, kinds), cache in zip(unit_caches(cfg), prefilled):
        if mixer == "D":
            prompt.append(None)
            state, *inputs = cache
            carried.append((_copied(state, samples, mesh, SEQ),
                            *(_copied(a, samples, mesh) for a in inputs)))
            continue
        prompt.append(cache)
        pools = empty_pools(new, mesh, kinds)
        carried.append(pools if isinstance(cache, dict) else pools[kinds[0]])
    return prompt, carried


def _copied(a: jax.Array, samples: int, mesh: Mesh, heads: str | None = None) -> jax.Array:
    """A stacked DeltaNet cache leaf [R, Bp, ...] with each prompt's row copied for its
    samples [R, Bp G, ...]: rows over ``data``, the next axis (the state's value heads) over
    ``heads``."""
    spec = P(None, act_spec(mesh)[0], heads)
    return jax.lax.with_sharding_constraint(jnp.repeat(a, samples, axis=1),
                                            NamedSharding(mesh, spec))
