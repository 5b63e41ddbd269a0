"""Multimodal chat data for Qwen2-VL / Qwen2.5-VL: image and video parts of messages -> grids,
placeholder expansion, and the pixels of a stored item.

A message's ``content`` may be a list of parts, as transformers and Qwen2.5-VL write them::

    {"type": "text", "text": "..."}
    {"type": "image", "image": "cat.jpg"}
    {"type": "video", "video": "clip_frames/" or ["f0.jpg", "f1.jpg", ...], "fps": 30.0}

Paths are relative to the directory of the data file (a ``save_to_disk`` directory for its
rows), absolute ones are used as they are. The chat template renders each image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (videos: ``<|video_pad|>``); as transformers'
``Qwen2_5_VLProcessor`` does, the i-th ``<|image_pad|>`` of the text then stands for the i-th
image part (messages in order, parts in order), and likewise for videos, and each is expanded
to ``placeholder_count(grid)`` copies. Here the expansion happens on token ids: the pad is one
added token, so the ids of a text with N pads equal those of the text with one pad where that
one id is repeated N times.

Grids are found at prepare time from sizes: an image's size (EXIF orientation applied as
``images.load_image`` applies it), a video's sampled frame count
(``images.sample_frame_indices``) and its first frame's size. Prepare also decodes each image
and sampled frame once (``image_size``), so a truncated or corrupt file is refused there, by
name, not in the middle of a run. ``load_item`` recomputes the pixels at training time and
refuses a file whose grid no longer matches.

The placeholders are the media's only: a conversation (or, with such a tokenizer, a text
document) whose text itself holds <|image_pad|> or <|video_pad|> without a matching part is
refused at prepare (a Qwen2.5-VL model would take each for an image's or video's feature).

Videos: ``"fps"`` is the rate the frames were taken at. With it, frames are sampled down to
``video_fps`` (prepare's ``--video-fps``, 2.0 by default) by Qwen2VLVideoProcessor's rule and
``second_per_grid_ts`` = temporal_patch_size / sampled fps; without it every frame is kept
and the fps counts as unknown (``images.UNKNOWN_FPS``, transformers' fallback).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
from PIL import Image

from . import images as images_lib
from .chat import encode_conversation as encode_text

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
_TRANSPOSED = (5, 6, 7, 8)  # EXIF orientations that swap width and height


@dataclasses.dataclass(frozen=True)
class MediaOptions:
    """Pixel bounds, video sampling and patching: everything a grid depends on."""
    image_min_pixels: int = images_lib.IMAGE_MIN_PIXELS
    image_max_pixels: int = images_lib.IMAGE_MAX_PIXELS
    video_min_pixels: int = images_lib.VIDEO_MIN_PIXELS
    video_max_pixels: int = images_lib.VIDEO_MAX_PIXELS
    video_fps: float = 2.0
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2

    def __post_init__(self):
        for lo, hi in (("image_min_pixels", "image_max_pixels"),
                       ("video_min_pixels", "video_max_pixels")):
            a, b = getattr(self, lo), getattr(self, hi)
            if int(a) != a or int(b) != b or a <= 0 or a > b:
                raise ValueError(f"{lo} and {hi} must be positive integers with {lo} <= {hi}, "
                                 f"got {a} and {b}")
        if not self.video_fps > 0:
            raise ValueError(f"video_fps must be positive, got {self.video_fps}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_options(manifest: dict) -> dict:
    """The keyword arguments of ``load_item`` recorded in a media store's manifest."""
    if "media" not in manifest:
        raise ValueError("the store has no images or videos (its manifest has no \"media\")")
    m = manifest["media"]
    return {k: m[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                              "image_min_pixels", "image_max_pixels", "video_min_pixels",
                              "video_max_pixels")}


def base_dir(name: str) -> str:
    """The directory relative media paths of record ``name`` (``file:line``, ``file:row``)
    start from: the data file's directory, or a save_to_disk directory itself."""
    path, _, suffix = name.rpartition(":")
    path = path if path and suffix.isdigit() else name
    return os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))


def media_parts(messages: Sequence[dict]) -> list[dict]:
    """The image and video parts of a conversation, messages in order, parts in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"]
            if isinstance(part, dict) and part.get("type") in ("image", "video")]


# What reading a media file can raise: a missing or unreadable file, not an image, a bad size,
# and Pillow's decompression-bomb refusal (over 2 x Image.MAX_IMAGE_PIXELS, an Exception
# subclass that is neither of the others).
READ_ERRORS = (OSError, ValueError, Image.DecompressionBombError)


def image_size(path: str) -> tuple[int, int]:
    """(height, width) of an image file once turned upright by its EXIF orientation.

    The file is decoded in full (``Image.load``), so a truncated or corrupt file fails here,
    at prepare, rather than at training time. That costs about 3 ms for a 1280 x 720 JPEG and
    15 ms for a PNG of that size (60 ms for a 12-megapixel JPEG), a fifth or less of what
    training's ``load_item`` spends on the same file in every epoch.

    Raises:
      OSError, ValueError, Image.DecompressionBombError: as Pillow raises them.
    """
    with Image.open(path) as im:
        width, height = im.size
        orientation = im.getexif().get(0x0112, 1)  # 0x0112: Orientation
        im.load()
    return (width, height) if orientation in _TRANSPOSED else (height, width)


def _resolve(path, base: str) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"a media path must be a non-empty string, got {path!r}")
    return os.path.normpath(os.path.join(base, path))


def image_item(path: str, opts: MediaOptions) -> dict:
    """The stored item of one image file: grid [1, h, w] in patches."""
    height, width = image_size(path)
    h, w = images_lib.smart_resize(height, width, opts.patch_size * opts.merge_size,
                                   opts.image_min_pixels, opts.image_max_pixels)
    return {"kind": "image", "paths": [path],
            "grid": [1, h // opts.patch_size, w // opts.patch_size], "second_per_grid_ts": None}


def video_item(source, fps: float | None, opts: MediaOptions) -> dict:
    """The stored item of a video given as a frame folder or a list of frame paths: the
    sampled frames, grid [t, h, w] and second_per_grid_ts.

    Args:
      source: an absolute folder path, or a list of absolute frame paths.
      fps: the rate the frames were taken at; None keeps every frame (rate unknown).
    """
    paths = images_lib.list_frame_files(source) if isinstance(source, str) else list(source)
    if not paths:
        raise ValueError("a video needs at least one frame, got an empty list")
    tp = opts.temporal_patch_size
    keep = images_lib.sample_frame_indices(
        len(paths), video_fps=fps, fps=opts.video_fps if fps is not None else None,
        temporal_patch_size=tp)
    frames = [paths[i] for i in keep]
    sizes = {image_size(p) for p in frames}  # decoded: a bad frame fails now
    if len(sizes) > 1:
        raise ValueError(f"the frames of video {source} differ in size ({sorted(sizes)}); all "
                         f"frames of a video must have one size")
    height, width = sizes.pop()
    h, w = images_lib.smart_resize(height, width, opts.patch_size * opts.merge_size,
                                   opts.video_min_pixels, opts.video_max_pixels)
    sampled_fps = None if fps is None else len(frames) / len(paths) * fps
    return {"kind": "video", "paths": frames,
            "grid": [-(-len(frames) // tp), h // opts.patch_size, w // opts.patch_size],
            "second_per_grid_ts": images_lib.second_per_grid_ts(sampled_fps, tp)}


def conversation_items(messages: Sequence[dict], base: str, opts: MediaOptions,
                       name: str) -> tuple[list[dict], list[dict], list[str]]:
    """(image items, video items, input paths to fingerprint) of a conversation's parts.

    The input paths are the image files, sampled frames and frame folders: what a later
    prepare stats to see whether the store is still current.
    """
    items: dict[str, list[dict]] = {"image": [], "video": []}
    inputs: list[str] = []
    for part in media_parts(messages):
        kind = part["type"]
        value = part.get(kind, part.get("path"))
        try:
            if value is None:
                raise ValueError(f"it names no file: an {kind} part gives its file under the "
                                 f"key \"{kind}\" (or \"path\"), a path relative to the data "
                                 f"file or absolute; this one has the keys {sorted(part)}"
                                 + ("; URLs are not fetched: download the file and give its "
                                    "path" if "url" in part else ""))
            if kind == "image":
                path = _resolve(value, base)
                items["image"].append(image_item(path, opts))
                inputs.append(path)
                continue
            fps = part.get("fps")
            if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float))
                                    or not fps > 0):
                raise ValueError(f"a video's \"fps\" must be a positive number, got {fps!r}")
            if isinstance(value, list):
                source = [_resolve(p, base) for p in value]
            else:
                source = _resolve(value, base)
                inputs.append(source)
            item = video_item(source, None if fps is None else float(fps), opts)
            items["video"].append(item)
            inputs.extend(item["paths"])
        except READ_ERRORS as e:
            label = f"{kind} {value!r}" if value is not None else f"{kind} part"
            raise ValueError(f"{name}: {label}: {e}") from None
    return items["image"], items["video"], inputs


def placeholder_ids(tokenizer, need_image: bool, need_video: bool,
                    name: str) -> tuple[int | None, int | None]:
    """The tokenizer's <|image_pad|> and <|video_pad|> ids; ValueError if data needs one it
    lacks."""
    vocab = getattr(tokenizer, "_tok", None)
    ids = []
    for token, needed in ((IMAGE_TOKEN, need_image), (VIDEO_TOKEN, need_video)):
        i = vocab.token_to_id(token) if vocab is not None else None
        if i is None and needed:
            raise ValueError(f"{name}: the conversation has {token.strip('<|>').split('_')[0]}s "
                             f"but the tokenizer ({getattr(tokenizer, 'path', 'bytes')}) has no "
                             f"{token} token; use a Qwen2-VL / Qwen2.5-VL tokenizer directory")
        ids.append(i)
    return ids[0], ids[1]


class Expander:
    """Expands each <|image_pad|> / <|video_pad|> id of successive pieces to its item's count,
    items taken in order per kind; records the items in token order (``placed``)."""

    def __init__(self, image_items, video_items, image_id, video_id, merge_size: int):
        self.kinds = {i: k for i, k in ((image_id, "image"), (video_id, "video"))
                      if i is not None}
        self.queues = {i: list(image_items if k == "image" else video_items)
                       for i, k in self.kinds.items()}
        self.seen = {i: 0 for i in self.kinds}
        self.merge_size = merge_size
        self.placed: list[dict] = []

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        hits = np.flatnonzero(np.isin(ids, list(self.kinds)))
        if len(hits) == 0:
            return ids
        repeats = np.ones(len(ids), np.int64)
        for j in hits:
            token = int(ids[j])
            k, queue = self.seen[token], self.queues[token]
            self.seen[token] += 1
            if k < len(queue):
                repeats[j] = images_lib.placeholder_count(queue[k]["grid"], self.merge_size)
                self.placed.append(queue[k])
        return np.repeat(ids, repeats)

    def check(self, name: str) -> None:
        """Every pad matched one part and every part one pad (transformers' rule)."""
        for token, kind in self.kinds.items():
            if self.seen[token] != len(self.queues[token]):
                raise ValueError(f"{name}: the rendered text holds {self.seen[token]} "
                                 f"{IMAGE_TOKEN if kind == 'image' else VIDEO_TOKEN} for "
                                 f"{len(self.queues[token])} {kind} part(s): the chat template "
                                 f"must print one per part, and the text must not contain the "
                                 f"placeholder token itself")


def text_placeholders(ids: np.ndarray, image_id: int | None, video_id: int | None) -> str:
    """The placeholder tokens a text document (no media go with it) holds, as "2
    <|image_pad|> (token id 151655)", or "" for none: a multimodal model would take each for
    an image's or video's feature (``check_store`` refuses such a store for one).

    Args:
      ids: the document's tokens; image_id, video_id: ``placeholder_ids``' (None: not counted).
    """
    held = []
    for token, i in ((IMAGE_TOKEN, image_id), (VIDEO_TOKEN, video_id)):
        n = 0 if i is None else int(np.count_nonzero(np.asarray(ids) == i))
        if n:
            held.append(f"{n} {token} (token id {i})")
    return ", ".join(held)


def encode_conversation(tokenizer, template, messages: Sequence[dict], base: str,
                        opts: MediaOptions, name: str = "conversation"):
    """Tokens, loss weights and media items of a conversation that may hold images / videos.

    Returns:
      (tokens int32 [T], weights uint8 [T], items, inputs): items are the conversation's media
      in token order (``image_item`` / ``video_item`` dicts), inputs the media paths read
      (to fingerprint). Without media parts: chat.encode_conversation's result, [], [].
    Raises:
      ValueError: naming the conversation: a media file that cannot be read, or a count of
        <|image_pad|> / <|video_pad|> in the rendered text other than its image / video parts
        (a conversation without media parts must hold none).
    """
    if not media_parts(messages):  # still no pad may appear: it would have no item
        expand = Expander([], [], *placeholder_ids(tokenizer, False, False, name),
                          opts.merge_size)
        tokens, weights = encode_text(tokenizer, template, messages, name)
        expand(tokens)  # counts the pads (there are no items to expand them to)
        expand.check(name)
        return tokens, weights, [], []
    image_items, video_items, inputs = conversation_items(messages, base, opts, name)
    image_id, video_id = placeholder_ids(tokenizer, bool(image_items), bool(video_items), name)
    expand = Expander(image_items, video_items, image_id, video_id, opts.merge_size)
    tokens, weights = encode_text(tokenizer, template, messages, name, expand=expand)
    expand.check(name)
    return tokens, weights, expand.placed, inputs


def load_item(item: dict, *, patch_size: int = 14, temporal_patch_size: int = 2,
              merge_size: int = 2, image_min_pixels: int = images_lib.IMAGE_MIN_PIXELS,
              image_max_pixels: int = images_lib.IMAGE_MAX_PIXELS,
              video_min_pixels: int = images_lib.VIDEO_MIN_PIXELS,
              video_max_pixels: int = images_lib.VIDEO_MAX_PIXELS) -> tuple[np.ndarray, np.ndarray]:
    """The pixels of one stored media item (``TokenStore.media`` / ``ChatRows.row_media``).

    Pass the store's options: ``load_item(item, **load_options(store.manifest))``.

    Returns:
      pixel_values: float32 [t*h*w, 3 * temporal_patch_size * patch_size**2] (1176 for
        Qwen2.5-VL), as preprocess_images / preprocess_video give them.
      grid: int64 [3], (t, h, w) in patches, equal to item["grid"].
    Raises:
      ValueError: naming the file, if it cannot be read or decoded (gone, truncated, not an
        image, over Pillow's decompression-bomb limit), if the grid differs from the stored
        one (the file changed since prepare), or the item's kind is unknown.
    """
    patching = dict(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                    merge_size=merge_size)
    if item["kind"] not in ("image", "video"):
        raise ValueError(f"unknown media kind {item['kind']!r} (image or video)")
    rgbs = []
    for path in item["paths"]:  # decoded here, one by one, so that an error names its file
        try:
            rgbs.append(images_lib.load_image(path))  # [H, W, 3] uint8, as preprocessing's own
        except READ_ERRORS as e:
            raise ValueError(f"{path}: cannot read this {item['kind']} file: {e}") from e
    if item["kind"] == "image":
        pixels, grid = images_lib.preprocess_images(rgbs, min_pixels=image_min_pixels,
                                                    max_pixels=image_max_pixels, **patching)
    else:
        pixels, grid = images_lib.preprocess_video(rgbs, min_pixels=video_min_pixels,
                                                   max_pixels=video_max_pixels, **patching)
    grid = grid[0]
    if grid.tolist() != list(item["grid"]):
        raise ValueError(f"{item['paths'][0]}: its {item['kind']} grid is now "
                         f"{' x '.join(map(str, grid.tolist()))}, the store recorded "
                         f"{' x '.join(map(str, item['grid']))}: the file changed since "
                         f"prepare (or other pixel options were passed); prepare the store again")
    return pixels, grid
