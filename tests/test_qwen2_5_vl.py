"""Qwen2.5-VL (``model.family=qwen2_5_vl``) against transformers' own model.

Host-side inputs: the tower's window order, segments and 2-D RoPE positions equal
transformers' ``vision_utils`` functions, and the M-RoPE positions its ``get_rope_index``, for
images, multi-frame videos (with second_per_grid_ts) and non-square grids.

Model: a tiny random ``Qwen2_5_VLForConditionalGeneration`` (3 vision blocks, one of them
full attention; 2 decoder layers) written by transformers, imported on 1, 2 and 4 devices:
logits and loss for a row whose image straddles the shard boundaries and whose two-frame
video straddles another, beside a row with no image (relative 1e-4); images in one shard only
(every other shard runs the same program without one); packed documents with images equal
each document alone; gradients of the vision weights; both key layouts on disk; export round
trip; the ``compare hf`` tool on the checkpoint; refusals; greedy generation of an image and
video prompt against transformers' generate.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.utils.devices import need_devices
from tests.utils.numerics import rel_error
from tests.utils.torch_models import randomize
from ulysses_jax import make_mesh
from ulysses_jax.config import ConfigError, LoraConfig, load_config
from ulysses_jax.hf import config_from_hf, from_pretrained, save_pretrained, to_hf_tensors
from ulysses_jax.models import multimodal
from ulysses_jax.training.objectives.sft import objective

torch = pytest.importorskip("torch", reason="torch is needed to build reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers is needed as reference")
from transformers import vision_utils  # noqa: E402

V, S, B = 300, 64, 2
IMG, VID, VSTART, VEND = 290, 291, 292, 293
K = 3 * 2 * 14 * 14  # values of one flattened patch
TOL = 1e-4
HF_CONFIG = dict(
    text_config=dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                     max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                      "rope_theta": 10000.0}),
    # window_size 56 = 2 x 2 units per window, so the grids below hold several windows
    vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48,
                       out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                       tokens_per_second=2),
    image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
    vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(**HF_CONFIG))
    randomize(model, 0, vector_mean=0.0)
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return _hf_load(checkpoint)


def _hf_load(path):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()


def _media(rng, grids):
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    return rng.standard_normal((int(grids.prod(-1).sum()), K)).astype(np.float32), grids


def _place(row, at, token, n):
    """Puts <vision_start>, n placeholders, <vision_end> into ``row`` from ``at``."""
    row[at] = VSTART
    row[at + 1:at + 1 + n] = token
    row[at + 1 + n] = VEND


def _text(rng, b=B, s=S):
    return rng.integers(0, 280, (b, s)).astype(np.int32)


def _straddling_inputs(seed=0):
    """Row 0: an image of 4 x 6 units (6 windows) over tokens 13..36, across the boundaries at
    16 and 32 (P = 2 and 4), then a two-frame video of 2 x 2 x 2 units across 48; row 1: text
    only."""
    rng = np.random.default_rng(seed)
    tokens = _text(rng)
    _place(tokens[0], 12, IMG, 24)
    _place(tokens[0], 42, VID, 8)
    pix, grid = _media(rng, [[1, 8, 12]])
    vpix, vgrid = _media(rng, [[2, 4, 4]])
    return tokens, dict(pixel_values=pix, image_grid_thw=grid, pixel_values_videos=vpix,
                        video_grid_thw=vgrid, second_per_grid_ts=np.array([0.75]))


def _hf_forward(model, tokens, images, labels=True):
    mm = np.where(tokens == IMG, 1, np.where(tokens == VID, 2, 0))
    t = torch.from_numpy(tokens).long()
    kw = {k: torch.from_numpy(np.asarray(v)) for k, v in images.items() if v is not None}
    return model(input_ids=t, labels=t if labels else None,
                 mm_token_type_ids=torch.from_numpy(mm), **kw)


def _batch(model, tokens, images, segment_ids=None):
    b, s = tokens.shape
    positions, vision = multimodal.prepare(tokens, model.cfg, segment_ids=segment_ids,
                                           shards=model.visual.shards(), **images)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
            "loss_mask": np.concatenate([np.ones((b, s - 1)), np.zeros((b, 1))], 1),
            "segment_ids": np.ones((b, s), np.int32) if segment_ids is None else segment_ids,
            "positions": positions, "vision": vision}


def _ours(model, tokens, images, mesh, segment_ids=None):
    """Our logits and objective; targets pre-shifted, the last position unscored."""
    batch = _batch(model, tokens, images, segment_ids)
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, batch):
        obj, _ = objective(graphdef, params, batch, mesh)
        logits = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"],
                                             batch["segment_ids"], batch["vision"])
        return logits, obj

    return [np.asarray(x) for x in run(params, batch)]


def _call(model, *args, **images):
    """``model(*args, **images)`` as one program: the arguments are concrete while it is
    traced, so keyword images are prepared on the host as in an eager call."""
    graphdef, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(*args, **images))(params))


# ----------------------------------------------------------------- host-side inputs

@pytest.mark.parametrize("grids", [[[1, 8, 12]], [[2, 4, 4], [1, 6, 10]], [[3, 10, 6]],
                                   [[1, 4, 4]]])
def test_vision_layout_matches_transformers(grids):
    cfg = config_from_hf({"model_type": "qwen2_5_vl", **HF_CONFIG})
    v = cfg.vision
    g = torch.tensor(grids)
    ours = multimodal.vision_layout(np.array(grids), v)
    window_index, cu_windows = vision_utils.get_vision_window_index(
        g, v.spatial_merge_size, v.window_size, v.patch_size)
    cu_frames = vision_utils.get_vision_cu_seqlens(g)
    hw = vision_utils.get_vision_position_ids(g, v.spatial_merge_size).numpy()
    m2 = v.spatial_merge_size ** 2
    order = (window_index.numpy()[:, None] * m2 + np.arange(m2)).reshape(-1)
    np.testing.assert_array_equal(ours["order"], order)
    np.testing.assert_array_equal(ours["rope_hw"], hw[order])
    np.testing.assert_array_equal(ours["unit_order"], torch.argsort(window_index).numpy())
    for name, cu in (("window_segments", cu_windows), ("frame_segments", cu_frames)):
        sizes = np.diff(cu.numpy())
        np.testing.assert_array_equal(ours[name], np.repeat(np.arange(1, len(sizes) + 1), sizes))
    # windows of 2 x 2 units: t x ceil(rows / 4) x ceil(columns / 4) per image (4 patches)
    assert ours["window_segments"].max() == sum(t * -(-h // 4) * -(-w // 4) for t, h, w in grids)


def test_rope_index_matches_transformers(hf_model):
    tokens, images = _straddling_inputs(1)
    images["second_per_grid_ts"] = np.array([1.3])  # non-integer interval, floored
    ours = multimodal.rope_index(tokens, hf_model_config(), images["image_grid_thw"],
                                 images["video_grid_thw"], images["second_per_grid_ts"])
    mm = np.where(tokens == IMG, 1, np.where(tokens == VID, 2, 0))
    want, _ = hf_model.model.get_rope_index(
        torch.from_numpy(tokens).long(), torch.from_numpy(mm),
        torch.from_numpy(images["image_grid_thw"]), torch.from_numpy(images["video_grid_thw"]),
        torch.tensor([1.3]))
    np.testing.assert_array_equal(ours, want.numpy().transpose(1, 2, 0))
    assert ours[0, 43:51, 0].max() > ours[0, 43, 0] > 0  # the video's frames move in time
    np.testing.assert_array_equal(ours[1], np.arange(S)[:, None].repeat(3, 1))


def test_video_rope_index_matches_transformers_at_many_rates(hf_model):
    """600 sampled rates (0.1 to 60 fps), 200 temporal patches each: second_per_grid_ts =
    2 / fps as the store holds it (float64) for us, as the processor returns it (a float32
    tensor) for transformers. Computed in float64, 64 of the rates would differ somewhere."""
    t, seconds = 200, 2 / (np.arange(1, 601) / 10)
    tokens = np.full((len(seconds), t + 2), 5, np.int32)
    tokens[:, 1:-1] = VID  # one unit per temporal patch (grid 2 x 2 patches)
    grids = np.tile([[t, 2, 2]], (len(seconds), 1))
    ours = multimodal.rope_index(tokens, hf_model_config(), None, grids, seconds)
    want, _ = hf_model.model.get_rope_index(
        torch.from_numpy(tokens).long(), torch.from_numpy(np.where(tokens == VID, 2, 0)), None,
        torch.from_numpy(grids), torch.tensor(seconds.tolist()))
    np.testing.assert_array_equal(ours, want.numpy().transpose(1, 2, 0))
    in_float64 = 1 + (np.arange(t) * (2 * seconds[:, None])).astype(np.int64)  # [600, t]
    assert (in_float64 != ours[:, 1:-1, 0]).any(1).sum() == 64


def test_vision_layout_refuses_bad_groups_and_slots():
    v, grid = hf_model_config().vision, np.array([[1, 4, 4]])  # 16 patches
    with pytest.raises(ValueError, match=r"capacity \(patch slots per group\) must be a non-"
                                         r"negative multiple of model.vision.spatial_merge_size"
                                         r"\^2 = 4.*got 18"):
        multimodal.vision_layout(grid, v, capacity=18)
    with pytest.raises(ValueError, match="shards .* must be a positive integer, got 0"):
        multimodal.vision_layout(grid, v, shards=0)
    # Only a real overflow is a CapacityError (the one a larger slot budget cures).
    with pytest.raises(multimodal.CapacityError, match="1 group.* of 12 slots: the fullest "
                                                       "group needs 16"):
        multimodal.vision_layout(grid, v, capacity=12)


def test_frames_are_dealt_whole_to_balanced_groups():
    """shards=4: every frame's patches sit inside one group, in window order; the groups'
    loads are as even as whole frames allow; padding is its own segment; unit_order still
    lists the units in their original order first."""
    v = hf_model_config().vision
    grids = np.array([[3, 4, 8], [1, 8, 12], [1, 4, 4]])   # frames of 32, 32, 32, 96, 16 patches
    one = multimodal.vision_layout(grids, v)
    four = multimodal.vision_layout(grids, v, shards=4)
    cap = len(four["order"]) // 4
    assert cap == 96  # the 96-patch image alone; the other frames share the other groups
    groups = four["order"].reshape(4, cap)
    frames = four["frame_segments"].reshape(4, cap)
    for f in np.unique(four["frame_segments"]):
        if f < multimodal.PAD_SEGMENT:
            assert len({g for g in range(4) if (frames[g] == f).any()}) == 1
    # largest first, each to the least-filled group: 96 | 32 + 16 | 32 | 32
    assert sorted((g >= 0).sum() for g in groups) == [32, 32, 48, 96]
    real = four["order"] >= 0
    assert sorted(four["order"][real]) == sorted(one["order"])
    # each frame's patches keep the window order of the one-group layout
    for f in range(1, 6):
        np.testing.assert_array_equal(four["order"][four["frame_segments"] == f],
                                      one["order"][one["frame_segments"] == f])
    u = len(one["unit_order"])
    slot_first_patch = four["order"][::4][four["unit_order"][:u]]
    np.testing.assert_array_equal(slot_first_patch, np.arange(u) * 4)
    pad = four["window_segments"][~real]
    np.testing.assert_array_equal(pad, multimodal.PAD_SEGMENT + np.flatnonzero(~real) // 256)
    np.testing.assert_array_equal(four["frame_segments"][~real], pad)
    with pytest.raises(ValueError, match="fullest group needs 96"):
        multimodal.vision_layout(grids, v, shards=4, capacity=64)


def hf_model_config():
    return config_from_hf({"model_type": "qwen2_5_vl", **HF_CONFIG})


# ----------------------------------------------------------------------------- the model

def test_checkpoint_is_what_it_claims(checkpoint):
    cfg = config_from_hf(json.load(open(os.path.join(checkpoint, "config.json"))))
    assert cfg.family == "qwen2_5_vl" and cfg.qkv_bias and cfg.mrope_section == (2, 3, 3)
    v = cfg.vision
    assert (v.depth, v.hidden_size, v.num_heads, v.window_size) == (3, 32, 2, 56)
    assert v.fullatt_block_indexes == (1,) and (cfg.image_token_id, cfg.video_token_id) == (
        IMG, VID)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_import_matches_transformers(checkpoint, hf_model, p):
    tokens, images = _straddling_inputs(p)
    with torch.no_grad():
        out = _hf_forward(hf_model, tokens, images)
    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, loss = _ours(model, tokens, images, mesh)
    assert logits.shape == (B, S, V)
    assert rel_error(logits, out.logits.numpy()) <= TOL, rel_error(logits, out.logits.numpy())
    np.testing.assert_allclose(loss, float(out.loss), rtol=TOL)
    # the keyword call (transformers' inputs, prepared on the host) is the same function
    direct = _call(model, tokens, **images)
    np.testing.assert_allclose(direct, logits, rtol=0, atol=1e-5)
    if p == 1:  # the images matter: text-only positions and embeddings give other logits
        with torch.no_grad():
            blind = hf_model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
        assert rel_error(blind[0], out.logits.numpy()[0]) > 100 * TOL


def _run_step(model, mesh, tokens, images, capacity=None):
    """(logits, objective, gradients) of one batch, the tower laid out for ``model``."""
    positions, vision = multimodal.prepare(tokens, model.cfg, shards=model.visual.shards(),
                                           capacity=capacity, **images)
    b, s = tokens.shape
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.ones((b, s)), "segment_ids": np.ones((b, s), np.int32),
             "positions": positions, "vision": vision}
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, batch):
        loss, grads = jax.value_and_grad(lambda p: objective(graphdef, p, batch, mesh)[0])(
            params)
        logits = nnx.merge(graphdef, params)(
            batch["tokens"], batch["positions"], batch["segment_ids"], batch["vision"])
        return logits, loss, grads

    logits, loss, grads = run(params, batch)
    return np.asarray(logits), float(loss), nnx.to_pure_dict(grads)


@pytest.fixture(scope="module")
def one_device_step(checkpoint):
    """The one-device step on ``_straddling_inputs(6)`` and the one-device logits of the
    text-only rows ``_text(np.random.default_rng(6))``."""
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32)
    tokens, images = _straddling_inputs(6)
    return _call(model, _text(np.random.default_rng(6))), _run_step(model, mesh, tokens, images)


@pytest.mark.parametrize("split", [False, True])
def test_split_and_replicated_towers_agree(checkpoint, one_device_step, split):
    """The tower split by frames over 4 devices (padded groups) and replicated on every
    device give the one-device logits and gradients; so does a batch padded to a larger
    patch budget, and a budget with no image at all gives the text-only logits."""
    tokens, images = _straddling_inputs(6)
    want_text, (want, want_loss, want_grads) = one_device_step
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    model.cfg = dataclasses.replace(model.cfg, vision=dataclasses.replace(
        model.cfg.vision, split=split))
    model.visual.cfg = model.cfg
    assert model.visual.shards() == (4 if split else 1)
    for capacity in (None, 256):
        got, loss, grads = _run_step(model, mesh, tokens, images, capacity)
        assert rel_error(got, want) <= 1e-5
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        vision_leaves = 0
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads),
                                jax.tree.leaves(want_grads), strict=True):
            g, w = np.asarray(g), np.asarray(w)
            assert np.max(np.abs(g - w)) <= 1e-4 * max(np.max(np.abs(w)), 1e-3), path
            vision_leaves += "visual" in jax.tree_util.keystr(path)
        assert vision_leaves == 2 + 12 + 4  # patch embed, merger norm; 12 per block; merger
    # a budget of padding only: the placeholders are text here, so no feature is placed
    text = _text(np.random.default_rng(6))
    positions, vision = multimodal.prepare(text, model.cfg, shards=model.visual.shards(),
                                           capacity=64)
    assert vision["pixels"].shape[0] == 64 * model.visual.shards()
    logits = _call(model, text, positions, None, vision)
    np.testing.assert_allclose(logits, want_text, rtol=0, atol=1e-5)


def test_a_shard_without_images_runs_the_same_program(checkpoint, hf_model):
    """On 4 devices only the last quarter of each row holds an image: the other shards run
    the same collectives with nothing to place, and every logit matches."""
    rng = np.random.default_rng(5)
    tokens = _text(rng)
    _place(tokens[0], 50, IMG, 6)
    _place(tokens[1], 52, IMG, 4)
    pix, grid = _media(rng, [[1, 4, 6], [1, 4, 4]])
    images = dict(pixel_values=pix, image_grid_thw=grid)
    with torch.no_grad():
        want = _hf_forward(hf_model, tokens, images).logits.numpy()
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, _ = _ours(model, tokens, images, mesh)
    assert rel_error(logits, want) <= TOL


def test_packed_documents_with_images_equal_each_document_alone(checkpoint, hf_model):
    """Two documents in one row, each with an image: positions restart per document (M-RoPE
    from the document's own start), attention stops at the boundary, and the features go to
    their own document's placeholders."""
    rng = np.random.default_rng(9)
    cut = 28
    tokens = _text(rng, b=1)
    _place(tokens[0], 4, IMG, 6)            # first document: an image of 2 x 3 units
    _place(tokens[0], cut + 10, IMG, 8)     # second: 2 x 4 units, across 32 and 48 (P = 4)
    pix1, g1 = _media(rng, [[1, 4, 6]])
    pix2, g2 = _media(rng, [[1, 4, 8]])
    seg = np.where(np.arange(S) < cut, 1, 2).astype(np.int32)[None]
    images = dict(pixel_values=np.concatenate([pix1, pix2]),
                  image_grid_thw=np.concatenate([g1, g2]))
    mesh = make_mesh(seq=4, data=1, devices=need_devices(4))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    logits, _ = _ours(model, tokens, images, mesh, segment_ids=seg)
    with torch.no_grad():
        first = _hf_forward(hf_model, tokens[:, :cut], dict(pixel_values=pix1, image_grid_thw=g1),
                            labels=False).logits.numpy()
        second = _hf_forward(hf_model, tokens[:, cut:], dict(pixel_values=pix2, image_grid_thw=g2),
                             labels=False).logits.numpy()
    assert rel_error(logits[:, :cut], first) <= TOL
    assert rel_error(logits[:, cut:], second) <= TOL


def test_vision_gradients_match_transformers(checkpoint):
    """d loss / d every weight (vision tower included) on 2 devices against torch's."""
    tokens, images = _straddling_inputs(3)
    hf = _hf_load(checkpoint)
    loss = _hf_forward(hf, tokens, images).loss
    loss.backward()
    want = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    batch = _batch(model, tokens, images)
    graphdef, params = nnx.split(model)
    grads = jax.jit(jax.grad(lambda p: objective(graphdef, p, batch, mesh)[0]))(params)
    ours = to_hf_tensors(model.cfg, nnx.to_pure_dict(grads))
    vision = [n for n in ours if n.startswith("visual.")]
    assert len(vision) == 2 + 3 * 12 + 4  # patch embed, merger norm, 12 per block, merger
    for name, g in ours.items():
        w = want[_hf_param_name(name)]
        assert np.max(np.abs(g - w)) <= TOL * max(np.max(np.abs(w)), 1e-3), name


def _hf_param_name(name):
    """transformers 5's in-memory parameter name of a published-layout tensor name."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def test_both_key_layouts_load_the_same_model(checkpoint, tmp_path):
    """The published layout (visual.*, model.*) and transformers 5's own (model.visual.*,
    model.language_model.*) give the same parameters."""
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert any(k.startswith("visual.") for k in tensors)
    renamed = {_hf_param_name(k): v for k, v in tensors.items()}
    assert any(k.startswith("model.language_model.layers.") for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp_path / "config.json", "w") as f:
        f.write(open(os.path.join(checkpoint, "config.json")).read())
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    a = nnx.to_pure_dict(nnx.state(from_pretrained(checkpoint, mesh=mesh), nnx.Param))
    b = nnx.to_pure_dict(nnx.state(from_pretrained(str(tmp_path), mesh=mesh), nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_export_round_trip(checkpoint, hf_model, tmp_path):
    mesh = make_mesh(seq=2, data=1, devices=need_devices(2))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    save_pretrained(model, str(tmp_path))
    written = json.load(open(tmp_path / "config.json"))
    assert written["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert written["vision_config"]["fullatt_block_indexes"] == [1]
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    tokens, images = _straddling_inputs(4)
    with torch.no_grad():
        want = _hf_forward(hf_model, tokens, images).logits.numpy()
        again = _hf_forward(_hf_load(str(tmp_path)), tokens, images).logits.numpy()
    assert rel_error(again, want) <= 1e-6
    reloaded = from_pretrained(str(tmp_path), mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    assert dataclasses.replace(reloaded.cfg) == model.cfg


def test_compare_hf_runs_an_image_and_a_video(checkpoint, monkeypatch):
    """``python -m ulysses_jax.compare hf`` on a Qwen2.5-VL checkpoint: transformers'
    image-text-to-text model against ours on seq=1 and 4, row 0 with an image across the
    middle and a video after it. Without the pixels on our side the comparison fails, so
    the media take part in it."""
    from ulysses_jax.interop import compare
    from ulysses_jax.models import multimodal as mm
    need_devices(4)
    lines, passed = compare.compare_hf(checkpoint, seqs=(1, 4), seq_len=S, batch=2,
                                       impl="xla")
    assert passed and lines[-1].startswith("PASS"), "\n".join(lines)
    assert any(line.startswith("row 0: an image of 5 x 6 tokens") and "video" in line
               for line in lines), lines
    losses = [float(l.split()[-1]) for l in lines if l.startswith(("transformers ", "ulysses_jax seq="))]
    assert len(losses) == 3 and max(losses) - min(losses) <= 1e-4 * losses[0], losses

    prepare = mm.prepare

    def without_pixels(*args, **kwargs):
        positions, vision = prepare(*args, **kwargs)
        return positions, dict(vision, pixels=np.zeros_like(vision["pixels"]))
    monkeypatch.setattr(mm, "prepare", without_pixels)
    _, passed = compare.compare_hf(checkpoint, seqs=(4,), seq_len=S, batch=2, impl="xla")
    assert not passed


def test_bad_inputs_name_the_numbers(checkpoint):
    mesh = make_mesh(seq=1, data=1, devices=need_devices(1))
    model = from_pretrained(checkpoint, mesh=mesh)
    tokens, images = _straddling_inputs(0)
    short = dict(images, image_grid_thw=np.array([[1, 8, 8]]),
                 pixel_values=images["pixel_values"][:64])
    with pytest.raises(ValueError, match="24 image placeholders.*give 16 features"):
        model(jnp.asarray(tokens), **short)
    with pytest.raises(ValueError, match=r"pixel_values must be \[patches, 1176\]"):
        model(jnp.asarray(tokens), **dict(images, pixel_values=images["pixel_values"][:5]))
    with pytest.raises(ValueError, match="divisible by model.vision.spatial_merge_size 2"):
        multimodal.vision_layout(np.array([[1, 5, 4]]), model.cfg.vision)


@pytest.mark.parametrize("over,match", [
    (["model.mrope_section=[2,3,2]"], "mrope_section .* sum to model.head_dim / 2 = 8"),
    (["model.vision.window_size=50"], "window_size 50 must be a multiple"),
    (["model.vision.fullatt_block_indexes=[5]"], r"fullatt_block_indexes \[5\]"),
    (["model.vision.num_heads=3"], "head dim divisible by 4"),
])
def test_bad_vision_configs_are_refused(over, match):
    base = ["model.family=qwen2_5_vl", "model.qkv_bias=true", "model.d_model=64",
            "model.n_heads=4", "model.head_dim=16", "model.vision.depth=3",
            "model.vision.hidden_size=32", "model.vision.num_heads=2",
            "model.vision.window_size=56", "model.vision.fullatt_block_indexes=[1]",
            "model.mrope_section=[2,3,3]"]
    load_config(None, base)  # the base is valid
    with pytest.raises(ConfigError, match=match):
        load_config(None, base + over)


def test_unsupported_checkpoints_are_refused():
    hf = {"model_type": "qwen2_5_vl", **HF_CONFIG}
    with pytest.raises(ValueError, match="out_hidden_size 48 differs from hidden_size 64"):
        config_from_hf({**hf, "vision_config": {**HF_CONFIG["vision_config"],
                                                "out_hidden_size": 48}})
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        config_from_hf({**hf, "text_config": {**HF_CONFIG["text_config"],
                                              "use_sliding_window": True}})
    with pytest.raises(ValueError, match="mrope_section"):
        config_from_hf({**hf, "text_config": {**HF_CONFIG["text_config"], "rope_parameters": {
            "rope_type": "default", "mrope_section": [4, 3, 3], "rope_theta": 1e4}}})


def test_omitted_text_keys_take_transformers_defaults():
    """A flat config.json without rms_norm_eps and num_key_value_heads reads as transformers
    reads it (Qwen2_5_VLTextConfig's defaults 1e-5 and 8); a null kv count means one per
    head there and here."""
    text = {k: v for k, v in HF_CONFIG["text_config"].items()
            if k not in ("rms_norm_eps", "num_key_value_heads")}
    flat = {"model_type": "qwen2_5_vl", **text, "hidden_size": 256, "num_attention_heads": 16,
            "vision_config": {**HF_CONFIG["vision_config"], "out_hidden_size": 256}}
    for extra, eps, kv in (({}, 1e-5, 8), ({"num_key_value_heads": None}, 1e-5, 16)):
        ours = config_from_hf({**flat, **extra})
        theirs = transformers.Qwen2_5_VLConfig(**{**flat, **extra}).text_config
        assert (ours.norm_eps, ours.n_kv_heads) == (theirs.rms_norm_eps,
                                                    theirs.num_key_value_heads) == (eps, kv)


# ----------------------------------------------------------------- LoRA on the decoder

# ------------------------------------------------------------------------ generation

def _generation_prompts():
    """Row 0: text, an image of 2 x 3 units, text, a two-frame video of 2 x 2 x 2 units
    (0.75 s per temporal patch), text; row 1: text only, shorter. Their media (per row)."""
    rng = np.random.default_rng(1)
    text = lambda n: [int(i) for i in rng.integers(0, 280, n)]  # noqa: E731
    row0 = (text(5) + [VSTART] + [IMG] * 6 + [VEND] + text(7) + [VSTART] + [VID] * 8
            + [VEND] + text(3))
    pix, grid = _media(rng, [[1, 4, 6]])
    vpix, vgrid = _media(rng, [[2, 4, 4]])
    return [row0, text(11)], [dict(pixel_values=pix, image_grid_thw=grid,
                                   pixel_values_videos=vpix, video_grid_thw=vgrid,
                                   second_per_grid_ts=np.array([0.75])), None]


@pytest.fixture(scope="module")
def hf_generated(hf_model):
    """transformers' greedy ``generate`` of each row alone: (new ids, their logits [T, V])."""
    out = []
    for ids, media in zip(*_generation_prompts()):
        t = torch.tensor([ids])
        mm = np.where(np.asarray([ids]) == IMG, 1, np.where(np.asarray([ids]) == VID, 2, 0))
        kw = {k: torch.from_numpy(np.asarray(v)) for k, v in (media or {}).items()}
        with torch.no_grad():
            made = hf_model.generate(t, attention_mask=torch.ones_like(t),
                                     mm_token_type_ids=torch.from_numpy(mm), do_sample=False,
                                     max_new_tokens=6, min_new_tokens=6, output_logits=True,
                                     return_dict_in_generate=True, **kw)
        out.append((made.sequences[0, len(ids):].tolist(),
                    torch.stack(made.logits)[:, 0].numpy()))
    return out


@pytest.mark.parametrize("data,p", [(1, 4), (2, 2)])
def test_generation_matches_transformers(checkpoint, hf_generated, data, p):
    """Greedy generation of an image + video prompt beside a text prompt in one batch (left
    padded; at seq 4 the image and the video straddle device boundaries): the new ids and
    every step's logits equal transformers' generate of each row alone (relative 1e-4). The
    new tokens' M-RoPE positions continue from the prompt's largest (transformers'
    rope_deltas: without them the image row's later logits are 2% off); a prompt whose
    placeholders have no images is refused."""
    from ulysses_jax.generation import GenerationError, Generator
    mesh = make_mesh(seq=p, data=data, devices=need_devices(p * data))
    model = from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32, attn_impl="xla")
    gen = Generator(nnx.to_pure_dict(nnx.state(model)), model.cfg, mesh)
    prompts, media = _generation_prompts()
    got = gen.generate(prompts, max_new_tokens=6, keep_logits=True, media=media)
    for (ids, logits), c in zip(hf_generated, got, strict=True):
        assert c.ids == ids, (c.ids, ids)
        assert rel_error(np.stack(c.logits), logits) <= TOL, rel_error(np.stack(c.logits), logits)
    with pytest.raises(GenerationError, match="the tokens hold 6 image placeholders"):
        gen.generate(prompts, max_new_tokens=2)


@pytest.fixture(scope="module")
def peft_vl(checkpoint):
    """transformers' model wrapped by peft with the target_modules our export writes for it
    (adapters on the decoder's projections only), random nonzero A and B."""
    peft = pytest.importorskip("peft", reason="peft is the reference implementation of LoRA")
    from ulysses_jax.hf import config_from_hf
    from ulysses_jax.interop.peft import adapter_config
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    lo = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"))
    conf = adapter_config(dataclasses.replace(cfg, lora=lo), checkpoint)
    wrapped = peft.get_peft_model(_hf_load(checkpoint), peft.LoraConfig(
        r=lo.rank, lora_alpha=lo.alpha, target_modules=conf["target_modules"])).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, prm in wrapped.named_parameters():
            if "lora_" in name:
                prm.copy_(0.2 * torch.randn(prm.shape, generator=g))
    return wrapped, lo


@pytest.mark.parametrize("p", [1, 2, 4])
def test_lora_on_the_decoder_matches_peft(checkpoint, peft_vl, p):
    """Adapters on the decoder of Qwen2.5-VL, an image and a video straddling the shards:
    logits, loss and every adapter gradient equal peft's (the tower frozen, and untouched by
    the export's target_modules); with model.lora.trainable=[vision] the tower is trained."""
    from ulysses_jax.hf import load_params
    from ulysses_jax.interop.peft import adapter_tensors, with_adapters
    from ulysses_jax.models import lora
    from ulysses_jax.models.decoder import Decoder
    wrapped, lo = peft_vl
    theirs = {n.replace(".default", ""): prm.detach().numpy()
              for n, prm in wrapped.named_parameters() if "lora_" in n}
    assert theirs and all(".language_model.layers." in n for n in theirs)
    tokens, images = _straddling_inputs(3)
    wrapped.zero_grad()
    out = _hf_forward(wrapped, tokens, images)
    out.loss.backward()
    want_grads = {n.replace(".default", ""): prm.grad.numpy()
                  for n, prm in wrapped.named_parameters() if "lora_" in n}

    mesh = make_mesh(seq=p, data=1, devices=need_devices(p))
    base_cfg, base = load_params(checkpoint, mesh)
    cfg = dataclasses.replace(base_cfg, lora=lo)
    model = nnx.eval_shape(lambda: Decoder(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    params = lora.overlay(with_adapters(cfg, nnx.to_pure_dict(abstract), theirs), base)
    params = jax.tree.map(jnp.asarray, params)
    positions, vision = multimodal.prepare(tokens, cfg, shards=model.visual.shards(), **images)
    b, s = tokens.shape
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.concatenate([np.ones((b, s - 1)), np.zeros((b, 1))], 1),
             "segment_ids": np.ones((b, s), np.int32), "positions": positions,
             "vision": vision}
    trained = lora.trainable_params(params, cfg.lora)
    assert "visual" not in trained and sum(x.size for x in jax.tree.leaves(trained)) == sum(
        x.size for x in theirs.values())

    @jax.jit
    def run(trained, batch):
        (obj, _), grads = jax.value_and_grad(
            lambda t: objective(graphdef, lora.overlay(params, t), batch, mesh),
            has_aux=True)(trained)
        logits = nnx.merge(graphdef, lora.overlay(params, trained))(
            batch["tokens"], batch["positions"], batch["segment_ids"], batch["vision"])
        return logits, obj, grads

    logits, loss, grads = run(trained, batch)
    assert rel_error(logits, out.logits.detach().numpy()) <= TOL, p
    assert abs(float(loss) - float(out.loss)) / float(out.loss) <= TOL, (p, loss, out.loss)
    got = adapter_tensors(cfg, grads)
    assert sorted(got) == sorted(want_grads)
    worst = max(rel_error(g, want_grads[n]) for n, g in got.items())
    assert worst <= TOL, (p, worst)
    print(f"qwen2.5-vl LoRA seq={p}: logits {rel_error(logits, out.logits.detach().numpy()):.2e}, "
          f"loss {abs(float(loss) - float(out.loss)) / float(out.loss):.2e}, adapter grads "
          f"max {worst:.2e}")
    if p == 1:  # the tower as a trained group: every tower parameter, nothing else new
        with_tower = lora.trainable_params(params, dataclasses.replace(lo, trainable=("vision",)))
        assert jax.tree.structure(with_tower["visual"]) == jax.tree.structure(params["visual"])
        assert {k for k in with_tower if k != "visual"} == set(trained)
