"""Qwen2-VL / Qwen2.5-VL image and video preprocessing with Pillow and numpy only.

Reproduces transformers' (5.24) Pillow image processor ``Qwen2VLImageProcessorPil`` and the
frame layout of ``Qwen2VLVideoProcessor``, so that training data made from chat messages holding
image and frame paths need neither torch nor transformers at run time. Per image:

1. To RGB uint8. A PIL image with alpha (an A band or a transparency key) is composited onto
   white, others converted. A path is opened, turned upright by its EXIF orientation and
   converted with ``convert("RGB")`` first, as transformers' ``load_image`` does for paths: an
   alpha band is dropped there (not composited), a transparency key survives and whitens. A
   uint8 array (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) is grey-expanded or blended onto
   white with ``round(a * rgb + (1 - a) * 255)``, a = alpha / 255.
2. ``smart_resize`` picks (h, w), both multiples of ``patch_size * merge_size``, with h * w in
   [min_pixels, max_pixels] and the aspect ratio nearly kept; the uint8 RGB image is resized to
   it by Pillow's BICUBIC filter (no reducing gap).
3. x / 255 in float64, cast to float32, then (x - mean) / std in float32 with OpenAI CLIP's
   mean and std: the same operations in the same precision, so the values are bit-identical.
4. Patches of C x temporal_patch_size x patch_size x patch_size values, ordered by merge block
   (row-major over the grid of merge_size x merge_size blocks), then row-major inside a block;
   an image is its own frame repeated temporal_patch_size times. A video's frame count is
   padded to a multiple of temporal_patch_size with copies of its last frame; its patches run
   over time groups first, then the same spatial order.

The placeholder count per image or video is t * h * w / merge_size**2 <|image_pad|> or
<|video_pad|> tokens; Qwen2.5-VL's ``second_per_grid_ts`` is temporal_patch_size / fps of the
sampled frames (24 when the fps is unknown, transformers' fallback).

Limits and differences, all deliberate:
- transformers' video processor, and its image processor when torchvision is installed
  (AutoImageProcessor then picks the torchvision backend), resize with torchvision's
  antialiased bicubic on uint8 tensors and fuse rescale and normalise; here frames go through
  the Pillow path above, so values can differ from torchvision's by resize rounding (the tests
  compare with the Pillow backend and with the video processor's own padding, patch order and
  frame sampling). transformers' video path turns PIL frames into arrays with np.array, without
  PIL's mode conversion; here every frame follows the image rule of step 1.
- Arrays must be uint8 and channels-last; transformers guesses the channel axis (a 3 x W x 3
  image counts as channels-first) and refuses (H, W) arrays.
- No video decoding: a video is a folder or list of frame images. ``load_video`` samples such
  frames with Qwen2VLVideoProcessor.sample_frames' rule for a decoded video (transformers refuses
  to sample a list of images). Qwen2-VL's optional ``cap_pixels_per_frame`` budget is not
  implemented.
- Defaults are the processor classes' (images 56*56 .. 28*28*1280 pixels, videos
  128*28*28 .. 768*28*28); a checkpoint's preprocessor_config.json may set others (Qwen2.5-VL
  setups commonly use max_pixels=12845056, 16384 merged tokens; not checked here), so read the
  checkpoint's values and pass them.
- Refused here where transformers fails less clearly or not at all: non-positive sizes (it
  divides by zero), min_pixels > max_pixels, frames of different sizes in one video.
"""
from __future__ import annotations

import math
import os
import re
from typing import Sequence

import numpy as np
from PIL import Image, ImageOps

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_ASPECT_RATIO = 200
UNKNOWN_FPS = 24.0  # transformers' VideoMetadata.sampled_fps when a video's fps is not known
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """The size Qwen2-VL resizes an image to.

    Each side is rounded to a multiple of ``factor``; if the area then exceeds ``max_pixels``
    both sides are scaled down by the same ratio and floored to multiples of ``factor`` (never
    below ``factor``), if it falls short of ``min_pixels`` they are scaled up and ceiled.

    Args:
        height, width: the input size in pixels, positive.
        factor: patch_size * merge_size.
        min_pixels, max_pixels: the area bounds, 0 < min_pixels <= max_pixels.
    Returns:
        (h, w), multiples of ``factor``.
    Raises:
        ValueError: a non-positive size, factor or bound, min_pixels > max_pixels, or an aspect
        ratio max(h, w) / min(h, w) over 200 (transformers refuses those too).
    """
    for name, value in (("height", height), ("width", width), ("factor", factor),
                        ("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels must be <= max_pixels, got {min_pixels} > {max_pixels}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {height}x{width} (height x width) has aspect ratio "
                         f"{ratio:.2f}; max(height, width) / min(height, width) must be at "
                         f"most {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor  # Python's round: halves go to the even multiple
    w = round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def load_image(image) -> np.ndarray:
    """An image as RGB uint8, converted as transformers converts each kind of input.

    Args:
        image: a path (str or os.PathLike), a PIL image, or a uint8 array (H, W), (H, W, 1),
            (H, W, 3) or (H, W, 4), channels last.
    Returns:
        uint8 array [H, W, 3].
    """
    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as opened:
            # transformers' load_image: upright, then convert("RGB"), which drops an alpha band
            # but keeps a palette's transparent entry as a colour key (info["transparency"]),
            # so the PIL rule below still whitens those pixels.
            image = ImageOps.exif_transpose(opened).convert("RGB")
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
        return np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image arrays must be uint8 (0..255), got dtype {image.dtype}")
        if image.ndim == 2:
            image = image[:, :, None]
        if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
            raise ValueError("image arrays must be (H, W) or channels-last (H, W, C) with C in "
                             f"1, 3, 4; got shape {image.shape}")
        if image.shape[2] == 1:
            return np.repeat(image, 3, axis=2)
        if image.shape[2] == 4:
            alpha = image[:, :, 3:] / 255  # float64
            blended = alpha * image[:, :, :3] + (1 - alpha) * 255
            return np.round(blended).astype(np.uint8)
        return np.ascontiguousarray(image)
    raise TypeError("an image must be a path, a PIL image or a uint8 numpy array, got "
                    f"{type(image).__name__}")


def _resize_normalize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H0, W0, 3] uint8 -> [height, width, 3] float32, resized, scaled to [0, 1], normalised."""
    resized = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))
    # float64 product then float32, as transformers rescales; the normalisation runs in float32.
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)


def _patchify(frames: np.ndarray, patch_size: int, temporal_patch_size: int,
              merge_size: int) -> np.ndarray:
    """[T, H, W, C] -> [T/tp * H/p * W/p, C * tp * p * p], T a multiple of tp."""
    t, h, w, c = frames.shape
    p, tp, m = patch_size, temporal_patch_size, merge_size
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
    # (gt, tp, bh, mh, ph, bw, mw, pw, C) -> (gt, bh, bw, mh, mw, C, tp, ph, pw)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return x.reshape(gt * gh * gw, c * tp * p * p)


def _check_patching(patch_size: int, temporal_patch_size: int, merge_size: int) -> None:
    for name, value in (("patch_size", patch_size), ("temporal_patch_size", temporal_patch_size),
                        ("merge_size", merge_size)):
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def preprocess_images(images, *, min_pixels: int | None = None, max_pixels: int | None = None,
                      patch_size: int = 14, temporal_patch_size: int = 2,
                      merge_size: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL's ``pixel_values`` and ``image_grid_thw`` for images, as Qwen2VLImageProcessorPil.

    Args:
        images: one image or a list of them (paths, PIL images, uint8 arrays; see load_image).
        min_pixels, max_pixels: area bounds for smart_resize; None takes the processor's
            defaults IMAGE_MIN_PIXELS and IMAGE_MAX_PIXELS.
        patch_size, temporal_patch_size, merge_size: the vision tower's patching.
    Returns:
        pixel_values: float32 [sum of h*w over images, 3 * temporal_patch_size * patch_size**2],
            the images' patches concatenated in order.
        image_grid_thw: int64 [n_images, 3], rows (1, h, w) in patches.
    """
    if isinstance(images, (str, os.PathLike, Image.Image, np.ndarray)):
        images = [images]
    if len(images) == 0:
        raise ValueError("preprocess_images needs at least one image, got an empty list")
    _check_patching(patch_size, temporal_patch_size, merge_size)
    min_pixels = IMAGE_MIN_PIXELS if min_pixels is None else min_pixels
    max_pixels = IMAGE_MAX_PIXELS if max_pixels is None else max_pixels
    patches, grids = [], []
    for image in images:
        rgb = load_image(image)  # [H0, W0, 3]
        h, w = smart_resize(rgb.shape[0], rgb.shape[1], patch_size * merge_size,
                            min_pixels, max_pixels)
        x = _resize_normalize(rgb, h, w)  # [h, w, 3]
        frames = np.broadcast_to(x, (temporal_patch_size, h, w, 3))  # [tp, h, w, 3]
        patches.append(_patchify(frames, patch_size, temporal_patch_size, merge_size))
        grids.append((1, h // patch_size, w // patch_size))
    return np.concatenate(patches), np.array(grids, dtype=np.int64)


def preprocess_video(frames: Sequence, *, min_pixels: int | None = None,
                     max_pixels: int | None = None, patch_size: int = 14,
                     temporal_patch_size: int = 2,
                     merge_size: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL's ``pixel_values_videos`` and ``video_grid_thw`` for one video.

    Args:
        frames: the video's frames in order (paths, PIL images, uint8 arrays), all of one size.
            All are used; sample first (``load_video``) to thin them out.
        min_pixels, max_pixels: per-frame area bounds; None takes the video processor's
            defaults VIDEO_MIN_PIXELS and VIDEO_MAX_PIXELS.
        patch_size, temporal_patch_size, merge_size: the vision tower's patching.
    Returns:
        pixel_values_videos: float32 [t*h*w, 3 * temporal_patch_size * patch_size**2].
        video_grid_thw: int64 [1, 3], the row (t, h, w); t = ceil(n_frames / temporal_patch_size).
    """
    if isinstance(frames, (str, os.PathLike, Image.Image, np.ndarray)):
        raise TypeError("preprocess_video takes a list of frames; use load_video for a folder")
    if len(frames) == 0:
        raise ValueError("preprocess_video needs at least one frame, got an empty list")
    _check_patching(patch_size, temporal_patch_size, merge_size)
    min_pixels = VIDEO_MIN_PIXELS if min_pixels is None else min_pixels
    max_pixels = VIDEO_MAX_PIXELS if max_pixels is None else max_pixels
    rgbs = [load_image(frame) for frame in frames]
    for i, rgb in enumerate(rgbs):
        if rgb.shape != rgbs[0].shape:
            raise ValueError(f"all frames of a video must have one size; frame 0 is "
                             f"{rgbs[0].shape[0]}x{rgbs[0].shape[1]}, frame {i} is "
                             f"{rgb.shape[0]}x{rgb.shape[1]}")
    h, w = smart_resize(rgbs[0].shape[0], rgbs[0].shape[1], patch_size * merge_size,
                        min_pixels, max_pixels)
    pad = -len(rgbs) % temporal_patch_size
    xs = [_resize_normalize(rgb, h, w) for rgb in rgbs]  # each [h, w, 3]
    video = np.stack(xs + xs[-1:] * pad)  # [T, h, w, 3], T a multiple of tp
    patches = _patchify(video, patch_size, temporal_patch_size, merge_size)
    grid = np.array([[video.shape[0] // temporal_patch_size, h // patch_size, w // patch_size]],
                    dtype=np.int64)
    return patches, grid


def sample_frame_indices(total_num_frames: int, *, video_fps: float | None = None,
                         fps: float | None = None, num_frames: int | None = None,
                         temporal_patch_size: int = 2, min_frames: int = 4,
                         max_frames: int = 768) -> np.ndarray:
    """Which frames of a decoded video Qwen2VLVideoProcessor.sample_frames keeps.

    With ``num_frames`` it keeps that many (rounded to a multiple of temporal_patch_size); with
    ``fps`` (needs ``video_fps``) it keeps duration * fps, clamped to [min_frames, max_frames]
    and to the video, floored to a multiple of temporal_patch_size; with neither, all frames.
    Kept frames are evenly spaced: index i * (total / n) in float64, rounded to float32 and
    truncated, as torch.arange(0, total, total / n).int() computes it, so the indices match.

    Args:
        total_num_frames: frames in the video.
        video_fps: the video's frame rate (only needed with ``fps``).
        fps, num_frames: the sampling target, at most one of them.
        temporal_patch_size, min_frames, max_frames: as the video processor's.
    Returns:
        int64 [n] frame indices, increasing.
    """
    if int(total_num_frames) != total_num_frames or total_num_frames <= 0:
        raise ValueError(f"total_num_frames must be a positive integer, got {total_num_frames!r}")
    if fps is not None and num_frames is not None:
        raise ValueError(f"give fps or num_frames, not both (got fps={fps}, "
                         f"num_frames={num_frames})")
    tp = temporal_patch_size
    if num_frames is not None:
        n = round(num_frames / tp) * tp
    elif fps is not None:
        if video_fps is None or video_fps <= 0:
            raise ValueError(f"sampling at fps={fps} needs the video's own positive video_fps, "
                             f"got {video_fps!r}")
        cap = math.floor(min(max_frames, total_num_frames) / tp) * tp
        n = min(max(total_num_frames / video_fps * fps, min_frames), cap, total_num_frames)
        n = math.floor(n / tp) * tp
    else:
        return np.arange(total_num_frames, dtype=np.int64)
    if n <= 0:
        raise ValueError(f"sampling keeps {n} frames of {total_num_frames} (fps={fps}, "
                         f"num_frames={num_frames}, temporal_patch_size={tp}); it must keep at "
                         f"least temporal_patch_size frames")
    if n > total_num_frames:
        raise ValueError(f"cannot sample {n} frames from a video of {total_num_frames}; lower "
                         f"num_frames or fps")
    step = total_num_frames / n
    count = math.ceil(total_num_frames / step)
    # start + i * step in float64, stored as float32, truncated: torch.arange(...).int().
    return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int64)


def list_frame_files(folder: str | os.PathLike) -> list[str]:
    """The image files of a frame folder in natural order (frame_2 before frame_10).

    Raises:
      ValueError: ``folder`` is a file (a video file: videos are not decoded here) or holds
        no frame image. OSError: it does not exist.
    """
    if os.path.isfile(folder):
        raise ValueError(f"{folder} is a file; a video must be a folder of frame images or a "
                         f"list of frame image files ({', '.join(FRAME_EXTENSIONS)}): video "
                         f"files are not decoded here, so extract the frames first (e.g. "
                         f"ffmpeg -i clip.mp4 clip/%05d.jpg) and give the folder with the "
                         f"video's \"fps\"")
    names = [n for n in os.listdir(folder) if n.lower().endswith(FRAME_EXTENSIONS)]
    if not names:
        raise ValueError(f"no frame images ({', '.join(FRAME_EXTENSIONS)}) in {folder}")
    return [os.path.join(folder, n) for n in sorted(names, key=_natural_key)]


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def load_video(source, *, video_fps: float | None = None, fps: float | None = None,
               num_frames: int | None = None, temporal_patch_size: int = 2,
               min_frames: int = 4, max_frames: int = 768) -> tuple[list[np.ndarray], float]:
    """A video stored as frame images: its sampled frames and their frame rate.

    Args:
        source: a folder of frame images (natural filename order) or a list of frame paths.
        video_fps: the frame rate the frames were taken at, if known.
        fps, num_frames, temporal_patch_size, min_frames, max_frames: sampling, as
            ``sample_frame_indices``; neither fps nor num_frames keeps every frame.
    Returns:
        frames: RGB uint8 arrays [H, W, 3], the kept frames in order.
        sampled_fps: the kept frames' rate, video_fps * kept / total (UNKNOWN_FPS if
            video_fps is None), the number ``second_per_grid_ts`` wants.
    """
    paths = list_frame_files(source) if isinstance(source, (str, os.PathLike)) else list(source)
    if not paths:
        raise ValueError("load_video needs at least one frame path, got an empty list")
    indices = sample_frame_indices(len(paths), video_fps=video_fps, fps=fps,
                                   num_frames=num_frames, temporal_patch_size=temporal_patch_size,
                                   min_frames=min_frames, max_frames=max_frames)
    frames = [load_image(paths[i]) for i in indices]
    sampled_fps = UNKNOWN_FPS if video_fps is None else len(indices) / len(paths) * video_fps
    return frames, sampled_fps


def second_per_grid_ts(fps: float | None, temporal_patch_size: int = 2) -> float:
    """Seconds spanned by one temporal patch, Qwen2.5-VL's ``second_per_grid_ts`` for a video.

    Args:
        fps: frame rate of the frames given to preprocess_video (``load_video``'s
            sampled_fps); None means unknown and takes transformers' fallback of 24.
        temporal_patch_size: frames per temporal patch.
    Returns:
        temporal_patch_size / fps.
    """
    fps = UNKNOWN_FPS if fps is None else fps
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    return temporal_patch_size / fps


def placeholder_count(grid_thw, merge_size: int = 2):
    """How many <|image_pad|> / <|video_pad|> tokens stand for an image or video in the text.

    Args:
        grid_thw: one (t, h, w) row or an [n, 3] array of them (image_grid_thw, video_grid_thw).
        merge_size: the spatial merge of the vision tower; h and w must be multiples of it.
    Returns:
        t * h * w // merge_size**2: an int for one row, int64 [n] for n rows.
    """
    grid = np.asarray(grid_thw, dtype=np.int64)
    if grid.shape[-1:] != (3,) or grid.ndim > 2:
        raise ValueError(f"grid_thw must be (3,) or (n, 3), got shape {grid.shape}")
    if np.any(grid[..., 1:] % merge_size):
        raise ValueError(f"grid h and w must be multiples of merge_size={merge_size}, got "
                         f"{grid.tolist()}")
    counts = grid.prod(axis=-1) // merge_size ** 2
    return int(counts) if grid.ndim == 1 else counts
