"""Batches of multimodal chat data for a Qwen2.5-VL model (``model.family=qwen2_5_vl``).

A batch of a store with images or videos (``store.TokenStore.media``) holds, besides the
token fields of ``text.FIELDS``, the M-RoPE ``positions`` [B, S, 3] (replacing the [B, S]
ones) and ``vision``: the batch's patches in the tower's slot order and the arrays that
place them (``models.multimodal.prepare``), all computed on the host for whole rows before
any sharding. Shapes are static: the tower has G groups (one per device when
``model.vision.split``, else 1) of C patch slots each (``vision_slots``), whatever the
batch holds; a batch without any image is all padding slots.

C. Placeholders are tokens, and an image of n units has m^2 n patches (m =
``model.vision.spatial_merge_size``, 2 for Qwen2.5-VL: 4n), so a batch never holds more than
m^2 x B x S patches. Frames are dealt whole, largest first, to the least-filled group, which
leaves no group fuller than total / G + the largest frame. So the default
C = ceil(m^2 B S / G) + DEFAULT_FRAME_PATCHES (the largest frame the processor makes at its
default max_pixels), rounded up to a multiple of m^2, fits every batch of a store whose
frames are no larger; the trainer checks the store's largest frame against it, and the
store's patching (patch size, merge size, temporal patch size) and placeholder ids against
the model's (``check_store``). ``data.vision_patches`` sets C by hand (fewer slots: less
tower memory and compute, but a batch that does not fit stops the run with a message naming
the numbers).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..config import Config, ConfigError
from ..mesh import act_spec
from ..models import multimodal
from ..models.vision import vision_shardings
from . import images, media as media_lib
from .text import FIELDS, BatchIterator, eval_batches

# Patches of the largest frame at the processor's default max_pixels (28 x 28 x 1280 pixels).
DEFAULT_FRAME_PATCHES = images.IMAGE_MAX_PIXELS // 14 ** 2
VISION_FIELDS = ("pixels", "rope_hw", "window_segments", "frame_segments", "unit_order",
                 "feature_index")


def vision_groups(cfg: Config) -> int:
    """G: the tower's groups (``VisionTower.shards``): every device when split, else 1."""
    devices = cfg.mesh.data * cfg.mesh.ring * cfg.mesh.seq
    return devices if cfg.model.vision.split else 1


def vision_slots(cfg: Config) -> int:
    """C: patch slots per group (``data.vision_patches``, or the default of the module
    docstring), a multiple of spatial_merge_size^2."""
    m2 = cfg.model.vision.spatial_merge_size ** 2
    if cfg.data.vision_patches:
        return -(-cfg.data.vision_patches // m2) * m2
    worst = math.ceil(m2 * cfg.batch_size * cfg.seq_len / vision_groups(cfg))
    return -(-(worst + DEFAULT_FRAME_PATCHES) // m2) * m2


def check_store(cfg: Config, manifest: dict) -> None:
    """ConfigError when the store's text documents hold placeholder tokens, its placeholder
    ids or patching (the pixels and placeholder counts prepare made) are not the model's, or
    its largest frame could make a batch overflow the patch slots. A store id of None (its tokenizer lacks that placeholder, so
    the store holds no such media) is not compared."""
    held = manifest.get("text_placeholders")
    if held:
        raise ConfigError(
            f"{held['documents']} text document(s) of the store hold image / video placeholder "
            f"tokens with no image or video ({'; '.join(held['named'])}"
            f"{'; ...' if held['documents'] > len(held['named']) else ''}): a multimodal model "
            f"would take each for a vision feature; remove them from the text and prepare the "
            f"store again")
    media = manifest.get("media") or {}
    for key, want in (("image_token_id", cfg.model.image_token_id),
                      ("video_token_id", cfg.model.video_token_id)):
        if media.get(key) is not None and media[key] != want:
            raise ConfigError(f"the store's {key} is {media[key]} but model.{key} is {want}")
    v = cfg.model.vision
    for key, field in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                       ("temporal_patch_size", "temporal_patch_size")):
        if key in media and media[key] != getattr(v, field):
            raise ConfigError(f"the store's media were prepared with {key} {media[key]} but "
                              f"model.vision.{field} is {getattr(v, field)}: its pixels and "
                              f"placeholder counts do not fit this vision tower; use a model "
                              f"with the store's patching or prepare the store again")
    largest = int(media.get("max_frame_patches", 0))
    if cfg.data.vision_patches:
        if largest > vision_slots(cfg):
            raise ConfigError(f"data.vision_patches {cfg.data.vision_patches}: the store's "
                              f"largest frame has {largest} patches, more than a group holds")
        return
    if largest > DEFAULT_FRAME_PATCHES:
        need = vision_slots(cfg) - DEFAULT_FRAME_PATCHES + largest
        raise ConfigError(f"the store's largest frame has {largest} patches, more than the "
                          f"{DEFAULT_FRAME_PATCHES} the default patch slots leave room for; "
                          f"set data.vision_patches >= {need}")


def abstract_vision(cfg: Config, mesh: Mesh) -> dict:
    """``positions`` and ``vision`` as ShapeDtypeStructs (compile without data)."""
    v, (b, s) = cfg.model.vision, (cfg.batch_size, cfg.seq_len)
    n = vision_groups(cfg) * vision_slots(cfg)
    k = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    shapes = {"positions": ((b, s, 3), np.int32),
              "vision": {"pixels": ((n, k), np.float32), "rope_hw": ((n, 2), np.int32),
                         "window_segments": ((n,), np.int32),
                         "frame_segments": ((n,), np.int32),
                         "unit_order": ((n // v.spatial_merge_size ** 2,), np.int32),
                         "feature_index": ((b, s), np.int32)}}
    shardings = vision_shardings(mesh, v.split)
    return jax.tree.map(lambda sd, sh: jax.ShapeDtypeStruct(sd[0], sd[1], sharding=sh),
                        shapes, shardings, is_leaf=lambda x: isinstance(x, tuple))


def pixel_options(manifest: dict) -> dict:
    """``media.load_item``'s preprocessing keywords from a store manifest, {} for data
    without images (there is nothing to load)."""
    return media_lib.load_options(manifest) if manifest.get("media") else {}


def token_index(segment_ids: np.ndarray) -> np.ndarray:
    """[B, S] each token's index in its document (runs of equal segment id)."""
    seg = np.asarray(segment_ids)
    out = np.zeros(seg.shape, np.int64)
    for r, row in enumerate(seg):
        for _, a, b in multimodal.runs(row):
            out[r, a:b] = np.arange(b - a)
    return out


def media_inputs(rows: list[list[tuple]]) -> dict:
    """``multimodal.prepare``'s media keywords of rows of loaded (item, pixels, grid)."""
    pieces = {"image": ([], []), "video": ([], [])}
    seconds = []
    for row in rows:
        for item, pixels, grid in row:
            pieces[item["kind"]][0].append(pixels)
            pieces[item["kind"]][1].append(np.asarray(grid).reshape(1, 3))
            if item["kind"] == "video":
                seconds.append(item.get("second_per_grid_ts") or 1.0)
    inputs = {"second_per_grid_ts": np.asarray(seconds) if seconds else None}
    for kind, (px, grid) in pieces.items():
        if px:
            name = "pixel_values" if kind == "image" else "pixel_values_videos"
            inputs[name] = np.concatenate(px)
            inputs[f"{kind}_grid_thw"] = np.concatenate(grid)
    return inputs


def host_batch(batch: dict, media: list[list[dict]], cfg: Config, pixel_options: dict,
               names: list[str] | None = None) -> dict:
    """A numpy batch of FIELDS [B, S] and each row's media -> the batch with M-RoPE
    ``positions`` and ``vision`` (numpy), images loaded and preprocessed here.

    Args:
      names: optional, what each batch row is (``"row 7 of epoch 0"``), for error messages.
    Raises:
      ConfigError: the batch's patches overflow the patch slots (``data.vision_patches``).
      ValueError: naming the batch row (and ``names``' entry): a media file that cannot be
        read, or tokens and media that do not fit together (placeholder counts, grids).
    """
    def where(r: int) -> str:
        return f"batch row {r}" + (f" ({names[r]})" if names else "")

    loaded = []
    for r, row in enumerate(media):
        try:
            loaded.append([(item, *media_lib.load_item(item, **pixel_options)) for item in row])
        except ValueError as e:
            raise ValueError(f"{where(r)}: {e}") from None
    try:
        positions, vision = multimodal.prepare(
            batch["tokens"], cfg.model, segment_ids=batch["segment_ids"],
            shards=vision_groups(cfg), capacity=vision_slots(cfg), **media_inputs(loaded))
    except multimodal.CapacityError as e:
        raise ConfigError(f"data.vision_patches {cfg.data.vision_patches or 'auto'} "
                          f"({vision_slots(cfg)} patch slots per group): {e}; set it higher, "
                          f"or 0 for enough for any batch") from None
    except ValueError:
        for r in range(len(media)):  # the batch's error is some row's: name the first
            try:
                multimodal.prepare(batch["tokens"][r:r + 1], cfg.model,
                                   segment_ids=batch["segment_ids"][r:r + 1],
                                   **media_inputs(loaded[r:r + 1]))
            except ValueError as row_error:
                raise ValueError(f"{where(r)}: {row_error}") from None
        raise
    return {**batch, "positions": positions, "vision": vision}


def to_global(batch: dict, mesh: Mesh, split: bool) -> dict:
    """Global jax.Arrays of a host batch (every process holds all of it)."""
    shardings = {**{f: NamedSharding(mesh, act_spec(mesh)) for f in FIELDS},
                 **vision_shardings(mesh, split)}
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
        batch, {k: shardings[k] for k in batch})


def _row_media(rows, index: int, epoch: int = 0, seed: int = 0) -> list[dict]:
    """The media of a row, in token order; none for rows of text-only data."""
    if not hasattr(rows, "row_media"):
        return []
    return rows.row_media(index, epoch, seed)


class MediaBatchIterator(BatchIterator):
    """``BatchIterator`` over a store with media: the same rows, position and state, with
    each batch's images loaded and laid out for the tower (``host_batch``)."""

    def __init__(self, rows, batch_size: int, cfg: Config, pixel_options: dict):
        super().__init__(rows, batch_size, cfg.seed)
        self.cfg, self.pixel_options = cfg, pixel_options

    def next_global(self, mesh: Mesh, order: np.ndarray | None = None) -> dict:
        if order is not None:
            raise ValueError("multimodal batches need mesh.ring 1 (no zigzag order)")
        rows = range(self.next_row, self.next_row + self.batch_size)
        n = self.rows.num_rows
        batch = self.rows.rows(rows, self.seed)
        media = [_row_media(self.rows, g % n, g // n, self.seed) for g in rows]
        names = [f"row {g % n} of epoch {g // n}, seed {self.seed}" for g in rows]
        self.next_row += self.batch_size
        return to_global(host_batch(batch, media, self.cfg, self.pixel_options, names), mesh,
                         self.cfg.model.vision.split)


def media_eval_batches(rows, cfg: Config, pixel_options: dict, mesh: Mesh):
    """``text.eval_batches`` with media: global batches of the held-out rows in order."""
    for b, batch in enumerate(eval_batches(rows, cfg.batch_size, cfg.eval_batches)):
        ids = range(b * cfg.batch_size, (b + 1) * cfg.batch_size)
        media = [_row_media(rows, i) if i < rows.num_rows else [] for i in ids]
        names = [f"held-out row {i}" for i in ids]
        yield to_global(host_batch(batch, media, cfg, pixel_options, names), mesh,
                        cfg.model.vision.split)
