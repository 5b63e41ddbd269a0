"""Qwen2-VL image and video preprocessing (ulysses_jax.data.images) against transformers.

Images: pixel values and grids must equal Qwen2VLImageProcessorPil's exactly (same Pillow
resize, same float64 -> float32 rescale, same float32 normalisation), for every input kind.

Videos: transformers' Qwen2VLVideoProcessor imports torchvision, which is not installed here,
and resizes with torchvision. The reference therefore runs in a subprocess
(tests/qwen2vl_video_reference.py) that puts empty torchvision modules in sys.modules only so
the module imports, then
builds each video from transformers' own pieces: the video module's smart_resize with the video
processor's default sizes, the Pillow backend's resize / rescale / normalize per frame (in place
of torchvision's resize and fused normalisation, the one substitution), and the video
processor's own torch patchify (last-frame padding and patch order). Frame sampling is checked
against the video processor's own sample_frames, which needs only torch.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from ulysses_jax.data import images

# (total_num_frames, video_fps, fps, num_frames); nan for None.
SAMPLING = [(100, 30.0, 2.0, np.nan), (7, 24.0, 2.0, np.nan), (1000, 29.97, 2.0, np.nan),
            (2000, 30.0, 30.0, np.nan), (3000, 30.0, 1.0, np.nan), (64, 8.0, 3.0, np.nan),
            (50, 25.0, np.nan, 10), (50, 25.0, np.nan, 11), (50, 25.0, np.nan, 9),
            (10, 25.0, np.nan, 10), (999, 23.976, np.nan, 64)]
_rng = np.random.default_rng(7)
SAMPLING += [(int(_rng.integers(8, 5000)), float(_rng.choice([23.976, 24, 25, 29.97, 30, 60])),
              float(_rng.choice([0.5, 1, 2, 4])), np.nan) for _ in range(40)]


def _hf_qwen2vl_pil():
    """transformers' Pillow-backend Qwen2-VL image module (the reference), or skip."""
    pytest.importorskip("transformers", reason="transformers is the reference")
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl
    return image_processing_pil_qwen2_vl


def _hf_processor(**kwargs):
    return _hf_qwen2vl_pil().Qwen2VLImageProcessorPil(**kwargs)


def _hf_images(inputs, **kwargs):
    out = _hf_processor(**kwargs)(inputs, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def _assert_same(ours, theirs):
    """Identical grids and bit-identical pixel values (same dtype and shape)."""
    (pv, grid), (ref_pv, ref_grid) = ours, theirs
    np.testing.assert_array_equal(grid, ref_grid)
    assert grid.dtype == np.int64 and pv.dtype == np.float32 == ref_pv.dtype
    assert pv.shape == ref_pv.shape
    np.testing.assert_array_equal(pv, ref_pv)


def _noise(h, w, c=3, seed=0):
    shape = (h, w) if c is None else (h, w, c)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _palette(h, w, transparent=False):
    img = Image.fromarray(_noise(h, w, seed=3)).quantize(16)
    if transparent:
        img.info["transparency"] = 5
    return img


def _rgba(h, w):
    a = _noise(h, w, 4, seed=4)
    a[: h // 3, :, 3] = 0  # fully transparent band
    a[h // 3: h // 2, :, 3] = 255  # fully opaque band
    return a


IMAGE_CASES = {
    "nonsquare_pil": (lambda: Image.fromarray(_noise(45, 97)), {}),
    "tall_array": (lambda: _noise(130, 37, seed=1), {}),
    "below_min_pixels": (lambda: Image.fromarray(_noise(12, 17)), {}),
    "above_max_pixels": (lambda: Image.fromarray(_noise(1050, 1000)), {}),
    "custom_bounds_down": (lambda: _noise(300, 200), dict(min_pixels=28 * 28 * 10,
                                                          max_pixels=28 * 28 * 20)),
    "custom_bounds_up": (lambda: _noise(40, 50), dict(min_pixels=28 * 28 * 30,
                                                      max_pixels=28 * 28 * 60)),
    "rgba_pil": (lambda: Image.fromarray(_rgba(50, 70), "RGBA"), {}),
    "rgba_array": (lambda: _rgba(50, 70), {}),
    "la_pil": (lambda: Image.fromarray(_rgba(50, 70)).convert("LA"), {}),
    "gray_pil": (lambda: Image.fromarray(_noise(60, 45, None)), {}),
    "gray_array_hw1": (lambda: _noise(60, 45, 1), {}),
    "palette": (lambda: _palette(33, 80), {}),
    "palette_transparency": (lambda: _palette(33, 80, transparent=True), {}),
    "patch16_merge2": (lambda: _noise(100, 150), dict(patch_size=16)),
}


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
def test_image_matches_transformers(name):
    make, kwargs = IMAGE_CASES[name]
    _assert_same(images.preprocess_images([make()], **kwargs), _hf_images([make()], **kwargs))


def test_resize_bounds_are_exercised():
    """The size cases really go below min_pixels / above max_pixels and land inside them."""
    checked = 0
    for name, grow in (("below_min_pixels", True), ("above_max_pixels", False),
                       ("custom_bounds_down", False), ("custom_bounds_up", True)):
        make, kwargs = IMAGE_CASES[name]
        img = np.asarray(make())
        _, grid = images.preprocess_images([img], **kwargs)
        area = int(grid[0, 1] * grid[0, 2]) * 14 * 14
        lo = kwargs.get("min_pixels", images.IMAGE_MIN_PIXELS)
        hi = kwargs.get("max_pixels", images.IMAGE_MAX_PIXELS)
        assert lo <= area <= hi
        assert (area > img.shape[0] * img.shape[1]) == grow
        checked += 1
    assert checked == 4


def test_class_defaults_match():
    size = _hf_processor().size
    assert (size["shortest_edge"], size["longest_edge"]) == (images.IMAGE_MIN_PIXELS,
                                                              images.IMAGE_MAX_PIXELS)
    proc = _hf_processor()
    assert tuple(proc.image_mean) == images.CLIP_MEAN and tuple(proc.image_std) == images.CLIP_STD


def test_gray_hw_array_matches_gray_pil():
    """transformers refuses (H, W) arrays; ours equals its result for the same 'L' image."""
    gray = _noise(60, 45, None)
    _assert_same(images.preprocess_images([gray]), _hf_images([Image.fromarray(gray)]))


def _write_files(tmp_path):
    rgb = Image.fromarray(_noise(70, 90, seed=5))
    rgb.save(tmp_path / "rgb.png")
    Image.fromarray(_rgba(64, 48), "RGBA").save(tmp_path / "rgba.png")
    rgb.save(tmp_path / "photo.jpg", quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display upright
    rgb.save(tmp_path / "rotated.jpg", quality=90, exif=exif)
    _palette(33, 80, transparent=True).save(tmp_path / "palette.png")
    return ["rgb.png", "rgba.png", "photo.jpg", "rotated.jpg", "palette.png"]


def test_paths_match_transformers(tmp_path):
    names = _write_files(tmp_path)
    for name in names:
        path = tmp_path / name
        _assert_same(images.preprocess_images([path]), _hf_images([str(path)]))
    rotated = images.load_image(tmp_path / "rotated.jpg")
    assert rotated.shape == (90, 70, 3)  # the EXIF orientation was applied


def test_multi_image_call(tmp_path):
    _write_files(tmp_path)
    mixed = [Image.fromarray(_noise(45, 97)), str(tmp_path / "photo.jpg"), _rgba(50, 70),
             Image.fromarray(_noise(60, 45, None)), _noise(300, 200, seed=9)]
    pv, grid = images.preprocess_images(mixed)
    _assert_same((pv, grid), _hf_images(mixed))
    assert grid.shape == (5, 3)
    counts = images.placeholder_count(grid)
    assert counts.tolist() == [g[1] * g[2] // 4 for g in grid.tolist()]
    assert counts.sum() * 4 == pv.shape[0]
    proc = _hf_processor()
    for k in (0, 2, 3, 4):  # the in-memory ones, whose size is known here
        h, w = np.asarray(mixed[k]).shape[:2]
        assert images.placeholder_count(grid[k]) == proc.get_number_of_image_patches(h, w) // 4


def test_comparison_detects_one_pixel(tmp_path):
    """The comparison can fail: one changed input pixel changes the output."""
    img = _noise(45, 97)
    reference = _hf_images([img])
    changed = img.copy()
    changed[20, 30, 1] ^= 0x40
    with pytest.raises(AssertionError):
        _assert_same(images.preprocess_images([changed]), reference)
    # A transposed image of the same area must not pass for the original either.
    with pytest.raises(AssertionError):
        _assert_same(images.preprocess_images([np.ascontiguousarray(img[::-1])]), reference)


def test_smart_resize_matches_transformers():
    smart_resize = _hf_qwen2vl_pil().smart_resize
    rng = np.random.default_rng(1)
    sizes = [(1, 1), (1, 200), (200, 1), (10, 2000), (27, 29), (28, 28), (42, 42), (14, 70),
             (4000, 3000)]
    sizes += [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(300)]
    bounds = [(images.IMAGE_MIN_PIXELS, images.IMAGE_MAX_PIXELS),
              (images.VIDEO_MIN_PIXELS, images.VIDEO_MAX_PIXELS), (28 * 28 * 4, 28 * 28 * 16)]
    checked = 0
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in bounds:
            for factor in (28, 32):
                assert images.smart_resize(h, w, factor, lo, hi) == smart_resize(
                    h, w, factor, lo, hi), (h, w, factor, lo, hi)
                checked += 1
    assert checked > 1000


def test_aspect_ratio_limit_as_transformers():
    smart_resize = _hf_qwen2vl_pil().smart_resize
    with pytest.raises(ValueError, match=r"10x2010 .*aspect ratio 201\.00.*at most 200"):
        images.smart_resize(10, 2010)
    with pytest.raises(ValueError):
        smart_resize(10, 2010)  # transformers refuses the same image
    assert images.smart_resize(10, 2000) == smart_resize(10, 2000)  # 200 itself is allowed


def test_errors():
    with pytest.raises(ValueError, match="height must be a positive integer, got 0"):
        images.smart_resize(0, 10)
    with pytest.raises(ValueError, match="width must be a positive integer, got -3"):
        images.smart_resize(10, -3)
    with pytest.raises(ValueError, match="min_pixels must be <= max_pixels, got 5000 > 4000"):
        images.smart_resize(10, 10, min_pixels=5000, max_pixels=4000)
    with pytest.raises(ValueError, match="must be uint8.*float32"):
        images.load_image(np.zeros((10, 10, 3), np.float32))
    with pytest.raises(ValueError, match=r"channels-last.*\(3, 20, 30\)"):
        images.load_image(np.zeros((3, 20, 30), np.uint8))
    with pytest.raises(TypeError, match="got int"):
        images.load_image(42)
    with pytest.raises(ValueError, match="at least one image"):
        images.preprocess_images([])
    with pytest.raises(ValueError, match="patch_size must be a positive integer, got 0"):
        images.preprocess_images([_noise(30, 30)], patch_size=0)
    with pytest.raises(ValueError, match="frame 0 is 20x30, frame 1 is 30x20"):
        images.preprocess_video([_noise(20, 30), _noise(30, 20)])
    with pytest.raises(TypeError, match="list of frames"):
        images.preprocess_video("frames/")
    with pytest.raises(ValueError, match="cannot sample 12 frames from a video of 10"):
        images.sample_frame_indices(10, num_frames=12)
    with pytest.raises(ValueError, match="needs the video's own positive video_fps"):
        images.sample_frame_indices(10, fps=2.0)
    with pytest.raises(ValueError, match="not both"):
        images.sample_frame_indices(10, fps=2.0, num_frames=4, video_fps=30.0)
    with pytest.raises(ValueError, match="keeps 0 frames of 1"):
        images.sample_frame_indices(1, video_fps=30.0, fps=2.0)
    with pytest.raises(ValueError, match="multiples of merge_size=2"):
        images.placeholder_count([1, 3, 4])
    with pytest.raises(ValueError, match=r"\(3,\) or \(n, 3\)"):
        images.placeholder_count([1, 2])
    with pytest.raises(ValueError, match="fps must be positive, got 0"):
        images.second_per_grid_ts(0)


def test_missing_file_and_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        images.load_image(tmp_path / "missing.png")
    (tmp_path / "notes.txt").write_text("not a frame")
    with pytest.raises(ValueError, match="no frame images"):
        images.list_frame_files(tmp_path)
    # A video file where a frame folder belongs: say that frames are needed, not "Errno 20".
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    with pytest.raises(ValueError, match=r"clip.mp4 is a file; a video must be a folder of "
                                         r"frame images or a list of frame image files"):
        images.load_video(str(tmp_path / "clip.mp4"))


# --- videos -----------------------------------------------------------------------------------

VIDEO_CASES = {  # name: (frame count, frame height, frame width, min_pixels, max_pixels)
    "three_frames_padded": (3, 40, 56, None, None),
    "four_frames": (4, 50, 36, None, None),
    "five_frames_custom_bounds": (5, 90, 120, 28 * 28 * 8, 28 * 28 * 12),
}


def _video_frames(name):
    n, h, w, _, _ = VIDEO_CASES[name]
    return [_noise(h, w, seed=100 + i) for i in range(n)]


@pytest.fixture(scope="module")
def video_reference(tmp_path_factory):
    """transformers' video outputs, from a subprocess (see the module docstring)."""
    pytest.importorskip("torch", reason="the video processor's patchify and sampling use torch")
    pytest.importorskip("transformers", reason="transformers is the reference")
    folder = tmp_path_factory.mktemp("video_ref")
    arrays = {"sampling": np.array(SAMPLING, dtype=np.float64)}
    for name, (_, _, _, lo, hi) in VIDEO_CASES.items():
        arrays[f"{name}/frames"] = np.stack(_video_frames(name))
        arrays[f"{name}/bounds"] = np.array([lo or 0, hi or 0])  # 0: the processor's default
    np.savez(folder / "in.npz", **arrays)
    script = os.path.join(os.path.dirname(__file__), "qwen2vl_video_reference.py")
    subprocess.run([sys.executable, script, str(folder / "in.npz"), str(folder / "out.npz")],
                   check=True, timeout=120)
    with np.load(folder / "out.npz") as out:
        return {k: out[k] for k in out.files}


def test_video_defaults_match(video_reference):
    assert tuple(video_reference["default_size"]) == (images.VIDEO_MIN_PIXELS,
                                                      images.VIDEO_MAX_PIXELS)


@pytest.mark.parametrize("name", sorted(VIDEO_CASES))
def test_video_matches_transformers(name, video_reference, tmp_path):
    n, _, _, lo, hi = VIDEO_CASES[name]
    frames = _video_frames(name)
    if name == "three_frames_padded":  # given as PNG paths
        for i, frame in enumerate(frames):
            Image.fromarray(frame).save(tmp_path / f"f{i}.png")
        frames = [tmp_path / f"f{i}.png" for i in range(n)]
    elif name == "four_frames":  # given as PIL images
        frames = [Image.fromarray(f) for f in frames]
    pv, grid = images.preprocess_video(frames, min_pixels=lo, max_pixels=hi)
    _assert_same((pv, grid), (video_reference[f"{name}/pv"], video_reference[f"{name}/grid"]))
    assert grid[0, 0] == math.ceil(n / 2)
    assert images.placeholder_count(grid[0]) * 4 == pv.shape[0]


def test_video_padding_repeats_last_frame():
    """3 frames give the patches of 4 frames whose last two are the same frame."""
    frames = _video_frames("three_frames_padded")
    padded, grid3 = images.preprocess_video(frames)
    explicit, grid4 = images.preprocess_video(frames + frames[-1:])
    np.testing.assert_array_equal(grid3, grid4)
    np.testing.assert_array_equal(padded, explicit)


def test_video_frame_equals_image_framewise():
    """A video of one frame repeated is that frame processed as an image, same bounds."""
    frame = _noise(50, 36, seed=11)
    bounds = dict(min_pixels=images.VIDEO_MIN_PIXELS, max_pixels=images.VIDEO_MAX_PIXELS)
    video = images.preprocess_video([frame, frame], **bounds)
    _assert_same(video, _hf_images([frame], **bounds))


def test_sampling_matches_transformers(video_reference):
    checked = 0
    for j, (total, video_fps, fps, num_frames) in enumerate(SAMPLING):
        ours = images.sample_frame_indices(
            total, video_fps=video_fps, fps=None if np.isnan(fps) else fps,
            num_frames=None if np.isnan(num_frames) else int(num_frames))
        np.testing.assert_array_equal(ours, video_reference[f"sample{j}"],
                                      err_msg=str(SAMPLING[j]))
        ref_fps = float(video_reference[f"sample{j}_fps"])
        np.testing.assert_allclose(len(ours) / total * video_fps, ref_fps, rtol=1e-15)
        # Qwen2.5-VL's processor: second_per_grid_ts = temporal_patch_size / sampled fps.
        assert images.second_per_grid_ts(ref_fps) == 2 / ref_fps
        checked += 1
    assert checked == len(SAMPLING)
    np.testing.assert_array_equal(images.sample_frame_indices(5), np.arange(5))


def test_load_video_folder(tmp_path):
    frames = [_noise(20, 30, seed=200 + i) for i in range(12)]
    for i, frame in enumerate(frames):  # natural order: frame_2 before frame_10
        Image.fromarray(frame).save(tmp_path / f"frame_{i}.png")
    got, fps = images.load_video(tmp_path)
    assert len(got) == 12 and fps == images.UNKNOWN_FPS
    assert all(np.array_equal(a, b) for a, b in zip(got, frames))
    got, fps = images.load_video(tmp_path, video_fps=6.0, fps=2.0)
    idx = images.sample_frame_indices(12, video_fps=6.0, fps=2.0)
    assert idx.tolist() == [0, 3, 6, 9] and fps == 2.0
    assert all(np.array_equal(got[k], frames[i]) for k, i in enumerate(idx))
    assert images.second_per_grid_ts(fps) == 1.0
    got, _ = images.load_video([tmp_path / "frame_1.png", tmp_path / "frame_0.png"])
    assert np.array_equal(got[0], frames[1])
