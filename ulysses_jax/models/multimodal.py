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


def vision_layout(grid_thw, v: VisionConfig) -> dict[str, np.ndarray]:
    """The patch order and attention segments of the tower over the images of ``grid_thw``.

    Args:
      grid_thw: [n, 3] (frames / temporal_patch_size, patch rows, patch columns) per image or
        video, as the processor returns them; their patches are concatenated in this order.
    Returns:
      ``order`` [N]: the patch each window-order slot holds (transformers'
      ``get_vision_window_index``, a unit's merge^2 patches kept together);
      ``rope_hw`` [N, 2]: that patch's row and column (``get_vision_position_ids``);
      ``window_segments`` / ``frame_segments`` [N]: the window / frame of each slot, numbered
      from 1 in order (``cu_window_seqlens`` / ``cu_seqlens``);
      ``unit_order`` [U]: the window-order unit of each unit in original order.
    """
    g = _grids(grid_thw)
    m = v.spatial_merge_size
    bad = [tuple(x) for x in g if x[1] % m or x[2] % m or min(x) < 1]
    if bad:
        raise ValueError(f"grid_thw rows {bad[:4]} must be positive with patch rows and columns "
                         f"divisible by model.vision.spatial_merge_size {m}")
    per_window = v.window_size // m // v.patch_size      # units per window side
    unit_order, rope_hw, window_sizes, frame_sizes = [], [], [], []
    first = 0
    for t, h, w in g.tolist():
        uh, uw = h // m, w // m
        # units of each frame, window by window (row-major windows, row-major units inside)
        idx = np.arange(t * uh * uw).reshape(t, uh, uw)
        nh, nw = -(-uh // per_window), -(-uw // per_window)
        padded = np.full((t, nh * per_window, nw * per_window), -1)
        padded[:, :uh, :uw] = idx
        windows = padded.reshape(t, nh, per_window, nw, per_window).transpose(0, 1, 3, 2, 4)
        windows = windows.reshape(t, nh * nw, per_window * per_window)
        for frame in windows:
            for win in frame:
                kept = win[win >= 0]
                if len(kept):
                    unit_order.append(kept + first)
                    window_sizes.append(len(kept) * m * m)
        frame_sizes += [h * w] * t
        # (row, column) of each patch, units block-major as the processor orders patches
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (uh, m, uw, m)
        hw = np.stack([rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1),
                       cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)], -1)
        rope_hw.append(np.tile(hw, (t, 1)))
        first += t * uh * uw
    window_index = (np.concatenate(unit_order) if unit_order else np.zeros(0, np.int64))
    order = (window_index[:, None] * m * m + np.arange(m * m)).reshape(-1)
    hw = np.concatenate(rope_hw) if rope_hw else np.zeros((0, 2), np.int64)
    return {"order": order.astype(np.int32), "rope_hw": hw[order].astype(np.int32),
            "window_segments": np.repeat(np.arange(1, len(window_sizes) + 1),
                                         window_sizes).astype(np.int32),
            "frame_segments": np.repeat(np.arange(1, len(frame_sizes) + 1),
                                        frame_sizes).astype(np.int32),
            "unit_order": np.argsort(window_index, kind="stable").astype(np.int32)}


def _documents(segment_ids, b: int, s: int) -> list[list[tuple[int, int]]]:
    """[(start, end)] of each row's documents: runs of equal nonzero segment id, or the whole
    row without segment ids."""
    if segment_ids is None:
        return [[(0, s)] for _ in range(b)]
    seg = np.asarray(segment_ids)
    out = []
    for row in seg:
        docs, start = [], 0
        for i in range(1, s + 1):
            if i == s or row[i] != row[start]:
                if row[start] != 0:
                    docs.append((start, i))
                start = i
        out.append(docs)
    return out


def _runs(kinds: np.ndarray) -> list[tuple[int, int, int]]:
    """[(kind, start, end)] runs of equal values."""
    out, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            out.append((int(kinds[start]), start, i))
            start = i
    return out


def rope_index(tokens, cfg: ModelConfig, image_grid_thw=None, video_grid_thw=None,
               second_per_grid_ts=None, segment_ids=None) -> np.ndarray:
    """M-RoPE positions [B, S, 3] (temporal, row, column), as transformers' ``get_rope_index``.

    Text tokens count on from the previous position (all three equal). An image's or video's
    placeholders get (start + t * interval, start + row, start + column) of their merged unit,
    start being the position after the text before it; the text after it continues from
    start + max(rows, columns) of units. interval is 1 for an image and tokens_per_second x
    second_per_grid_ts for a video (floored). Images and videos are taken in order over the
    rows (row-major), each consuming its number of placeholders. With ``segment_ids``, each
    document (run of equal nonzero id) starts again from 0, as if it were alone; padding
    (id 0) gets 0.
    """
    tok = np.asarray(tokens)
    b, s = tok.shape
    m = cfg.vision.spatial_merge_size
    kinds = np.where(tok == cfg.image_token_id, 1, np.where(tok == cfg.video_token_id, 2, 0))
    grids = {1: list(_grids(image_grid_thw)), 2: list(_grids(video_grid_thw))}
    seconds = ([1.0] * len(grids[2]) if second_per_grid_ts is None
               else [float(x) for x in np.asarray(second_per_grid_ts).reshape(-1)])
    if len(seconds) != len(grids[2]):
        raise ValueError(f"second_per_grid_ts has {len(seconds)} entries for "
                         f"{len(grids[2])} videos")
    used = {1: 0, 2: 0}
    out = np.zeros((b, s, 3), np.int64)
    for r, docs in enumerate(_documents(segment_ids, b, s)):
        for start, end in docs:
            pos = 0
            for kind, lo, hi in _runs(kinds[r, start:end]):
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
                    interval = cfg.vision.tokens_per_second * seconds[used[kind]] \
                        if kind == 2 else 1
                    used[kind] += 1
                    n = t * (h // m) * (w // m)
                    tt, hh, ww = np.meshgrid((np.arange(t) * interval).astype(np.int64),
                                             np.arange(h // m), np.arange(w // m), indexing="ij")
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
            segment_ids=None) -> tuple[np.ndarray, dict | None]:
    """Everything a Qwen2.5-VL forward needs besides the tokens, from transformers' inputs.

    Args:
      tokens: [B, S] with transformers' placeholder ids (one per merged unit).
      pixel_values / pixel_values_videos: [N, K] flattened patches of the images / videos,
        with their ``image_grid_thw`` / ``video_grid_thw`` [n, 3] (the processor's outputs).
      second_per_grid_ts: [videos] seconds per temporal patch (default 1).
      segment_ids: [B, S] packed documents (0 = padding), or None.
    Returns:
      (positions [B, S, 3] int32, vision): vision is None without images or videos, else the
      dict ``Decoder`` takes: ``vision_layout``'s arrays, ``pixels`` [N, K] float32 and
      ``feature_index`` [B, S].
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
    if not pieces:
        return positions, None
    layout = vision_layout(np.concatenate(grids), v)
    return positions, {**layout, "pixels": np.concatenate(pieces), "feature_index": index}
