"""transformers' Qwen2-VL video outputs for tests/test_images.py, run as a subprocess.

Usage: python qwen2vl_video_reference.py IN.npz OUT.npz

Qwen2VLVideoProcessor's module imports torchvision, which is not installed here. Empty
torchvision modules go into sys.modules (in this throwaway process only) so that the module
imports; nothing from them is called. Per case the video is built from transformers' own
pieces: the video module's smart_resize with the video processor's default sizes, the Pillow
backend's resize / rescale / normalize per frame (where the video processor would call
torchvision's resize and its fused normalisation), and the video processor's torch patchify,
which pads the frame count and orders the patches. Frame sampling is the video processor's own
sample_frames, the sampled fps VideoMetadata's.

IN holds ``sampling`` rows (total_num_frames, video_fps, fps, num_frames; nan for None) and,
per case, ``NAME/frames`` uint8 [T, H, W, 3] and ``NAME/bounds`` (min_pixels, max_pixels; 0 for
the default). OUT holds ``default_size``, ``NAME/pv``, ``NAME/grid``, ``sampleJ`` and
``sampleJ_fps``.
"""
import importlib
import sys
import types
from types import SimpleNamespace

import numpy as np

TV_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
              "torchvision.transforms.v2.functional")


def main(inp, out):
    # transformers looks for torchvision while these import; that must happen before the stub.
    importlib.import_module("transformers.video_processing_utils")
    for name in TV_MODULES:
        sys.modules.setdefault(name, types.ModuleType(name))
    import torch
    from transformers.image_utils import PILImageResampling, SizeDict
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    from transformers.video_utils import VideoMetadata
    video = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    cls = video.Qwen2VLVideoProcessor
    pil = Qwen2VLImageProcessorPil()
    results = {"default_size": np.array([cls.size["shortest_edge"], cls.size["longest_edge"]])}
    with np.load(inp) as data:
        names = sorted({key.split("/")[0] for key in data.files if "/" in key})
        for name in names:
            frames, (lo, hi) = data[f"{name}/frames"], data[f"{name}/bounds"]
            lo, hi = int(lo) or cls.size["shortest_edge"], int(hi) or cls.size["longest_edge"]
            h, w = video.smart_resize(frames.shape[1], frames.shape[2], factor=28,
                                      min_pixels=lo, max_pixels=hi)
            normed = []
            for frame in frames:
                # The Pillow backend's own resize (PilBackend.resize), to the video's size.
                x = super(Qwen2VLImageProcessorPil, pil).resize(
                    np.moveaxis(frame, -1, 0), SizeDict(height=h, width=w),
                    resample=PILImageResampling.BICUBIC)
                x = pil.normalize(pil.rescale(x, 1 / 255), pil.image_mean, pil.image_std)
                normed.append(x)  # [C, h, w]
            stacked = torch.from_numpy(np.stack(normed))[None]  # [1, T, C, h, w]
            patches, gt, gh, gw = cls.patchify(None, stacked, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
            results[f"{name}/pv"] = patches[0].numpy()
            results[f"{name}/grid"] = np.array([[gt, gh, gw]], dtype=np.int64)
        defaults = SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2,
                                   min_frames=4, max_frames=768)
        for j, (total, video_fps, fps, num_frames) in enumerate(data["sampling"]):
            meta = VideoMetadata(total_num_frames=int(total), fps=float(video_fps))
            idx = cls.sample_frames(defaults, meta, fps=None if np.isnan(fps) else float(fps),
                                    num_frames=None if np.isnan(num_frames) else int(num_frames))
            meta.frames_indices = idx
            results[f"sample{j}"] = idx.numpy().astype(np.int64)
            results[f"sample{j}_fps"] = np.float64(meta.sampled_fps)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
