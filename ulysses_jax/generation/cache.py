"""The KV cache: per attention layer, K and V of every position, split over the devices by
head as Ulysses attention splits them.

Layout. Inside Ulysses attention each of the P devices of the ``seq`` axis holds the whole
sequence for its block of heads (``head_layout``: N' query heads, K'R kv head copies, padded
and copied as the exchange pads and copies them). The cache keeps that layout: per layer
``k`` and ``v`` [B, C, K'R, H] for C slots, split over ``seq`` on the head axis (and over
``data`` on the rows, each data replica generating its share of them), so each device holds
1/P of its replica's rows and a decode step reads only its own heads. Layers stacked in the
model (``decoder.layer_groups``) stay stacked here: one [R, B, C, K'R, H] pair per position
of a group's unit, scanned with the layer weights.

Slots. Prompts are left-padded to a common length S (a multiple of P) and the new tokens
follow: slot j of row b holds position j - pad[b]; slots before pad[b] are never attended.
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


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Shape of one layer's cache: ``batch`` rows of ``slots`` positions, the head layout."""
    heads: HeadLayout
    batch: int
    slots: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[B, C, K'R, H]."""
        return self.batch, self.slots, self.heads.kv_sent, self.head_dim

    @staticmethod
    def spec(mesh: Mesh) -> P:
        """Rows over ``data`` (each data replica generates its share of the rows), heads
        over ``seq``."""
        return P(DATA if DATA in mesh.axis_names else None, None, SEQ, None)

    def bytes_per_device(self, mesh: Mesh, layers: int) -> int:
        """K and V of ``layers`` layers, on one device."""
        whole = 2 * layers * int(np.prod(self.shape)) * jnp.dtype(self.dtype).itemsize
        return whole // (axis_size(mesh, SEQ) * axis_size(mesh, DATA))


def cache_layout(cfg: ModelConfig, mesh: Mesh, batch: int, slots: int) -> CacheLayout:
    """The cache of ``cfg``'s attention layers for ``batch`` rows of ``slots`` positions."""
    return CacheLayout(head_layout(cfg.n_heads, cfg.n_kv_heads, axis_size(mesh, SEQ)),
                       batch, slots, cfg.head_dim, cfg.dtype)


def to_cache(k: jax.Array, v: jax.Array, layout: CacheLayout, mesh: Mesh):
    """A prompt's [B, S, K, H] keys and values as the first S slots of a layer's cache,
    split by head over ``seq`` (XLA moves them from the sequence split: an all-to-all)."""
    sharding = NamedSharding(mesh, layout.spec(mesh))

    def slots(x):
        # Heads padded and copied on each device's tokens, then one move from the sequence
        # split to the head split, then the slots for new tokens added (a dimension no
        # longer split); padding a split dimension would make XLA gather it whole.
        x = shard(x, mesh, act_spec(mesh, 2))                          # [B, S/P, K'R, H]
        x = jax.lax.with_sharding_constraint(x.astype(layout.dtype), sharding)
        x = jnp.pad(x, ((0, 0), (0, layout.slots - x.shape[1]), (0, 0), (0, 0)))
        return jax.lax.with_sharding_constraint(x, sharding)           # [B, C, K'R/P, H]

    return tuple(slots(x) for x in pad_kv(k, v, layout.heads))
