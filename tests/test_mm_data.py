"""Multimodal chat data (data/media.py, prepare --chat, store media, ChatRows.row_media):
token ids equal transformers' Qwen2_5_VLProcessor's, grids equal preprocess_images', videos
from frame folders, relative paths, nothing to do / rebuild, row order, the dropping rule,
load_item, and text-only chat stores unchanged."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from tests.test_chat import CHATML, SPECIAL, decode, supervised_runs, write_tokenizer_dir
from ulysses_jax.data.__main__ import main as data_cli
from ulysses_jax.data import chat, images, media, packing, prepare as prepare_lib
from ulysses_jax.data.text import load_tokenizer
from ulysses_jax.data.store import TokenStore

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL style: ChatML; a list content prints its text parts and, per image / video part,
# the vision markers around one pad.
VL_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif p['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture
def vl_tok(tmp_path, monkeypatch):
    """A tokenizer directory with the Qwen2-VL special tokens and VL_TEMPLATE."""
    from tests import test_chat
    monkeypatch.setattr(test_chat, "SPECIAL", SPECIAL + VISION)
    return write_tokenizer_dir(tmp_path / "vltok", VL_TEMPLATE)


def noise(path, height, width, seed=0, **save):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path, **save)
    return str(path)


def user_images(*names, text="Say hi"):
    return {"role": "user", "content": [{"type": "image", "image": n} for n in names]
            + [{"type": "text", "text": text}]}


def write_jsonl(path, convs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return str(path)


def prep(src, out, tok, **kw):
    return prepare_lib.prepare([str(src)], str(out), tok, chat=True, progress=False, **kw)


def pad_ids(tok_dir):
    t = load_tokenizer(tok_dir)._tok
    return t.token_to_id("<|image_pad|>"), t.token_to_id("<|video_pad|>")


def test_tokens_equal_qwen2_5_vl_processor(tmp_path, vl_tok):
    """Two images of different sizes: our ids are the processor's, grids preprocess_images',
    and only the assistant's text is supervised."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
        Qwen2VLImageProcessorPil

    class Processor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # no video processor: it
            return None  # needs torchvision, which is not installed

    data = tmp_path / "data"
    data.mkdir()
    a, b = noise(data / "a.png", 100, 150, 1), noise(data / "b.jpg", 300, 200, 2)
    conv = [{"role": "system", "content": "You are terse."},
            user_images("a.png", "b.jpg", text=" the answer is"),
            {"role": "assistant", "content": "Say hi"},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
            {"role": "assistant", "content": [{"type": "text", "text": " 42"}]}]
    src = write_jsonl(data / "c.jsonl", [conv])
    manifest, built = prep(src, tmp_path / "s", vl_tok)
    store = TokenStore(str(tmp_path / "s"))
    tokens, weights = store.doc(0), store.doc(0, weights=True)

    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(vl_tok)
    proc = Processor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=hf_tok,
                     video_processor=None)
    text = chat.ChatTemplate.from_dir(vl_tok).render(conv)
    ref = proc(text=[text], images=[Image.open(a), Image.open(b)], return_tensors="np")
    np.testing.assert_array_equal(tokens, ref["input_ids"][0])
    _, grids = images.preprocess_images([a, b])
    np.testing.assert_array_equal(ref["image_grid_thw"], grids)
    items = store.media(0)
    assert [it["grid"] for it in items] == grids.tolist() == [[1, 8, 10], [1, 22, 14]]
    assert items == [{"kind": "image", "paths": [p], "grid": g, "second_per_grid_ts": None}
                     for p, g in zip((a, b), grids.tolist())]
    image_id, video_id = pad_ids(vl_tok)
    assert int((tokens == image_id).sum()) == 20 + 77
    assert built and manifest["media"] == {
        **media.MediaOptions().as_dict(), "num_images": 2, "num_videos": 0,
        "max_frame_patches": 22 * 14, "image_token_id": image_id, "video_token_id": video_id,
        "sources_fingerprint": manifest["media"]["sources_fingerprint"],
        "files_fingerprint": manifest["media"]["files_fingerprint"]}
    runs = supervised_runs(load_tokenizer(vl_tok), tokens, weights)[0]
    assert runs == ["Say hi<|im_end|>", " 42<|im_end|>"]
    assert not weights[tokens == image_id].any()


def test_image_in_an_answer_keeps_the_answers_weight(tmp_path, vl_tok):
    noise(tmp_path / "a.png", 60, 60)
    conv = [user_images(), {"role": "assistant", "content": [
        {"type": "text", "text": "Say"}, {"type": "image", "image": "a.png"}]}]
    conv[0]["content"] = "hi"
    prep(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "s", vl_tok)
    store = TokenStore(str(tmp_path / "s"))
    tokens, weights = store.doc(0), store.doc(0, weights=True)
    pads = tokens == pad_ids(vl_tok)[0]
    assert pads.sum() == images.placeholder_count(store.media(0)[0]["grid"]) > 0
    assert weights[pads].all()


def test_grid_follows_exif_orientation(tmp_path, vl_tok):
    """A JPEG stored 60 x 200 but rotated by its EXIF tag: the grid is that of the upright
    image, as preprocess_images (load_image's exif_transpose) sees it."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: height and width swap
    path = noise(tmp_path / "r.jpg", 60, 200, exif=exif)
    conv = [user_images("r.jpg"), {"role": "assistant", "content": "hi"}]
    prep(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "s", vl_tok)
    item = TokenStore(str(tmp_path / "s")).media(0)[0]
    _, grid = images.preprocess_images(path)
    assert item["grid"] == grid[0].tolist() and grid[0, 1] > grid[0, 2]


def test_video_from_frame_folder_with_fps(tmp_path, vl_tok):
    """10 frames at 4 fps sampled to 2 fps: 4 frames (0, 2, 5, 7 by the video processor's
    rule, at least min_frames=4, a multiple of 2), t = 2; a list of 3 frames without fps keeps
    all (t = 2, fps unknown: 24). Counts by hand; pixels equal preprocess_video's."""
    clip = tmp_path / "clips" / "one"
    clip.mkdir(parents=True)
    frames = [noise(clip / f"frame_{i}.png", 56, 84, seed=i) for i in range(1, 11)]
    listed = [noise(tmp_path / f"l{i}.png", 40, 40, seed=20 + i) for i in range(3)]
    conv = [{"role": "user", "content": [
                {"type": "video", "video": "clips/one", "fps": 4.0},
                {"type": "text", "text": "Say"},
                {"type": "video", "video": ["l0.png", "l1.png", "l2.png"]}]},
            {"role": "assistant", "content": "hi"}]
    manifest, _ = prep(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "s", vl_tok)
    store = TokenStore(str(tmp_path / "s"))
    first, second = store.media(0)
    h, w = images.smart_resize(56, 84, 28, images.VIDEO_MIN_PIXELS, images.VIDEO_MAX_PIXELS)
    assert first == {"kind": "video", "paths": [frames[i] for i in (0, 2, 5, 7)],
                     "grid": [2, h // 14, w // 14], "second_per_grid_ts": 2 / (4 / 10 * 4.0)}
    h2, w2 = images.smart_resize(40, 40, 28, images.VIDEO_MIN_PIXELS, images.VIDEO_MAX_PIXELS)
    assert second == {"kind": "video", "paths": listed, "grid": [2, h2 // 14, w2 // 14],
                      "second_per_grid_ts": 2 / 24}
    tokens = store.doc(0)
    video_id = pad_ids(vl_tok)[1]
    assert int((tokens == video_id).sum()) == (2 * h * w + 2 * h2 * w2) // (14 * 14 * 4)
    assert manifest["media"]["num_videos"] == 2 and manifest["media"]["num_images"] == 0
    assert manifest["media"]["max_frame_patches"] == max(h * w, h2 * w2) // 196
    # Two spawned workers write the same bytes (grids are found in the workers).
    prep(tmp_path / "c.jsonl", tmp_path / "s2", vl_tok, workers=2)
    for name in os.listdir(tmp_path / "s"):
        if name != "manifest.json":
            assert (tmp_path / "s" / name).read_bytes() == (tmp_path / "s2" / name).read_bytes()
    pixels, grid = media.load_item(first, **media.load_options(manifest))
    ref_pixels, ref_grid = images.preprocess_video(first["paths"])
    np.testing.assert_array_equal(pixels, ref_pixels)
    assert grid.tolist() == ref_grid[0].tolist() == first["grid"]
    assert pixels.shape == (2 * (h // 14) * (w // 14), 1176) and pixels.dtype == np.float32


def test_relative_and_absolute_paths(tmp_path, vl_tok):
    data = tmp_path / "deep" / "data"
    (data / "img").mkdir(parents=True)
    rel = noise(data / "img" / "a.png", 50, 70)
    absolute = noise(tmp_path / "b.png", 70, 50)
    conv = [user_images("img/a.png", absolute), {"role": "assistant", "content": "hi"}]
    write_jsonl(data / "c.jsonl", [conv])
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a relative source path: media paths still resolve from its directory
    try:
        prep("deep/data/c.jsonl", tmp_path / "s", vl_tok)
    finally:
        os.chdir(cwd)
    assert [it["paths"] for it in TokenStore(str(tmp_path / "s")).media(0)] == [[rel],
                                                                                [absolute]]
    conv[0]["content"][0]["image"] = "img/missing.png"
    write_jsonl(data / "d.jsonl", [conv])
    with pytest.raises(ValueError, match=r"d.jsonl:1: image 'img/missing.png'.*missing.png"):
        prep(data / "d.jsonl", tmp_path / "s2", vl_tok)


def test_rerun_is_a_noop_and_a_touched_image_rebuilds(tmp_path, vl_tok):
    a = noise(tmp_path / "a.png", 80, 90)
    src = write_jsonl(tmp_path / "c.jsonl", [[user_images("a.png"),
                                              {"role": "assistant", "content": "hi"}]])
    manifest, built = prep(src, tmp_path / "s", vl_tok)
    assert built and prep(src, tmp_path / "s", vl_tok) == (manifest, False)
    assert sorted(os.listdir(tmp_path / "s")) == sorted(
        ["manifest.json", "offsets.bin", "doc_hash.bin", "tokens-00000.bin",
         "weights-00000.bin", "media.jsonl", "media_offsets.bin", "media_inputs.json",
         "chat_template.jinja"])
    with pytest.raises(ValueError, match="other pixel options: image_max_pixels"):
        prep(src, tmp_path / "s", vl_tok, image_max_pixels=28 * 28 * 4)
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    with pytest.raises(ValueError, match=f"media file {a} changed.*--force"):
        prep(src, tmp_path / "s", vl_tok)
    manifest2, built = prep(src, tmp_path / "s", vl_tok, force=True)
    assert built and manifest2["fingerprint"] != manifest["fingerprint"]
    assert manifest2["media"]["sources_fingerprint"] == manifest["media"]["sources_fingerprint"]
    assert prep(src, tmp_path / "s", vl_tok)[1] is False


def test_row_media_order_and_long_media_dropped(tmp_path, vl_tok, capsys):
    """Two conversations in one row: row_media lists their items in placeholder order. Under
    truncate, a conversation with media longer than seq_len is dropped, one without is cut."""
    for name, (h, w) in {"a": (60, 60), "b": (100, 150), "c": (60, 90), "d": (400, 400)}.items():
        noise(tmp_path / f"{name}.png", h, w)
    convs = [[user_images("a.png", "b.png"), {"role": "assistant", "content": "Say hi"}],
             [user_images("c.png"), {"role": "assistant", "content": "again"}],
             [user_images("d.png"), {"role": "assistant", "content": "the answer"}],
             [{"role": "user", "content": "Say" + " the answer is" * 30},
              {"role": "assistant", "content": "hi"}]]
    prep(write_jsonl(tmp_path / "c.jsonl", convs), tmp_path / "s", vl_tok)
    store = TokenStore(str(tmp_path / "s"))
    lengths = store.lengths()
    assert lengths[2] > lengths[3] > lengths[0] + lengths[1]
    seq_len = int(lengths[3]) - 1  # 0 and 1 fit together; 2 (media) and 3 (text) do not
    image_id = pad_ids(vl_tok)[0]
    rows = packing.ChatRows(store, np.arange(4), seq_len, seed=3)
    assert rows.num_long == 2 and rows.num_long_media == 1
    assert sorted(rows.ids.tolist()) == [0, 1, 3]  # 3 truncated, 2 dropped
    checked = 0
    for r in range(rows.num_rows):
        row, items = rows.row(r, seed=3), rows.row_media(r, seed=3)
        plan = int(rows._perm(3, 0)[r])
        docs = rows.ids[rows.row_docs[rows.row_start[plan]:rows.row_start[plan + 1]]]
        assert items == [it for d in docs for it in store.media(int(d))]
        # The pads of the row, run by run, are the items' counts in order.
        pads = (row["tokens"] == image_id).astype(np.int8)
        starts = np.flatnonzero(np.diff(np.r_[0, pads]) == 1)
        ends = np.flatnonzero(np.diff(np.r_[pads, 0]) == -1) + 1
        assert (ends - starts).tolist() == [images.placeholder_count(it["grid"]) for it in items]
        if len(docs) == 2:
            assert sorted(docs.tolist()) == [0, 1] and len(items) == 3
            checked += 1
    assert checked == 1
    drop = packing.ChatRows(store, np.arange(4), seq_len, overflow="drop")
    assert sorted(drop.ids.tolist()) == [0, 1]
    _, _, notes = packing.store_rows(str(tmp_path / "s"), seq_len)
    assert "1 longer than seq_len were truncated" in notes[0]
    assert "1 longer than seq_len with images or videos were dropped" in notes[0]
    # show marks the images of the packed row.
    r = next(r for r in range(rows.num_rows) if len(rows.row_media(r)) == 3)
    assert data_cli(["show", str(tmp_path / "s"), "--seq-len", str(seq_len), "--row", str(r),
                     "--heldout-fraction", "0"]) == 0
    out = capsys.readouterr().out
    a = os.path.join(tmp_path, "a.png")
    assert f"<|vision_start|><|image_pad|> x 4 (image {a}, grid 1 x 4 x 4)<|vision_end|>" in out
    assert out.count("<|image_pad|> x ") == 3 and "<|image_pad|><|image_pad|>" not in out


def test_load_item_detects_a_changed_file(tmp_path, vl_tok):
    a = noise(tmp_path / "a.png", 100, 150)
    prep(write_jsonl(tmp_path / "c.jsonl", [[user_images("a.png"),
                                             {"role": "assistant", "content": "hi"}]]),
         tmp_path / "s", vl_tok)
    store = TokenStore(str(tmp_path / "s"))
    item, opts = store.media(0)[0], media.load_options(store.manifest)
    pixels, grid = media.load_item(item, **opts)
    ref_pixels, ref_grid = images.preprocess_images(a)
    np.testing.assert_array_equal(pixels, ref_pixels)
    assert grid.tolist() == ref_grid[0].tolist() == item["grid"]
    noise(tmp_path / "a.png", 300, 150)
    with pytest.raises(ValueError, match=f"{a}: its image grid is now 1 x 22 x 10, the store "
                                         f"recorded 1 x 8 x 10: the file changed"):
        media.load_item(item, **opts)


def test_tokenizer_without_image_pad(tmp_path):
    tok = write_tokenizer_dir(tmp_path / "tok", VL_TEMPLATE)  # no vision tokens
    noise(tmp_path / "a.png", 60, 60)
    src = write_jsonl(tmp_path / "c.jsonl", [[user_images("a.png"),
                                              {"role": "assistant", "content": "hi"}]])
    with pytest.raises(ValueError, match=r"c.jsonl:1: the conversation has images but the "
                                         r"tokenizer .* has no <\|image_pad\|> token"):
        prep(src, tmp_path / "s", tok)
    assert not (tmp_path / "s").exists()


def test_template_that_drops_images_is_refused(tmp_path, vl_tok):
    """A template that prints no pad for an image part: the counts differ, refused."""
    noise(tmp_path / "a.png", 60, 60)
    conv = [user_images("a.png"), {"role": "assistant", "content": "hi"}]
    template = chat.ChatTemplate(VL_TEMPLATE.replace("<|image_pad|>", ""))
    with pytest.raises(ValueError, match=r"c:3: the rendered text holds 0 <\|image_pad\|> for "
                                         r"1 image part"):
        media.encode_conversation(load_tokenizer(vl_tok), template, conv, str(tmp_path),
                                  media.MediaOptions(), "c:3")


def test_text_only_chat_store_unchanged(tmp_path, vl_tok):
    """No media: the store has exactly the files and tokens of a text-only chat store (and its
    template's copy), and other pixel options change nothing (nothing to do)."""
    from tests.test_chat import TRAP
    src = write_jsonl(tmp_path / "c.jsonl", [TRAP, TRAP[1:3]])
    manifest, built = prep(src, tmp_path / "s", vl_tok)
    assert built and "media" not in manifest
    assert sorted(os.listdir(tmp_path / "s")) == sorted(
        ["manifest.json", "offsets.bin", "doc_hash.bin", "tokens-00000.bin",
         "weights-00000.bin", "chat_template.jinja"])
    store, tok = TokenStore(str(tmp_path / "s")), load_tokenizer(vl_tok)
    template = chat.ChatTemplate.from_dir(vl_tok)
    for d, conv in enumerate([TRAP, TRAP[1:3]]):
        tokens, weights = chat.encode_conversation(tok, template, conv)
        np.testing.assert_array_equal(store.doc(d), tokens)
        np.testing.assert_array_equal(store.doc(d, True), weights)
        assert store.media(d) == [] and not store.has_media().any()
    assert decode(tok, store.doc(0)).startswith("<|im_start|>system\nYou are terse.")
    assert prep(src, tmp_path / "s", vl_tok, image_max_pixels=28 * 28 * 4)[1] is False
    rows = packing.ChatRows(store, np.arange(2), 64)
    assert all(rows.row_media(r) == [] for r in range(rows.num_rows))
    # The plain ChatML template (string content only) still refuses list content, by name.
    with pytest.raises(ValueError, match="x:1: the chat template failed"):
        media.encode_conversation(tok, chat.ChatTemplate(CHATML),
                                  [user_images(), {"role": "assistant", "content": "hi"}],
                                  str(tmp_path), media.MediaOptions(), "x:1")


def test_placeholder_in_text_without_its_media_is_refused(tmp_path, vl_tok):
    """A pad written in the text (a conversation about the format) has no image to stand for:
    refused at prepare, naming the conversation and the count, in a chat store (with or
    without media parts in the conversation). A text store made with this tokenizer keeps such
    documents (a text model reads them as any token) and names them in its manifest; a
    multimodal model refuses that store before training."""
    noise(tmp_path / "a.png", 56, 56)
    about = [{"role": "user", "content": "What do <|image_pad|> and <|image_pad|> mean?"},
             {"role": "assistant", "content": "Say hi"}]
    src = write_jsonl(tmp_path / "c.jsonl", [[user_images("a.png"),
                                              {"role": "assistant", "content": "hi"}], about])
    with pytest.raises(ValueError, match=r"c.jsonl:2: the rendered text holds 2 "
                                         r"<\|image_pad\|> for 0 image part"):
        prep(src, tmp_path / "s", vl_tok)
    assert not (tmp_path / "s").exists()
    video_in_text = [user_images("a.png", text="and <|video_pad|>"),
                     {"role": "assistant", "content": "hi"}]
    with pytest.raises(ValueError, match=r"c2.jsonl:1: the rendered text holds 1 "
                                         r"<\|video_pad\|> for 0 video part"):
        prep(write_jsonl(tmp_path / "c2.jsonl", [video_in_text]), tmp_path / "s", vl_tok)
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "plain"}) + "\n"
                    + json.dumps({"text": "a <|video_pad|> b <|video_pad|>"}) + "\n")
    video_id = pad_ids(vl_tok)[1]
    manifest, _ = prepare_lib.prepare([str(text)], str(tmp_path / "t"), vl_tok, progress=False)
    held = f"{text}:2: 2 <|video_pad|> (token id {video_id})"
    assert manifest["text_placeholders"] == {"documents": 1, "named": [held]}
    assert "1 text document(s) holding image / video" in prepare_lib.describe(manifest)
    from ulysses_jax.config import ConfigError, load_config
    from ulysses_jax.data.vision_batches import check_store
    vl = load_config(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                  "tiny-qwen2.5-vl.yaml"))
    with pytest.raises(ConfigError, match=r"1 text document\(s\) of the store hold image / "
                                          r"video placeholder tokens with no image or video "
                                          r"\(.*t.jsonl:2: 2 <\|video_pad\|>"):
        check_store(vl, manifest)
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "plain"}) + "\n")
    plain, _ = prepare_lib.prepare([str(tmp_path / "p.jsonl")], str(tmp_path / "p"), vl_tok,
                                   progress=False)
    assert "text_placeholders" not in plain


def test_unreadable_images_are_named(tmp_path, vl_tok, monkeypatch, capsys):
    """A truncated file is refused at prepare (it is decoded there), and load_item names a
    file that broke after prepare; an image over Pillow's decompression-bomb limit (here
    lowered so that 60 x 60 is over it) is named with its pixel count by prepare, the data
    CLI (exit 2, no traceback) and load_item."""
    good = noise(tmp_path / "a.jpg", 60, 60)
    raw = (tmp_path / "a.jpg").read_bytes()
    (tmp_path / "bad.jpg").write_bytes(raw[:len(raw) // 2])
    conv = [user_images("bad.jpg"), {"role": "assistant", "content": "hi"}]
    src = write_jsonl(tmp_path / "c.jsonl", [conv])
    with pytest.raises(ValueError, match=r"c.jsonl:1: image 'bad.jpg': image file is truncated"):
        prep(src, tmp_path / "s", vl_tok)
    conv[0] = user_images("a.jpg")
    manifest, _ = prep(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "s", vl_tok)
    item, opts = TokenStore(str(tmp_path / "s")).media(0)[0], media.load_options(manifest)
    (tmp_path / "a.jpg").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match=f"{good}: cannot read this image file: image file is "
                                         f"truncated"):
        media.load_item(item, **opts)
    (tmp_path / "a.jpg").write_bytes(raw)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # refused above 2 x 1000 pixels
    with pytest.raises(ValueError, match=f"{good}: cannot read this image file: Image size "
                                         f"\\(3600 pixels\\)"):
        media.load_item(item, **opts)
    with pytest.raises(ValueError, match=r"c.jsonl:1: image 'a.jpg': Image size \(3600 pixels\)"):
        prep(src, tmp_path / "s2", vl_tok)
    assert data_cli(["prepare", src, "--out", str(tmp_path / "s2"), "--tokenizer", vl_tok,
                     "--chat", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "c.jsonl:1: image 'a.jpg': Image size (3600 pixels)" in err


def test_media_parts_that_name_no_frames_or_file_say_what_is_needed(tmp_path, vl_tok):
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)
    for part, match in (({"type": "video", "video": "clip.mp4"},
                         r"video 'clip.mp4': .*clip.mp4 is a file; a video must be a folder of "
                         r"frame images or a list of frame image files .* video files are not "
                         r"decoded here"),
                        ({"type": "image", "url": "https://example.com/a.png"},
                         r"image part: it names no file: an image part gives its file under "
                         r"the key \"image\" \(or \"path\"\).* keys \['type', 'url'\]; URLs are "
                         r"not fetched")):
        conv = [{"role": "user", "content": [part, {"type": "text", "text": "Say"}]},
                {"role": "assistant", "content": "hi"}]
        with pytest.raises(ValueError, match="c.jsonl:1: " + match):
            prep(write_jsonl(tmp_path / "c.jsonl", [conv]), tmp_path / "s", vl_tok)
