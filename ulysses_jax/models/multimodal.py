"""Host-side (numpy) inputs of a Qwen2.5-VL model: the vision tower's patch layout, the
placeholder-to-feature map and the M-RoPE positions, all computed for whole sequences before
any sharding (vision.py says how the model uses them).

Shapes depend on the images (their grids), so these are computed on the host, once per batch,
from concrete arrays; the jitted model then only gathers and scatters with them. transformers
computes the same things inside its forward (``get_rope_index``, ``get_vision_window_index``,
``get_vision_position_ids``, the placeholder mask); each function here says which.

Letters as in vision.py; B batch, S sequence.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig, VisionConfig


def _grids(grid_thw) -> np.ndarray:
    g = np.zeros((0, 3), np.int64) if grid_thw is None else np.asarray(grid_thw, np.int64)
    if g.ndim != 2 or g.shape[1] != 3:
        raise ValueError(f"a grid_thw must be [n, 3] (frames, patch rows, patch columns), got "
                         f"shape {g.shape}")
    return g


def units(grid_thw, merge: int) -> np.ndarray:
    """Decoder tokens of each image / video: t * h * w / merge^2 ([n] ints)."""
    g = _grids(grid_thw)
    return g.prod(-1) // merge ** 2


class CapacityError(ValueError):
    """The frames do not fit the tower's groups of ``capacity`` patch slots (``vision_layout``):
    the one error that a larger slot budget (``data.vision_patches``) cures."""


# Segment ids of padding slots: after every real one, runs of PAD_RUN slots each alone
# together (so the tower's attention over padding costs PAD_RUN keys a slot, not all of it).
PAD_SEGMENT, PAD_RUN = 2 ** 30, 256


def _frames(g: np.ndarray, v: VisionConfig) -> list[tuple[np.ndarray, list[int]]]:
    """Per frame of every image / video, in order: (its patches in window order, as indices
    into the concatenated patches; the patch count of each of its windows)."""
    m = v.spatial_merge_size
    per_window = v.window_size // m // v.patch_size      # units per window side
    frames, first = [], 0
    for t, h, w in g.tolist():
        uh, uw = h // m, w // m
        nh, nw = -(-uh // per_window), -(-uw // per_window)
        padded = np.full((nh * per_window, nw * per_window), -1)
        padded[:uh, :uw] = np.arange(uh * uw).reshape(uh, uw)
        windows = padded.reshape(nh, per_window, nw, per_window).transpose(0, 2, 1, 3)
        windows = [win[win >= 0] for win in windows.reshape(nh * nw, -1)]
        windows = [win for win in windows if len(win)]
        units = np.concatenate(windows)                   # window order, row-major inside
        for f in range(t):
            unit_ids = first + f * uh * uw + units
            patches = (unit_ids[:, None] * m * m + np.arange(m * m)).reshape(-1)
            frames.append((patches, [len(win) * m * m for win in windows]))
        first += t * uh * uw
    return frames


def _rope_hw(g: np.ndarray, m: int) -> np.ndarray:
    """[N, 2] (row, column) of every patch in the processor's order (a unit's m x m patches
    together, units row-major), frames repeating the image's."""
    out = [np.zeros((0, 2), np.int64)]
    for t, h, w in g.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // m, m, w // m, m)
        hw = np.stack([rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
                       cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)], -1)
        out.append(np.tile(hw, (t, 1)))
    return np.concatenate(out)


def vision_layout(grid_thw, v: VisionConfig, shards: int = 1,
                  capacity: int | None = None) -> dict[str, np.ndarray]:
    """Where each patch goes in the tower, and its attention segments and 2-D positions.

    Frames (an image, or one temporal patch of a video) are the tower's independent pieces:
    every attention stays inside one. They are dealt to ``shards`` groups of ``capacity``
    slots (largest first, each to the least-filled group; ``VisionTower`` runs one group per
    device when split), and inside a frame the patches take transformers' window order
    (``get_vision_window_index``: the units of each window of window_size pixels together,
    a unit's merge^2 patches adjacent). Unused slots are padding, alone in their own segment.

    Args:
      grid_thw: [n, 3] (temporal patches, patch rows, patch columns) per image or video, as
        the processor returns them; their patches are concatenated in this order.
      shards: groups; capacity: slots per group (a multiple of merge^2); None = the fullest
        group's patches.
    Returns:
      ``order`` [G*C]: the patch each slot holds (-1: padding), for the host to place the
      pixel rows; ``rope_hw`` [G*C, 2]: its patch's row and column
      (``get_vision_position_ids``); ``window_segments`` / ``frame_segments`` [G*C]: its window /
      frame, numbered from 1 in slot order (``cu_window_seqlens`` / ``cu_seqlens``),
      PAD_SEGMENT + slot // PAD_RUN for padding; ``unit_order`` [G*C / merge^2]: the slot unit of each unit, the
      images' and videos' U units in order first, then the padding units.
    Raises:
      ValueError: bad grids, shards or capacity (names the numbers). CapacityError (a
        ValueError): frames that do not fit the groups.
    """
    g = _grids(grid_thw)
    m2 = v.spatial_merge_size ** 2
    if isinstance(shards, bool) or int(shards) != shards or shards < 1:
        raise ValueError(f"shards (the tower's groups) must be a positive integer, got {shards!r}")
    if capacity is not None and (isinstance(capacity, bool) or int(capacity) != capacity
                                 or capacity < 0 or capacity % m2):
        raise ValueError(f"capacity (patch slots per group) must be a non-negative multiple of "
                         f"model.vision.spatial_merge_size^2 = {m2}, so that a merged unit's "
                         f"{m2} patches stay in one group; got {capacity!r}")
    bad = [tuple(x) for x in g if x[1] % v.spatial_merge_size or x[2] % v.spatial_merge_size
           or min(x) < 1]
    if bad:
        raise ValueError(f"grid_thw rows {bad[:4]} must be positive with patch rows and columns "
                         f"divisible by model.vision.spatial_merge_size {v.spatial_merge_size}")
    frames = _frames(g, v)
    load, members = [0] * shards, [[] for _ in range(shards)]
    for f in sorted(range(len(frames)), key=lambda f: (-len(frames[f][0]), f)):
        target = min(range(shards), key=lambda i: (load[i], i))
        load[target] += len(frames[f][0])
        members[target].append(f)
    fullest = max(load)
    capacity = -(-fullest // m2) * m2 if capacity is None else capacity
    if fullest > capacity:
        sizes = sorted((len(p) for p, _ in frames), reverse=True)[:4]
        raise CapacityError(f"the images' {sum(load)} patches (largest frames {sizes}) do not "
                            f"fit {shards} group(s) of {capacity} slots: the fullest group "
                            f"needs {fullest}; raise the vision patch budget or use fewer or "
                            f"smaller images")
    order = np.full(shards * capacity, -1, np.int64)
    windows = np.full(shards * capacity, PAD_SEGMENT, np.int64)
    frame_ids = np.full(shards * capacity, PAD_SEGMENT, np.int64)
    next_window = 1
    for s, fs in enumerate(members):
        at = s * capacity
        for f in sorted(fs):
            patches, sizes = frames[f]
            order[at:at + len(patches)] = patches
            frame_ids[at:at + len(patches)] = f + 1
            windows[at:at + len(patches)] = np.repeat(
                np.arange(next_window, next_window + len(sizes)), sizes)
            next_window += len(sizes)
            at += len(patches)
    hw = _rope_hw(g, v.spatial_merge_size)
    real = order >= 0
    pad_ids = PAD_SEGMENT + np.arange(len(order)) // PAD_RUN
    windows[~real] = frame_ids[~real] = pad_ids[~real]
    rope_hw = np.zeros((len(order), 2), np.int64)
    rope_hw[real] = hw[order[real]]
    slot_units = order[::m2]                       # the first patch of each slot unit
    unit_order = np.argsort(np.where(slot_units >= 0, slot_units, np.inf), kind="stable")
    return {"order": order, "rope_hw": rope_hw.astype(np.int32),
            "window_segments": windows.astype(np.int32),
            "frame_segments": frame_ids.astype(np.int32),
            "unit_order": unit_order.astype(np.int32)}


def runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """[(value, start, end)] of the runs of equal values of a 1-D array, in order."""
    v = np.asarray(values)
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]]) if len(v) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(v)]
    return [(int(v[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def _documents(segment_ids, b: int, s: int) -> list[list[tuple[int, int]]]:
    """[(start, end)] of each row's documents: runs of equal nonzero segment id, or the whole
    row without segment ids."""
    if segment_ids is None:
        return [[(0, s)] for _ in range(b)]
    return [[(a, e) for k, a, e in runs(row) if k != 0] for row in np.asarray(segment_ids)]


def rope_index(tokens, cfg: ModelConfig, image_grid_thw=None, video_grid_thw=None,
               second_per_grid_ts=None, segment_ids=None) -> np.ndarray:
    """M-RoPE positions [B, S, 3] (temporal, row, column), as transformers' ``get_rope_index``.

    Text tokens count on from the previous position (all three equal). An image's or video's
    placeholders get (start + t * interval, start + row, start + column) of their merged unit,
    start being the position after the text before it; the text after it continues from
    start + max(rows, columns) of units. interval is 1 for an image and tokens_per_second x
    second_per_grid_ts for a video, in float32 as transformers computes it (its
    second_per_grid_ts is a float32 tensor): t * (float32(tokens_per_second) x
    float32(second_per_grid_ts)) rounded to float32 and truncated; float64 would differ by
    one for some rates (second_per_grid_ts 2 / 1.3, temporal patch 39: 119 in float64,
    120 in float32). Images and videos are taken in order over the rows (row-major), each
    consuming its number of placeholders. With ``segment_ids``, each
    document (run of equal nonzero id) starts again from 0, as if it were alone; padding
    (id 0) gets 0.
    """
    tok = np.asarray(tokens)
    b, s = tok.shape
    m = cfg.vision.spatial_merge_size
    kinds = np.where(tok == cfg.image_token_id, 1, np.where(tok == cfg.video_token_id, 2, 0))
    grids = {1: list(_grids(image_grid_thw)), 2: list(_grids(video_grid_thw))}
    # float32 as transformers' tensor; None: transformers' integer default of 1 per video.
    seconds = ([None] * len(grids[2]) if second_per_grid_ts is None
               else list(np.asarray(second_per_grid_ts, np.float32).reshape(-1)))
    if len(seconds) != len(grids[2]):
        raise ValueError(f"second_per_grid_ts has {len(seconds)} entries for "
                         f"{len(grids[2])} videos")
    used = {1: 0, 2: 0}
    out = np.zeros((b, s, 3), np.int64)
    for r, docs in enumerate(_documents(segment_ids, b, s)):
        for start, end in docs:
            pos = 0
            for kind, lo, hi in runs(kinds[r, start:end]):
                lo, hi = lo + start, hi + start
                if kind == 0:
                    out[r, lo:hi] = (pos + np.arange(hi - lo))[:, None]
                    pos += hi - lo
                    continue
                at = lo
                while at < hi:  # one image / video after another inside the run
                    if used[kind] >= len(grids[kind]):
                        name = "image" if kind == 1 else "video"
                        raise ValueError(f"the tokens hold more {name} placeholders than the "
                                         f"{len(grids[kind])} {name} grids give features for")
                    t, h, w = (int(x) for x in grids[kind][used[kind]])
                    temporal = np.arange(t)                               # [t] int64
                    if kind == 2 and seconds[used[kind]] is not None:
                        interval = np.float32(cfg.vision.tokens_per_second) \
                            * seconds[used[kind]]                         # float32 scalar
                        temporal = (temporal.astype(np.float32) * interval).astype(np.int64)
                    elif kind == 2:
                        temporal = temporal * cfg.vision.tokens_per_second
                    used[kind] += 1
                    n = t * (h // m) * (w // m)
                    tt, hh, ww = np.meshgrid(temporal, np.arange(h // m), np.arange(w // m),
                                             indexing="ij")
                    block = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)], -1) + pos
                    take = min(n, hi - at)
                    out[r, at:at + take] = block[:take]
                    at += take
                    pos += max(h, w) // m
    return out.astype(np.int32)


def feature_index(tokens, cfg: ModelConfig, image_units: int, video_units: int) -> np.ndarray:
    """[B, S] int32: each placeholder's row in the tower's output (images then videos, in
    order over the flattened batch, as transformers' ``masked_scatter``), -1 for text.

    Raises:
      ValueError: when the placeholders and the features differ in number (names both).
    """
    tok = np.asarray(tokens)
    image, video = tok == cfg.image_token_id, tok == cfg.video_token_id
    for name, mask, want in (("image", image, image_units), ("video", video, video_units)):
        if int(mask.sum()) != want:
            raise ValueError(f"the tokens hold {int(mask.sum())} {name} placeholders "
                             f"(token id {cfg.image_token_id if name == 'image' else cfg.video_token_id}) "
                             f"but the {name}s give {want} features (grid t x h x w / "
                             f"spatial_merge_size^2 each)")
    out = np.full(tok.shape, -1, np.int64)
    out[image] = np.arange(image_units)
    out[video] = image_units + np.arange(video_units)
    return out.astype(np.int32)


def prepare(tokens, cfg: ModelConfig, *, pixel_values=None, image_grid_thw=None,
            pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None,
            segment_ids=None, shards: int = 1,
            capacity: int | None = None) -> tuple[np.ndarray, dict | None]:
    """Everything a Qwen2.5-VL forward needs besides the tokens, from transformers' inputs.

    Args:
      tokens: [B, S] with transformers' placeholder ids (one per merged unit).
      pixel_values / pixel_values_videos: [N, K] flattened patches of the images / videos,
        with their ``image_grid_thw`` / ``video_grid_thw`` [n, 3] (the processor's outputs).
      second_per_grid_ts: [videos] seconds per temporal patch (default 1).
      segment_ids: [B, S] packed documents (0 = padding), or None.
      shards, capacity: the tower's groups and slots per group (``vision_layout``;
        ``VisionTower.shards()``).
    Returns:
      (positions [B, S, 3] int32, vision): vision is None without images or videos, else the
      dict ``Decoder`` takes: ``vision_layout``'s device arrays, ``pixels`` [G*C, K] float32
      (the patches in slot order, zeros in padding) and ``feature_index`` [B, S].
    """
    v = cfg.vision
    k = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    pieces, grids = [], []
    for name, pixels, grid in (("pixel_values", pixel_values, image_grid_thw),
                               ("pixel_values_videos", pixel_values_videos, video_grid_thw)):
        g = _grids(grid)
        if pixels is None:
            if len(g):
                raise ValueError(f"{name} is missing for its {len(g)} grids")
            continue
        p = np.asarray(pixels, np.float32)
        if p.ndim != 2 or p.shape != (int(g.prod(-1).sum()), k):
            raise ValueError(f"{name} must be [patches, {k}] with patches = sum of t x h x w "
                             f"of its grids ({int(g.prod(-1).sum())}), got {p.shape}")
        pieces.append(p)
        grids.append(g)
    image_units = int(units(image_grid_thw, v.spatial_merge_size).sum())
    video_units = int(units(video_grid_thw, v.spatial_merge_size).sum())
    index = feature_index(tokens, cfg, image_units, video_units)
    positions = rope_index(tokens, cfg, image_grid_thw, video_grid_thw, second_per_grid_ts,
                           segment_ids)
    if not pieces and capacity is None:
        return positions, None
    layout = vision_layout(np.concatenate(grids) if grids else None, v, shards, capacity)
    order = layout.pop("order")
    pixels = np.zeros((len(order), k), np.float32)
    if pieces:
        pixels[order >= 0] = np.concatenate(pieces)[order[order >= 0]]
    return positions, {**layout, "pixels": pixels, "feature_index": index}
